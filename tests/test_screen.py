"""scripts/screen.py's report (docs/screening.md's table) on a tiny fake results file:
a row per run, and a mean row for a candidate run to the end on several seeds."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "screen.py"


def _module():
    spec = importlib.util.spec_from_file_location("_script_screen", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(method, seed, accs, bits, epochs=10):
    curve = [{"epoch": e + 1, "step": 234 * (e + 1), "acc": a} for e, a in enumerate(accs)]
    return {
        "method": method, "seed": seed, "epochs": epochs, "status": "ok", "curve": curve,
        "bits_per_value": bits, "wall_s": 100.0,
    }  # fmt: skip


def test_report_rows_and_the_mean_of_seeds(monkeypatch):
    m = _module()
    ddp = [0.80] * 10
    monkeypatch.setattr(m, "reference_rows", lambda model: [("DDP (matrix)", ddp, 32.0, "1,2,3")])
    runs = [
        _run("cand", 2, [0.70] * 9 + [0.88], 0.6),
        _run("cand", 1, [0.70] * 9 + [0.86], 0.8),
        _run("short", 1, [0.75] * 3, 1.0, epochs=3),
        _run("short", 2, [0.76] * 3, 1.0, epochs=3),  # screens, not whole runs: no mean row
        {**_run("cand", 3, [0.1] * 10, 0.1), "status": "failed"},
    ]
    monkeypatch.setattr(m, "load_results", lambda model: runs)
    monkeypatch.setitem(m.COLUMNS, "vit", (1, 10))
    lines = m.report("vit").splitlines()
    names = [line.split(" | ")[0].lstrip("| ") for line in lines[2:]]
    assert names == ["DDP (matrix)", "cand", "cand", "short", "short", "cand, mean of seeds 1,2"]
    mean = lines[-1]
    # (86 + 88) / 2 = 87.00, 7.00 above DDP's 80; bits (0.8 + 0.6) / 2
    assert "| 87.00 (+7.00) |" in mean and "| 0.700 | 1,2 | 10 | - |" in mean
    assert "| short | 75.00 (-5.00) |  | 1.000 | 1 | 3 |" in lines[5]  # epoch 10 not run


def test_each_model_has_its_recipe_file_and_job_directory(tmp_path, monkeypatch):
    m = _module()
    monkeypatch.setattr(m, "RESULTS_DIR", tmp_path)
    assert m.results_file("vit").name == "screening_vit.jsonl"  # the ViT's file, as before
    assert m.results_file("mlp10m").name == "screening_mlp10m.jsonl"
    assert m.job_dir("vit", "3lc", 1).name == "3lc-seed1"  # kept: older checkpoints resume
    assert m.job_dir("cnn", "3lc", 1).name == "cnn-3lc-seed1"
    cmd = m.train_command("mlp10m", "3lc-allgather", 2, 3, tmp_path)
    assert cmd[cmd.index("--model") + 1] == "mlp10m" and cmd[cmd.index("--epochs") + 1] == "5"
    with pytest.raises(SystemExit):  # past the MLP's 5 epochs
        m.main(["run", "--model", "mlp10m", "--methods", "3lc", "--until", "6"])
