"""scripts/bench_peers.py without a namespace or torchrun: the training recipe a rank
times (train.py's model, SGD and Fashion-MNIST batches for seed 1), the random recipe of
before, and how the rows of ``--repeats`` launches are combined. Fashion-MNIST must be
installed (scripts/setup.sh): a missing file fails these tests, it does not skip them."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from scripts._bench import recipe
from scripts._bench.peerreport import combine_launches, summary, table

ROOT = Path(__file__).resolve().parents[1]


def _script(name: str):
    spec = importlib.util.spec_from_file_location(f"_recipe_test_{name}", ROOT / "scripts" / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


train = _script("train.py")


def _train_replica(flags: list[str]):
    """train.py's replica (model and optimizer) for ``flags``, one simulated rank."""
    from hvdcompress.training.replica import build_replica
    from hvdcompress.training.simulate import run_ranks

    args = train.parse_args([*flags, "--seed", "1", "--model", "cnn"])
    (replica,) = run_ranks(1, lambda dist: build_replica(args, dist))
    return args, replica


def _same_parameters(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    pairs = zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    return all(torch.equal(x, y) for x, y in pairs)


def test_the_training_recipe_steps_on_train_pys_batches_model_and_sgd():
    from hvdcompress.training.data import DATA_DIR, MEAN, STD, load_fashion_mnist
    from hvdcompress.training.methods import METHODS

    (x_train, y_train), _ = load_fashion_mnist(DATA_DIR)  # missing files: this fails
    data = recipe.load("training")
    assert torch.equal(data[0][0], x_train)
    rec = recipe.build("training", "cnn", "3lc", rank=1, size=4, batch=64, width=16, data=data)
    assert rec.fields == {"recipe": "training", "data": "fashion-mnist", "seed": 1,
                          "batch": 64, "lr": 0.05, "momentum": 0.9}  # fmt: skip
    # train.py's order for seed 1: epoch 0's permutation seeded 1 + 0, rank r of 4 at step
    # s takes the (4 s + r)-th slice of 64
    perm = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(1))
    for step in (0, 1, 5):
        x, y = rec.batch(step)
        lo = (4 * step + 1) * 64
        assert x.shape == (64, 1, 28, 28) and y.shape == (64,) and y.dtype == torch.int64
        assert torch.equal(x, x_train[perm[lo : lo + 64]])
        assert torch.equal(y, y_train[perm[lo : lo + 64]])
        assert 0 <= int(y.min()) and int(y.max()) <= 9 and len(set(y.tolist())) > 3
        # real images: 8-bit pixels, normalised; not random normal values
        pixels = (x * STD + MEAN) * 255
        assert torch.allclose(pixels, pixels.round(), atol=1e-3)
    assert not torch.equal(rec.batch(0)[0], rec.batch(1)[0])
    # the model and the SGD that train.py builds for --compression 3lc, seed 1
    args, replica = _train_replica(METHODS["3lc"].train_flags())
    assert _same_parameters(rec.model, replica.model)
    group = replica.optimizer.param_groups[0]
    assert (rec.lr, rec.momentum) == (args.lr, args.momentum) == (group["lr"], group["momentum"])


@pytest.mark.parametrize("method", ["dgc", "randomk", "gspar", "3lc-1.75", "powersgd-r2"])
def test_an_hvdc_rows_sgd_is_the_one_train_py_builds_for_its_method(method):
    """The compressor's declared factor and momentum (DGC: half the rate, and its own
    momentum, the inner SGD without) through train.py's own function."""
    from hvdcompress.training.methods import METHODS

    _, replica = _train_replica(METHODS[method].train_flags())
    group = replica.optimizer.param_groups[0]
    assert recipe.sgd_settings(method) == pytest.approx((group["lr"], group["momentum"]))


def test_ddp_and_torch_rows_train_with_the_jobs_plain_sgd():
    from hvdcompress.training.flags import BASE_LR, BASE_MOMENTUM

    args = train.parse_args(["--launcher", "torchrun", "--torch-hook", "allreduce"])
    assert recipe.sgd_settings(None) == (args.lr, args.momentum) == (BASE_LR, BASE_MOMENTUM)
    rec = recipe.build("training", "cnn", None, rank=0, size=4, batch=64, width=16)
    assert (rec.lr, rec.momentum) == (0.05, 0.9)


def test_the_random_recipe_is_the_benchmarks_old_one():
    """--recipe random: the model seeded 0, one random batch per rank (seeded 1000 +
    rank) at every step, SGD at lr 0.01 without momentum, 32 a rank by default."""
    from hvdcompress.training.models import build_model

    rec = recipe.build("random", "cnn", "3lc", rank=2, size=4, batch=32, width=16)
    torch.manual_seed(0)
    model = build_model("cnn", 16)
    g = torch.Generator().manual_seed(1002)
    x, y = torch.randn(32, 1, 28, 28, generator=g), torch.randint(0, 10, (32,), generator=g)
    assert _same_parameters(rec.model, model)
    assert torch.equal(rec.batch(0)[0], x) and torch.equal(rec.batch(7)[1], y)
    assert (rec.lr, rec.momentum) == (0.01, 0.0) and rec.fields["recipe"] == "random"
    assert recipe.default_batch("random") == 32 and recipe.default_batch("training") == 64


def test_bench_peers_rows_map_to_methods_of_the_table():
    peers = _script("bench_peers.py")
    assert peers.hvdc_row("hvdc-3lc-inline") == ("3lc", "auto", None, True)
    assert peers.hvdc_row("hvdc-3lc-measured") == ("3lc", "auto", "measure", False)
    assert peers.hvdc_row("hvdc-powersgd-r2-hierarchical")[:2] == ("powersgd-r2", "hierarchical")


def _row(name, step_s, rate="100mbit", **kw):
    return {"model": "cnn", "rate": rate, "row": name, "step_s": step_s, "step_min_s": 0.0,
            "step_max_s": 1.0, "wire_mb": 1.0, "bits_per_value": None, "compress_s": 0.0,
            "wait_s": 0.0, "decode_s": 0.0, **kw}  # fmt: skip


def _error(name):
    return {"model": "cnn", "rate": "100mbit", "row": name, "error": f"RuntimeError: {name}"}


def test_repeated_launches_give_the_median_of_their_medians_and_the_middle_launchs_fields():
    launches = [
        [_row("ddp", 0.30, tag=0), _row("hvdc-3lc", 0.05, tag=0), _error("torch-bf16"),
         _row("ddp", 9.0, rate="1gbit", tag=0), _row("hvdc-none", 0.2, tag=0)],
        [_row("ddp", 0.10, tag=1), _error("hvdc-3lc"), _error("torch-bf16")],
        [_row("ddp", 0.20, tag=2), _row("hvdc-3lc", 0.07, tag=2), _error("torch-bf16")],
    ]  # fmt: skip
    got = {(r["row"], r["rate"]): r for r in combine_launches(launches)}
    assert list(got) == [("ddp", "100mbit"), ("hvdc-3lc", "100mbit"),
                         ("torch-bf16", "100mbit"), ("ddp", "1gbit"),
                         ("hvdc-none", "100mbit")]  # fmt: skip
    ddp = got["ddp", "100mbit"]
    assert ddp["step_runs_s"] == [0.30, 0.10, 0.20] and ddp["step_s"] == 0.20
    assert (ddp["step_lo_s"], ddp["step_hi_s"], ddp["tag"]) == (0.10, 0.30, 2)
    assert (ddp["repeats"], ddp["failed_runs"]) == (3, 0)
    # two launches worked: the median is their mean, the fields the lower middle's
    threelc = got["hvdc-3lc", "100mbit"]
    assert threelc["step_s"] == pytest.approx(0.06) and threelc["step_runs_s"] == [0.05, 0.07]
    assert (threelc["tag"], threelc["failed_runs"], threelc["repeats"]) == (0, 1, 3)
    assert "error" not in threelc
    # failed everywhere: an error row; missing from launches that died: failed there
    assert got["torch-bf16", "100mbit"]["failed_runs"] == 3
    assert "error" in got["torch-bf16", "100mbit"]
    assert got["ddp", "1gbit"]["step_runs_s"] == [9.0]
    assert got["ddp", "1gbit"]["failed_runs"] == 2
    even = combine_launches([[_row("ddp", t, tag=t)] for t in (0.4, 0.1, 0.3, 0.2)])[0]
    assert even["tag"] == 0.2 and even["step_s"] == pytest.approx(0.25)
    text = table(list(got.values()))
    assert "| cnn | ddp | 100mbit | 0.200 (0.100-0.300) |  | 1.00x |" in text
    assert "| cnn | hvdc-3lc | 100mbit | 0.060 (0.050-0.070, 1 failed) |  | 3.33x |" in text
    # the period (wall-clock per timed step) by launch, where the launches timed it
    timed = [[{**_row("ddp", t, tag=t), "period_s": t * 0.8}] for t in (0.3, 0.1, 0.2)]
    ddp = combine_launches(timed)[0]
    assert ddp["period_runs_s"] == pytest.approx([0.24, 0.08, 0.16])
    assert ddp["period_s"] == pytest.approx(0.16) and ddp["step_s"] == 0.2
    assert "| 0.200 (0.100-0.300) | 0.160 (0.080-0.240) | 1.00x |" in table([ddp])
    lines = summary(list(got.values())).splitlines()
    assert lines[0].endswith("ddp: median 0.200 s of 3 launches (0.100-0.300, spread 100%)")
    assert lines[1].endswith("(0.050-0.070, spread 33%), 1 failed")
    assert "torch-bf16: failed in all 3 launches: RuntimeError" in lines[2]


def test_the_recipe_is_training_with_three_launches_and_train_pys_batch_by_default():
    peers = _script("bench_peers.py")
    parsed = _parse(peers, [])
    assert (parsed.recipe, parsed.repeats, parsed.batch) == ("training", 3, 64)
    assert _parse(peers, ["--recipe", "random"]).batch == 32
    assert _parse(peers, ["--recipe", "random", "--batch", "8"]).batch == 8
    with pytest.raises(SystemExit):
        _parse(peers, ["--repeats", "0"])


def _parse(peers, argv):
    """bench_peers' arguments as its main resolves them (the worker mode returns them)."""
    captured = {}

    def fake_worker(args):
        captured["args"] = args

    peers.worker = fake_worker
    peers.main(["--worker", *argv])
    return captured["args"]
