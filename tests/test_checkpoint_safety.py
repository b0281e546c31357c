"""Safe checkpoints (hvdcompress.checkpoint) and the validation of loaded optimizer state:
no code runs from a crafted file, a flipped bit is caught, a crash during a save leaves the
last good checkpoint, keep-last-K, and NaN / wrong-shape / wrong-dtype / unknown state is
refused with the optimizer unchanged."""

from __future__ import annotations

import io
import os
import pickle

import pytest
import torch

import hvdcompress
from hvdcompress import checkpoint as ck
from hvdcompress.checkpoint import CheckpointError
from hvdcompress.policies import CAT, AffineCost
from tests.helpers import LocalTransport
from tests.mpi.helpers import batch, digest, make_model


def _opt(model, compression="3lc", policy=None):
    return hvdcompress.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        model.named_parameters(),
        compression=compression,
        backend=LocalTransport(),
        policy=policy,
    )


def _train(model, opt, steps, start=0):
    for step in range(start, start + steps):
        x, y = batch(0, step)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def _snapshot(opt):
    """Bit-level identity of everything the optimizer holds (inner and hvdcompress)."""
    state = opt.state_dict()
    tensors = []

    def walk(v):
        if isinstance(v, torch.Tensor):
            tensors.append(v)
        elif isinstance(v, dict):
            for k in sorted(v, key=str):
                walk(v[k])
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)

    walk(state)
    return digest(tensors), repr(state["hvdcompress"].get("policy"))


# ---- files ---------------------------------------------------------------------------------
class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _wrap(payload: bytes) -> bytes:
    """A file with a valid header and digest around ``payload`` (what a forger can do)."""
    import hashlib

    header = ck._HEADER.pack(ck.MAGIC, ck.VERSION, len(payload), hashlib.sha256(payload).digest())
    return header + payload


@pytest.mark.parametrize("framed", [False, True], ids=["bare-pickle", "valid-digest"])
def test_crafted_pickle_is_refused_and_runs_no_code(tmp_path, framed):
    marker = tmp_path / "pwned"
    buf = io.BytesIO()
    torch.save({"model": _Evil(str(marker))}, buf)  # a torch zip file holding the object
    raw = buf.getvalue()
    path = tmp_path / "rank0.step000000001.ckpt"
    path.write_bytes(_wrap(raw) if framed else raw)
    # the object really would run code if unpickled (so the test can fail)
    torch.load(io.BytesIO(raw), weights_only=False)
    assert marker.exists()
    marker.unlink()
    with pytest.raises(CheckpointError, match=str(path)):
        ck.load_checkpoint(path)
    assert not marker.exists()
    # plain pickle too
    path.write_bytes(pickle.dumps(_Evil(str(marker))))
    with pytest.raises(CheckpointError, match="not an hvdcompress checkpoint"):
        ck.load_checkpoint(path)
    assert not marker.exists()


def test_saving_refuses_non_plain_values(tmp_path):
    with pytest.raises(CheckpointError, match=r"checkpoint\.x.*_Evil"):
        ck.save_checkpoint(tmp_path / "a.ckpt", {"x": _Evil("nowhere")})
    assert list(tmp_path.iterdir()) == []


def test_roundtrip_and_flipped_bit_is_detected_naming_the_file(tmp_path):
    model = make_model()
    opt = _opt(model)
    _train(model, opt, 2)
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 2}
    path = ck.save_checkpoint(tmp_path / "c.ckpt", state)
    back = ck.load_checkpoint(path)
    assert digest(back["model"].values()) == digest(state["model"].values())
    res = back["optimizer"]["hvdcompress"]["compressor_state"]["residuals"]
    assert any(float(e.abs().max()) > 0 for e in res.values())
    data = bytearray(path.read_bytes())
    for offset in (len(data) - 100, len(data) // 2, ck._HEADER.size + 3, 20):
        flipped = bytearray(data)
        flipped[offset] ^= 0x04
        path.write_bytes(bytes(flipped))
        with pytest.raises(CheckpointError, match=f"{path}.*(digest|truncated|version)"):
            ck.load_checkpoint(path)
    path.write_bytes(bytes(data[:-1]))
    with pytest.raises(CheckpointError, match=f"{path}.*truncated"):
        ck.load_checkpoint(path)


def test_crash_during_save_keeps_the_last_good_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "rank0.step000000001.ckpt"
    ck.save_checkpoint(path, {"step": 1, "w": torch.arange(1000.0)})
    good = path.read_bytes()

    real_fdopen = os.fdopen

    class Dying:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def fileno(self):
            return self.f.fileno()

        def flush(self):
            self.f.flush()

        def write(self, data):
            self.f.write(data[: len(data) // 2])  # half written, then the "crash"
            self.f.flush()
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(ck.os, "fdopen", lambda fd, mode: Dying(real_fdopen(fd, mode)))
    with pytest.raises(OSError, match="No space"):
        ck.save_checkpoint(path, {"step": 2, "w": torch.zeros(1000)})
    monkeypatch.undo()
    assert path.read_bytes() == good
    assert ck.load_checkpoint(path)["step"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # no temp file left

    # killed between writing the temp file and the rename: the old file is intact, the
    # stray temp file is ignored and removed by the next save of that rank
    monkeypatch.setattr(ck.os, "replace", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        ck.save_checkpoint(path, {"step": 2})
    monkeypatch.undo()
    stray = tmp_path / f".{path.name}.xyz.tmp"
    stray.write_bytes(b"half")
    assert ck.verified_steps(tmp_path, 0) == ([1], [])
    ck.save_rank_checkpoint(tmp_path, 0, 2, {"step": 2}, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        path.name,
        "rank0.step000000002.ckpt",
    ]


def test_keep_last_k_per_rank(tmp_path):
    for step in range(1, 8):
        for rank in (0, 1):
            ck.save_rank_checkpoint(tmp_path, rank, step, {"step": step}, keep=3)
    assert [s for s, _ in ck.list_checkpoints(tmp_path, 0)] == [5, 6, 7]
    assert [s for s, _ in ck.list_checkpoints(tmp_path, 1)] == [5, 6, 7]
    assert len(list(tmp_path.iterdir())) == 6
    ck.save_rank_checkpoint(tmp_path, 0, 8, {"step": 8}, keep=1)
    assert [s for s, _ in ck.list_checkpoints(tmp_path, 0)] == [8]
    with pytest.raises(ValueError, match="keep"):
        ck.prune_checkpoints(tmp_path, 0, 0)


def test_verified_steps_skips_a_corrupt_newest(tmp_path):
    for step in (1, 2):
        ck.save_rank_checkpoint(tmp_path, 0, step, {"step": step, "t": torch.ones(64)})
    newest = ck.checkpoint_path(tmp_path, 0, 2)
    data = bytearray(newest.read_bytes())
    data[-10] ^= 1
    newest.write_bytes(bytes(data))
    good, bad = ck.verified_steps(tmp_path, 0)
    assert good == [1]
    assert [p for p, _ in bad] == [newest] and "digest" in str(bad[0][1])


def test_unwritable_directory_is_reported(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(CheckpointError, match="--checkpoint .*not a writable directory"):
        ck.check_writable_dir(blocker / "sub", "--checkpoint")
    assert ck.check_writable_dir(tmp_path / "a" / "b").is_dir()


# ---- validation of loaded optimizer state ------------------------------------------------------
def _trained(compression="3lc", policy=None, steps=3):
    model = make_model()
    opt = _opt(model, compression, policy)
    _train(model, opt, steps)
    return model, opt


def _fresh(compression="3lc", policy=None):
    model = make_model(seed=5)
    opt = _opt(model, compression, policy)
    _train(model, opt, 1)  # some state of its own, which a refused load must keep
    return opt


def _bad_states():
    """(id, mutate(state), message) for the compressor state of a trained 3lc optimizer."""

    def res(state):
        return state["hvdcompress"]["compressor_state"]["residuals"]

    def nan(state):
        res(state)["layers.0.weight"][3] = float("nan")

    def inf(state):
        res(state)["head.bias"][0] = float("inf")

    def shape(state):
        res(state)["head.weight"] = torch.zeros(7)

    def flat(state):
        res(state)["head.weight"] = res(state)["head.weight"].view(3, -1)

    def dtype(state):
        res(state)["head.weight"] = res(state)["head.weight"].double()

    def name(state):
        res(state)["no.such.tensor"] = torch.zeros(3)

    def key(state):
        state["hvdcompress"]["compressor_state"]["surprise"] = 1

    def not_tensor(state):
        res(state)["head.bias"] = [0.0, 0.0, 0.0]

    return [
        ("nan", nan, r"residuals\['layers.0.weight'\].*1 of .* NaN or infinite"),
        ("inf", inf, r"residuals\['head.bias'\].*NaN or infinite"),
        ("shape", shape, r"residuals\['head.weight'\]: 7 elements.*shape \(3, 16\)"),
        ("not-flat", flat, r"residuals\['head.weight'\]: 2-D .* expected 1-D"),
        (
            "dtype",
            dtype,
            r"residuals\['head.weight'\]: dtype torch.float64, expected torch.float32",
        ),
        ("unknown-name", name, r"unknown tensor names 'no.such.tensor'"),
        ("unknown-key", key, r"3lc state: unknown entries 'surprise'"),
        ("not-a-tensor", not_tensor, r"residuals\['head.bias'\]: expected a tensor"),
    ]


@pytest.mark.parametrize("mutate,message", [b[1:] for b in _bad_states()],
                         ids=[b[0] for b in _bad_states()])  # fmt: skip
def test_bad_residuals_are_refused_and_nothing_is_loaded(mutate, message):
    _, opt = _trained()
    state = opt.state_dict()
    mutate(state)
    target = _fresh()
    before = _snapshot(target)
    with pytest.raises(CheckpointError, match=message):
        target.load_state_dict(state)
    assert _snapshot(target) == before
    with pytest.raises(ValueError):  # CheckpointError is a ValueError
        target.load_state_dict(state)


def test_a_good_state_still_loads_and_changes_the_optimizer():
    _, opt = _trained()
    target = _fresh()
    before = _snapshot(target)
    target.load_state_dict(opt.state_dict())
    assert _snapshot(target) != before
    assert _snapshot(target) == _snapshot(opt)


@pytest.mark.parametrize(
    "compression,key,bad,message",
    [
        ("powersgd", "qs", lambda q: q[:, :0], r"qs\['layers.0.weight'\]: shape \(144, 0\)"),
        ("powersgd", "qs", lambda q: q.t().contiguous(), r"does not fit the parameter"),
        ("powersgd", "qs", lambda q: q * float("nan"), r"qs\['layers.0.weight'\].*NaN"),
        ("dgc", "velocity", lambda v: v.half(), r"velocity\['layers.0.weight'\]: dtype"),
        ("dgc", "velocity", lambda v: v[:-1], r"velocity\['layers.0.weight'\]: 2303 elements"),
    ],
)
def test_stateful_compressors_refuse_bad_tensors(compression, key, bad, message):
    kw = {"dgc": {"ratio": 0.1, "momentum": 0.0}, "powersgd": {"matrix_rank": 2}}[compression]
    model = make_model()
    opt = _opt(model, hvdcompress.get_compressor(compression, **kw))
    _train(model, opt, 2)
    state = opt.state_dict()
    entry = state["hvdcompress"]["compressor_state"][key]
    entry["layers.0.weight"] = bad(entry["layers.0.weight"])
    target = _opt(make_model(seed=3), hvdcompress.get_compressor(compression, **kw))
    before = _snapshot(target)
    with pytest.raises(CheckpointError, match=message):
        target.load_state_dict(state)
    assert _snapshot(target) == before


def test_dgc_steps_and_rng_counters_are_checked():
    model = make_model()
    opt = _opt(model, hvdcompress.get_compressor("randomk", ratio=0.5))
    _train(model, opt, 2)
    state = opt.state_dict()
    state["hvdcompress"]["compressor_state"]["steps"]["head.bias"] = -1
    target = _opt(make_model(), hvdcompress.get_compressor("randomk", ratio=0.5))
    with pytest.raises(CheckpointError, match="steps.*non-negative"):
        target.load_state_dict(state)


def test_bad_policy_state_is_refused_and_rolled_back():
    pol = hvdcompress.Accordion(low=1.0, high=1.9, interval_steps=1)
    _, opt = _trained(policy=pol)
    good = opt.state_dict()

    target = _fresh(policy=hvdcompress.Accordion(low=1.0, high=1.9, interval_steps=1))
    levels = dict(target.compressor.levels)
    before = _snapshot(target)
    for mutate, message in [
        (lambda p: p["current"].update({"head.weight": 2.5}), r"current\['head.weight'\].*2.5"),
        (lambda p: p["sums"].update({"head.bias": float("nan")}), r"sums\['head.bias'\]"),
        (lambda p: p["current"].update({"ghost": 1.0}), r"unknown tensor names 'ghost'"),
        (lambda p: p.update(steps=-3), "accordion steps"),
    ]:
        state = opt.state_dict()
        mutate(state["hvdcompress"]["policy"])
        with pytest.raises(CheckpointError, match=message):
            target.load_state_dict(state)
        assert _snapshot(target) == before
        assert target.compressor.levels == levels
    # the inner optimizer refusing (wrong parameter groups) rolls back the hvdcompress part
    state = opt.state_dict()
    state["param_groups"] = state["param_groups"] + state["param_groups"]
    with pytest.raises(ValueError, match="parameter group"):
        target.load_state_dict(state)
    assert _snapshot(target) == before
    assert target.compressor.levels == levels
    target.load_state_dict(good)
    assert target.policy.current == opt.policy.current


def test_checkpoint_of_another_rank_is_a_checkpoint_error():
    _, opt = _trained()
    state = opt.state_dict()
    state["hvdcompress"]["rank"] = 1
    state["hvdcompress"]["size"] = 2
    with pytest.raises(CheckpointError, match="saved by rank 1 of 2"):
        _fresh().load_state_dict(state)


def test_compressor_load_alone_is_atomic():
    c = hvdcompress.get_compressor("3lc")
    c.compress(torch.randn(50), "w")
    before = c.state_dict()
    bad = {"sparsity": 1.0, "residuals": {"w": torch.zeros(50), "v": torch.full((4,), torch.nan)}}
    with pytest.raises(CheckpointError, match=r"residuals\['v'\]"):
        c.load_state_dict(bad)
    assert torch.equal(c.state_dict()["residuals"]["w"], before["residuals"]["w"])
    assert set(c.state_dict()["residuals"]) == {"w"}


# ---- found by the coverage-guided fuzzer (scripts/fuzz_coverage.py --target checkpoint) ------
@pytest.mark.parametrize(
    "compression",
    [("dqsg", {"levels": 3}), ("qsgd", {"levels": 16})],
    ids=lambda c: c[0],
)
def test_a_compressor_whose_levels_is_its_parameter_loads_its_own_state(compression):
    """DQSG's and QSGD's ``levels`` is an int parameter, not a policy's per-tensor levels:
    load_state_dict took one for the other (TypeError on every load)."""
    name, kw = compression
    model = make_model()
    opt = _opt(model, hvdcompress.get_compressor(name, **kw))
    _train(model, opt, 2)
    target = _opt(make_model(seed=3), hvdcompress.get_compressor(name, **kw))
    target.load_state_dict(opt.state_dict())
    assert _snapshot(target) == _snapshot(opt)


def _loaded(state: dict) -> dict:
    """``state`` as a crafted checkpoint file gives it back (saved and loaded)."""
    return ck.decode_checkpoint(ck.encode_checkpoint(state))


def _refused(opt, state, message):
    before = _snapshot(opt)
    with pytest.raises(CheckpointError, match=message):
        opt.load_state_dict(_loaded(state))
    assert _snapshot(opt) == before


@pytest.mark.parametrize(
    "compression,key,value,message",
    [
        # a stateless compressor given state raised a plain ValueError
        ("signsgd", "size", 1, r"signsgd state \(it keeps none\): unknown entries 'size'"),
        # configuration values compared with != : a list was a ValueError, a tensor of
        # several values (or none) a RuntimeError ("Boolean value of Tensor ... ambiguous")
        ("qsgd", "seed", [["state", "state"], ["param_groups"]], r"saved with seed \[\["),
        ("qsgd", "seed", torch.zeros(2), "saved with seed tensor"),
        ("topk", "ratio", torch.ones(3), "saved with ratio tensor"),
        ("3lc", "sparsity", torch.ones(0), "saved with sparsity tensor"),
        ("powersgd", "matrix_rank", torch.ones(2), "saved with matrix_rank tensor"),
    ],
)
def test_saved_configuration_of_another_type_is_a_checkpoint_error(
    compression, key, value, message
):
    c = hvdcompress.get_compressor(compression)
    model = make_model()
    opt = _opt(model, c)
    _train(model, opt, 1)
    state = opt.state_dict()
    state["hvdcompress"]["compressor_state"][key] = value
    _refused(opt, state, message)


@pytest.mark.parametrize(
    "key,value,message",
    [
        ("rank", torch.ones(0), "rank: expected int, got Tensor"),
        ("size", torch.ones(2), "size: expected int, got Tensor"),
        ("compressor", torch.ones(2), "compressor: expected str, got Tensor"),
    ],
)
def test_rank_size_and_compressor_of_another_type_are_checkpoint_errors(key, value, message):
    _, opt = _trained()
    state = opt.state_dict()
    state["hvdcompress"][key] = value
    _refused(opt, state, message)


def test_policy_numel_that_is_not_a_dict_of_ints_is_a_checkpoint_error():
    pol = CAT("topk", cost_model=AffineCost(1e-5, 1e-9), recompute_every=1)
    model = make_model()
    opt = _opt(model, "topk", pol)
    _train(model, opt, 2)
    for numel, message in [
        ([1, 2], "policy state numel: expected a dict, got list"),
        ({"head.bias": torch.ones(2)}, r"numel\['head.bias'\]: tensor"),
    ]:
        state = opt.state_dict()
        state["hvdcompress"]["policy"]["numel"] = numel
        _refused(opt, state, message)


def test_a_view_repeating_a_few_bytes_is_refused_before_it_is_walked():
    """A 3 KB checkpoint can hold a stride-0 view of 2**40 elements over 4 bytes of storage
    (torch.save keeps views): checking it for NaN allocated 2**40 values."""
    _, opt = _trained()
    state = opt.state_dict()
    state["hvdcompress"]["compressor_state"]["residuals"]["head.bias"] = torch.zeros(1).expand(
        2**40
    )
    assert len(ck.encode_checkpoint(state)) < 2**16
    _refused(opt, state, r"residuals\['head.bias'\]: 1099511627776 elements .* over 4 bytes")
    with pytest.raises(CheckpointError, match="dense"):
        ck.check_tensor("t", torch.eye(3).to_sparse())
