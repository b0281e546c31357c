"""bench_peers in resumable pieces (``--launches``, ``--max-launches``;
scripts/_bench/launchlog.py), without a namespace or torchrun: a fake launch stands in
for torchrun, so what is tested is which launches run, what is recorded and how the
pieces' table is joined."""

from __future__ import annotations

import importlib.util
import itertools
import json
from pathlib import Path

import pytest

from scripts._bench import launchlog

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def peers(monkeypatch):
    """bench_peers with a fake namespace and a fake launch that records its calls; each
    launch's step times come from a counter (launch k times every row at 0.1 k s)."""
    spec = importlib.util.spec_from_file_location("_pieces_bench_peers", ROOT / "scripts" /
                                                  "bench_peers.py")  # fmt: skip
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module.netns, "netns_available", lambda: None)
    monkeypatch.setattr(module.netns, "in_namespace", lambda ns, prefix, body: body() or False)
    counter = itertools.count(1)
    module.calls = []

    def fake_launch(args, ns, rate):
        k = next(counter)
        module.calls.append((tuple(args.rows), rate))
        return [{"model": m, "rate": rate, "row": r, "step_s": 0.1 * k, "step_min_s": 0.0,
                 "step_max_s": 1.0, "wire_mb": 1.0, "period_s": 0.09 * k,
                 "bits_per_value": None, "compress_s": 0.0, "wait_s": 0.0, "decode_s": 0.0}
                for m in args.models for r in args.rows]  # fmt: skip

    module.launch = fake_launch
    return module


def _run(peers, tmp_path, *argv) -> list[dict]:
    out = tmp_path / "out"
    rc = peers.main(["--models", "mlp10m", "--rates", "100mbit", "--launches",
                     str(tmp_path / "launches.jsonl"), "--out", str(out), *argv])  # fmt: skip
    assert rc == 0
    return json.loads((out / "bench_peers.json").read_text())["rows"]


def test_pieces_run_only_the_launches_not_recorded_and_count_the_recorded_ones(peers, tmp_path):
    rows = _run(peers, tmp_path, "--rows", "ddp", "--max-launches", "2")
    assert peers.calls == [(("ddp",), "100mbit")] * 2
    assert rows[0]["repeats"] == 2 and rows[0]["step_runs_s"] == pytest.approx([0.1, 0.2])
    rows = _run(peers, tmp_path, "--rows", "ddp", "--max-launches", "2")
    assert len(peers.calls) == 3  # one launch was left of the three
    assert rows[0]["repeats"] == 3
    assert rows[0]["step_runs_s"] == pytest.approx([0.1, 0.2, 0.3])
    assert rows[0]["step_s"] == pytest.approx(0.2) and rows[0]["period_s"] == pytest.approx(0.18)
    rows = _run(peers, tmp_path, "--rows", "ddp")
    assert len(peers.calls) == 3  # nothing left: the table again, from the file
    assert [r["step_runs_s"] for r in rows] == [pytest.approx([0.1, 0.2, 0.3])]
    records = launchlog.read(tmp_path / "launches.jsonl")
    assert [r["rate"] for r in records] == ["100mbit"] * 3
    assert records[0]["config"]["rows"] == ["ddp"] and records[0]["config"]["steps"] == 10


def test_the_table_joins_pieces_of_other_rows_but_not_of_other_settings(peers, tmp_path):
    _run(peers, tmp_path, "--rows", "ddp")
    _run(peers, tmp_path, "--rows", "ddp", "--steps", "30")  # another measurement
    rows = _run(peers, tmp_path, "--rows", "torch-bf16", "hvdc-dqsg-allgather")
    assert [r["row"] for r in rows] == ["ddp", "torch-bf16", "hvdc-dqsg-allgather"]
    assert rows[0]["step_runs_s"] == pytest.approx([0.1, 0.2, 0.3])
    assert rows[1]["step_runs_s"] == pytest.approx([0.7, 0.8, 0.9])
    assert all(r["repeats"] == 3 for r in rows)
    thirty = _run(peers, tmp_path, "--rows", "ddp", "--steps", "30")
    assert [r["step_runs_s"] for r in thirty] == [pytest.approx([0.4, 0.5, 0.6])]
    # a rate is a launch's own: another rate's launches are not counted for this one
    rows = _run(peers, tmp_path, "--rows", "ddp", "--rates", "1gbit", "--max-launches", "1")
    assert peers.calls[-1] == (("ddp",), "1gbit")
    assert {(r["rate"], r["repeats"]) for r in rows} == {("100mbit", 3), ("1gbit", 1)}


def test_a_line_that_is_not_a_launch_is_refused_with_its_number(peers, tmp_path):
    log = tmp_path / "launches.jsonl"
    _run(peers, tmp_path, "--rows", "ddp", "--max-launches", "1")
    with log.open("a") as f:
        f.write('{"config": {"rows": ["ddp"]}, "rate": "100mb\n')  # a piece killed mid-write
    with pytest.raises(ValueError, match=r"launches.jsonl:2: not a JSON line"):
        _run(peers, tmp_path, "--rows", "ddp")
    log.write_text('{"rate": "100mbit"}\n')
    with pytest.raises(ValueError, match=r"launches.jsonl:1: not a launch record"):
        launchlog.read(log)
    assert launchlog.read(tmp_path / "none.jsonl") == []


@pytest.mark.parametrize(
    "argv", [["--max-launches", "2"], ["--launches", "x.jsonl", "--max-launches", "0"]]
)
def test_a_piece_needs_its_record_and_at_least_one_launch(peers, argv):
    with pytest.raises(SystemExit):
        peers.main(["--rows", "ddp", *argv])
