"""hvdcompress.training (what scripts/ share: Fashion-MNIST, the models, the method table)
and the transports' blocking helpers that replaced train.py's own distributed wrapper."""

from __future__ import annotations

import gzip
import importlib.util
import os
import shutil
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

import hvdcompress
from hvdcompress.policies.cat import compressor_for
from hvdcompress.policies.warmup import Warmup
from hvdcompress.training import data, methods, models
from hvdcompress.transports import Transport

ROOT = Path(__file__).resolve().parents[1]
FMNIST = Path("/usr/share/datasets/fashion-mnist")
needs_fmnist = pytest.mark.skipif(
    not (FMNIST / "train-images-idx3-ubyte.gz").is_file(),
    reason=f"Fashion-MNIST not in {FMNIST} (Debian package dataset-fashion-mnist)",
)


def _script(name: str):
    path = ROOT / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_training_script_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _idx(array: np.ndarray) -> bytes:
    header = struct.pack(">HBB", 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    return header + array.astype(np.uint8).tobytes()


# ---- data ----------------------------------------------------------------------------------
@needs_fmnist
def test_fashion_mnist_files_read_as_60000_and_10000_labelled_images():
    arrays = data.read_fashion_mnist(FMNIST)
    for split, n in (("train", 60000), ("test", 10000)):
        x, y = arrays[f"{split}_x"], arrays[f"{split}_y"]
        assert x.shape == (n, 28, 28) and x.dtype == np.uint8
        assert y.shape == (n,) and y.dtype == np.uint8
        assert sorted(np.unique(y).tolist()) == list(range(10))
        assert np.bincount(y).tolist() == [n // 10] * 10  # Fashion-MNIST is balanced
        assert 0 < x.mean() < 255 and x.max() == 255
    (xtr, ytr), (xte, yte) = data.load_fashion_mnist(FMNIST)
    assert xtr.shape == (60000, 1, 28, 28) and xtr.dtype == torch.float32
    assert xte.shape == (10000, 1, 28, 28) and yte.dtype == torch.int64
    assert abs(float(xtr.mean())) < 0.01 and abs(float(xtr.std()) - 1.0) < 0.01  # normalised
    assert torch.equal(ytr, torch.from_numpy(arrays["train_y"].astype(np.int64)))


def test_read_idx_round_trips_plain_and_gzip(tmp_path):
    images = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    labels = np.array([7, 0, 9], dtype=np.uint8)
    (tmp_path / "x").write_bytes(_idx(images))
    (tmp_path / "y.gz").write_bytes(gzip.compress(_idx(labels)))
    assert np.array_equal(data.read_idx(tmp_path / "x"), images)
    assert np.array_equal(data.read_idx(tmp_path / "y.gz"), labels)


@pytest.mark.parametrize(
    "raw, message",
    [
        (b"\x00\x00", "too short"),
        (b"\x00\x00\x0d\x03" + struct.pack(">3I", 1, 2, 2) + bytes(4), "not a uint8 idx"),
        (b"\x00\x00\x08\x02" + struct.pack(">2I", 2, 2) + bytes(4), "not a uint8 idx"),
        (b"\x00\x00\x08\x03" + struct.pack(">I", 5), "header cut short"),
        (b"\x00\x00\x08\x03" + struct.pack(">3I", 10, 28, 28) + bytes(100), "header says"),
        (b"\x1f\x8b" + b"not gzip at all", "corrupt gzip"),
        (gzip.compress(_idx(np.zeros(64, np.uint8)))[:-12], "corrupt gzip"),  # truncated
    ],
)
def test_malformed_idx_files_raise_a_clear_error(tmp_path, raw, message):
    path = tmp_path / "bad-idx3-ubyte.gz"
    path.write_bytes(raw)
    with pytest.raises(ValueError, match=message) as err:
        data.read_idx(path)
    assert str(path) in str(err.value)


def test_mismatched_or_missing_files(tmp_path):
    with pytest.raises(data.DatasetNotFound, match="dataset-fashion-mnist") as err:
        data.load_fashion_mnist(tmp_path)
    assert isinstance(err.value, FileNotFoundError)
    assert "train-images-idx3-ubyte.gz" in str(err.value)
    files = {
        "train_x": np.zeros((4, 28, 28)),
        "train_y": np.array([0, 1, 2]),  # one label short
        "test_x": np.zeros((2, 28, 28)),
        "test_y": np.array([3, 4]),
    }
    for key, array in files.items():
        (tmp_path / data.FILES[key]).write_bytes(gzip.compress(_idx(array)))
    with pytest.raises(ValueError, match="train images .* labels .* do not match"):
        data.read_fashion_mnist(tmp_path)
    (tmp_path / data.FILES["train_y"]).write_bytes(gzip.compress(_idx(np.array([0, 1, 2, 12]))))
    with pytest.raises(ValueError, match="label 12"):
        data.read_fashion_mnist(tmp_path)


def test_synthetic_data_is_seeded_and_labelled():
    (x, y), (xt, yt) = data.synthetic(100, 30, seed=5)
    assert x.shape == (100, 1, 28, 28) and xt.shape == (30, 1, 28, 28)
    assert y.shape == (100,) and int(y.min()) >= 0 and int(y.max()) <= 9
    (x2, y2), _ = data.synthetic(100, 30, seed=5)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert not torch.equal(data.synthetic(100, 30, seed=6)[0][0], x)


# ---- models --------------------------------------------------------------------------------
def test_models_output_shapes_and_sizes():
    torch.manual_seed(0)
    cnn = models.SmallCNN()
    assert cnn(torch.randn(5, 1, 28, 28)).shape == (5, 10)
    assert sum(p.numel() for p in cnn.parameters()) == 206922
    assert len(list(cnn.parameters())) == 8
    resnet = models.SmallResNet(8)
    assert resnet(torch.randn(3, 1, 28, 28)).shape == (3, 10)
    light = models.build_model("light")
    assert light(torch.randn(2, *models.INPUT_SHAPES["light"])).shape == (2, 10)
    assert sum(p.numel() for p in light.parameters()) == 2 * (1024 * 1024 + 1024) + 10250
    # the names the network benchmark's optimizer saw when the MLP was a plain Sequential
    assert [n for n, _ in light.named_parameters()] == [
        "0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias",
    ]  # fmt: skip
    assert models.IMAGE_MODELS == ("cnn", "resnet", "vit", "mlp10m")
    for name in models.MODELS:
        m = models.build_model(name, 4 if name != "light" else 32)
        assert m(torch.randn(2, *models.INPUT_SHAPES[name])).shape == (2, 10)
    with pytest.raises(ValueError, match="unknown model"):
        models.build_model("vgg")


def test_build_model_is_seeded_like_the_class():
    torch.manual_seed(3)
    a = models.SmallCNN(16)
    torch.manual_seed(3)
    b = models.build_model("cnn")
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


# ---- methods -------------------------------------------------------------------------------
def test_every_method_builds_a_registered_compressor_and_its_policy():
    assert {"none", "fp16", "3lc", "3lc-1.75", "3lc-min64k", "accordion-3lc", "topk",
            "cat-topk", "powersgd", "dqsg"} <= set(methods.METHODS)  # fmt: skip
    for name, m in methods.METHODS.items():
        assert m.name == name
        assert m.compression in hvdcompress.compressors.REGISTRY, name
        comp = m.compressor()
        assert isinstance(comp, hvdcompress.Compressor)
        assert type(comp) is hvdcompress.compressors.REGISTRY[m.compression]
        assert comp is not m.compressor()  # a fresh one (own error-feedback state)
        policy = m.make_policy()
        if m.policy is None:
            assert policy is None
            with pytest.raises(ValueError, match="no policy"):
                m.make_policy(interval_steps=3)
        elif m.policy == "accordion":
            assert isinstance(policy, hvdcompress.Accordion)
            assert (policy.low, policy.high) == (m.policy_params["low"], m.policy_params["high"])
            assert m.make_policy(interval_steps=7).interval_steps == 7
        elif m.policy == "warmup":  # issue 61's compression warm-up
            assert isinstance(policy, Warmup)
            pp = m.policy_params
            assert (policy.warm, policy.steps) == (pp["warm"], pp["steps"])
            assert m.make_policy(steps=9).steps == 9
        else:
            assert isinstance(policy, hvdcompress.CAT)
            assert compressor_for(policy.kind) == m.compression
            cost = hvdcompress.AffineCost(1e-4, 1e-9)
            other = m.make_policy(cost_model=cost, recompute_every=9)
            assert other.cost is cost and other.recompute_every == 9
        assert m.fixed.policy is None and repr(m.fixed.compressor()) == repr(comp)
    with pytest.raises(TypeError):
        methods.METHODS["topk"].params["ratio"] = 0.5  # the table is read-only
    with pytest.raises(ValueError, match="unknown method"):
        methods.get_method("zip")


def test_train_flags_give_the_methods_compressor_and_policy():
    """The table and train.py's flags agree: what bench_accuracy trains is the method."""
    train = _script("train")
    for name, m in methods.METHODS.items():
        args = train.parse_args(m.train_flags())
        comp, _ = train.make_compression(args)
        assert repr(comp) == repr(m.compressor()), name
        assert repr(train.make_policy(args)) == repr(m.make_policy()), name
        assert args.compress_min_numel == m.compress_min_numel, name


def test_a_fixed_exchange_variant_is_its_method_with_the_exchange_flag():
    """``Method.on``: the same compressor, policy and flags, plus ``--exchange``; the
    table's fixed-exchange entries are those variants, and train.py reads the exchange."""
    train = _script("train")
    for base, exchange in [("3lc", "allgather"), ("3lc", "twostage"),
                           ("accordion-3lc", "allgather"), ("accordion-3lc", "twostage"),
                           ("dqsg", "allgather")]:  # fmt: skip
        m, variant = methods.METHODS[base], methods.METHODS[f"{base}-{exchange}"]
        assert variant.name == f"{base}-{exchange}" and variant.exchange == exchange
        assert variant.train_flags() == [*m.train_flags(), "--exchange", exchange]
        assert repr(variant.compressor()) == repr(m.compressor())
        assert repr(variant.make_policy()) == repr(m.make_policy())
        assert train.parse_args(variant.train_flags()).exchange == exchange
    with pytest.raises(KeyError):
        methods.METHODS["3lc"].on("hierarchical")


def test_the_benchmarks_use_the_table_with_their_old_settings():
    net = _script("bench_network")
    assert all(case is methods.METHODS[name] for name, case in net.CASES.items())
    legacy = {  # the table bench_network had of its own
        "none": ("none", {}, None, 0),
        "fp16": ("fp16", {}, None, 0),
        "3lc": ("3lc", {"sparsity": 1.0}, None, 0),
        "3lc-1.75": ("3lc", {"sparsity": 1.75}, None, 0),
        "topk": ("topk", {"ratio": 0.01}, None, 0),
        "powersgd": ("powersgd", {"matrix_rank": 1}, None, 0),
        "dqsg": ("dqsg", {"levels": 3}, None, 0),
        "accordion-3lc": ("3lc", {"sparsity": 1.0}, "accordion", 0),
        "cat-topk": ("topk", {"ratio": 0.01}, "cat", 0),
        "3lc-min64k": ("3lc", {"sparsity": 1.0}, None, 65536),
    }
    got = {k: (m.compression, dict(m.params), m.policy, m.compress_min_numel)
           for k, m in net.CASES.items()}  # fmt: skip
    assert got == legacy and list(got) == list(legacy)
    acc = _script("bench_accuracy")
    assert set(acc.DEFAULT_METHODS) <= set(methods.METHODS)
    policy = _script("bench_policy")
    for _label, name, settings in policy.PAIRS:
        m = methods.METHODS[name]
        built = policy.make_policy(m, settings)
        assert built is not None and type(built).__name__ == {"accordion": "Accordion",
                                                              "cat": "CAT"}[m.policy]  # fmt: skip
        if m.policy == "cat":
            assert isinstance(built.cost, hvdcompress.AffineCost)  # no calibration


def test_parse_case_spellings():
    assert methods.parse_case("3lc:sparsity=1.75") == ("3lc", {"sparsity": 1.75})
    assert methods.parse_case("qsgd:levels=16") == ("qsgd", {"levels": 16})
    assert isinstance(methods.parse_case("qsgd:levels=16")[1]["levels"], int)
    assert methods.parse_case("dgc") == ("dgc", {})
    assert methods.parse_case("topk") == ("topk", {})  # a compressor name stays one
    assert methods.parse_case("3lc-1.75") == ("3lc", {"sparsity": 1.75})  # a method
    assert methods.parse_case("topkq:ratio=0.1") == ("topkq", {"ratio": 0.1})
    with pytest.raises(ValueError, match="policy"):
        methods.parse_case("accordion-3lc")
    with pytest.raises(ValueError, match="KEY=VALUE"):
        methods.parse_params(["ratio"])
    assert methods.parse_params(["a=true", "b=2", "c=1e-3", "d=x"]) == {
        "a": True, "b": 2, "c": 1e-3, "d": "x",
    }  # fmt: skip


def test_policy_builders():
    acc = methods.build_policy("accordion", "powersgd", low=2.0, high=1.0)
    assert (acc.low, acc.high) == (2, 1) and isinstance(acc.low, int)
    with pytest.raises(ValueError, match="drives the 'topk' compressor"):
        methods.build_policy("cat", "3lc", kind="topk")
    with pytest.raises(ValueError, match="unknown policy"):
        methods.build_policy("adaptive", "3lc")
    assert isinstance(methods.parse_cost("1e-5,1e-9"), hvdcompress.AffineCost)
    packet = methods.parse_cost("1e-5,1e-9,64")
    assert isinstance(packet, hvdcompress.PacketCost) and packet.packet_bits == 64
    with pytest.raises(ValueError, match="C0,C1"):
        methods.parse_cost("1,2,3,4")


# ---- transports: the helpers train.py's Dist provided ------------------------------------
class _TwoRanks(Transport):
    """Rank 1 of 2: allgather_object answers with a scripted rank 0 object."""

    name = "fake"
    tunable = False  # no link to time
    rank, size = 1, 2

    def __init__(self, peer_objects):
        self.peer = list(peer_objects)

    def allgather_object(self, obj):
        return [self.peer.pop(0), obj]


def test_transport_generic_helpers_over_allgather_object():
    root = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    mine = torch.zeros(2, 3)
    fake = _TwoRanks([root.clone(), [1.5, 2.0], None])
    fake.broadcast_([mine])
    assert torch.equal(mine, root)
    assert fake.sum_floats([0.25, 3.0]) == [1.75, 5.0]
    fake.barrier()
    assert fake.peer == [] and fake.local_size == 1


HELPERS = textwrap.dedent(
    """
    import pathlib, sys, torch
    from hvdcompress.transports import Transport, make_transport
    t = make_transport(sys.argv[1])
    r = t.rank
    assert t.size == 2 and t.local_size == 2, (t.size, t.local_size)
    a = torch.full((3, 4), float(r + 1))
    b = torch.full((5,), float(10 * r), dtype=torch.bfloat16)
    c = torch.arange(12.0).reshape(3, 4).t() * (r + 1)  # not contiguous
    t.broadcast_([a, b, c], root=1)
    assert torch.equal(a, torch.full((3, 4), 2.0)), a
    assert torch.equal(b, torch.full((5,), 10.0, dtype=torch.bfloat16)), b
    assert torch.equal(c, torch.arange(12.0).reshape(3, 4).t() * 2), c
    assert t.sum_floats([r, 0.5]) == [1.0, 1.0]
    d = torch.full((2,), float(r + 7))
    Transport.broadcast_(t, [d])  # the generic version, over allgather_object
    assert torch.equal(d, torch.full((2,), 7.0)), d
    assert Transport.sum_floats(t, [r, 2.0]) == [1.0, 4.0]
    t.barrier()
    Transport.barrier(t)
    pathlib.Path(sys.argv[2], f"rank{r}").write_text("ok")  # launcher output may interleave
    """
)
HOROVODRUN = shutil.which("horovodrun") or str(Path(sys.executable).with_name("horovodrun"))


@pytest.mark.parametrize("backend", ["mpi4py", "horovod"])
def test_transport_helpers_on_two_ranks(backend, tmp_path):
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    env.setdefault("OMPI_MCA_btl_vader_single_copy_mechanism", "none")
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    if backend == "mpi4py":
        if shutil.which("mpirun") is None:
            pytest.skip("no mpirun on PATH")
        launch = ["mpirun", "--oversubscribe", "--bind-to", "none", "-np", "2"]
    else:
        if importlib.util.find_spec("horovod") is None or not Path(HOROVODRUN).exists():
            pytest.skip("horovod (with horovodrun) is not installed")
        launch = [HOROVODRUN, "-np", "2", "-H", "localhost:2"]
    cmd = [*launch, sys.executable, "-c", HELPERS, backend, str(tmp_path)]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=180, env=env, stdin=subprocess.DEVNULL
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(f.name for f in tmp_path.iterdir()) == ["rank0", "rank1"], proc.stdout[-3000:]
