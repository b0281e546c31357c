"""Construction-time validation: every DistributedOptimizer argument, every compressor
argument (the registry's declared ranges, also when a constructor is called directly) and
the parameter dtypes a compressor can send, each refused with the valid choices in one
line before any step runs."""

from __future__ import annotations

import math

import pytest
import torch

import hvdcompress
from hvdcompress.compressors import params, registry
from tests.helpers import LocalTransport, small_model


def _opt(model=None, **kw):
    model = model or small_model()
    kw.setdefault("compression", "3lc")
    kw.setdefault("backend", LocalTransport())
    return hvdcompress.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), **kw
    )


@pytest.mark.parametrize(
    "kw,error,match",
    [
        ({"fusion_threshold": -1}, ValueError, r"fusion_threshold must be an int >= 0"),
        ({"fusion_threshold": 1.5}, ValueError, "fusion_threshold"),
        ({"fusion_threshold": True}, ValueError, "fusion_threshold"),
        ({"fusion_threshold": "64"}, ValueError, "fusion_threshold"),
        ({"backward_passes_per_step": 0}, ValueError, r"backward_passes_per_step .* >= 1"),
        ({"backward_passes_per_step": 2.5}, ValueError, "backward_passes_per_step"),
        ({"backward_passes_per_step": True}, ValueError, "backward_passes_per_step"),
        ({"compress_min_numel": -1}, ValueError, r"compress_min_numel must be an int >= 0"),
        ({"compress_min_numel": None}, ValueError, "compress_min_numel"),
        ({"op": "mean"}, ValueError, r"hvdcompress.Average, hvdcompress.Sum"),
        ({"op": 2}, ValueError, "Adasum cannot be combined"),  # with 3LC (gather-only)
        ({"op": True}, ValueError, "hvd.Sum"),
        ({"policy": "accordion"}, TypeError, r"hvdcompress.Policy"),
        ({"backend": 3}, TypeError, "backend must be"),
        ({"compression": 3}, TypeError, "not a compressor"),
    ],
)
def test_optimizer_arguments_are_checked_at_construction(kw, error, match):
    with pytest.raises(error, match=match):
        _opt(**kw)


def test_valid_optimizer_arguments_still_construct():
    for kw in (
        {"fusion_threshold": 0},
        {"fusion_threshold": 1024.0},
        {"backward_passes_per_step": 2, "compress_min_numel": 0},
        {"op": hvdcompress.Sum},
        {"op": 0},
        {"policy": hvdcompress.Accordion(low=1.0, high=1.75)},
    ):
        _opt(**kw)


def test_fusion_threshold_from_a_bad_environment_variable_is_refused(monkeypatch):
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "lots")
    with pytest.raises(ValueError, match="HOROVOD_FUSION_THRESHOLD"):
        _opt()
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "-5")
    with pytest.raises(ValueError, match="fusion_threshold must be an int >= 0"):
        _opt()
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "400")
    assert len(_opt().buckets) > 1


def test_named_parameters_must_be_well_formed():
    model = small_model()
    params = list(model.named_parameters())
    bad = [
        (["a", "b"], "pairs"),
        ([(1, p) for _, p in params], "str name"),
        ([(n, "p") for n, _ in params], "str name"),
        (dict(params), "iterable of"),
        ([(n, p, 0) for n, p in params], "pairs"),
        ([("x", params[0][1]), ("y", params[0][1])] + params[1:], "same tensor"),
        ([("w", p) for _, p in params], "unique"),
        (params[1:], "not in named_parameters"),
    ]
    for named, match in bad:
        with pytest.raises(ValueError, match=match):
            hvdcompress.DistributedOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.1), named,
                compression="3lc", backend=LocalTransport(),
            )  # fmt: skip


def test_unsupported_parameter_dtype_is_refused_at_construction_naming_it():
    model = small_model().double()
    with pytest.raises(TypeError) as info:
        _opt(model)
    msg = str(info.value)
    assert "float64" in msg and "'2.bias'" in msg  # the first bucket (reversed order)
    assert "supported: float32, float16, bfloat16" in msg and "\n" not in msg
    # summable compressors and the uncompressed buckets send any floating dtype
    for compression in ("none", "fp16", "bf16", "powersgd"):
        _opt(model, compression=compression)
    _opt(model, compress_min_numel=10**6)  # nothing compressed: nothing refused
    for dtype in (torch.float16, torch.bfloat16):
        _opt(small_model().to(dtype))


# ---- compressors: the declared ranges, also for direct construction ------------------------

WRONG = {
    "float": ["0.5", True, float("nan"), None, [0.5]],
    "int": [2.5, True, "3", None, float("nan"), float("inf")],
    "bool": ["no", 2, 0.5, [True]],
}


@pytest.mark.parametrize("name", registry.names())
def test_constructors_called_directly_refuse_what_the_registry_declares_invalid(name):
    cls = registry.REGISTRY[name]
    refused = 0
    for pname, spec in cls.spec.params.items():
        for value in [*spec.outside(), *WRONG[spec.kind]]:
            if spec.accepts(value):
                continue
            with pytest.raises(ValueError, match=pname):
                cls(**{pname: value})
            refused += 1
    assert refused >= len(cls.spec.params)


def test_param_accepts_exactly_its_interval_and_kind():
    ratio = params.Param(0.0, 1.0, low_open=True)
    assert ratio.accepts(1) and ratio.accepts(0.5) and ratio.accepts(1e-300)
    for v in (0.0, 1.0 + 1e-16 * 3, math.nan, math.inf, "0.5", True, None):
        assert not ratio.accepts(v), v
    levels = params.Param(1, 127, kind="int")
    assert levels.accepts(1) and levels.accepts(127.0) and not levels.accepts(127.5)
    unbounded = params.Param(0.0, None)
    assert unbounded.accepts(1e300) and not unbounded.accepts(math.inf)
    flag = params.Param(kind="bool")
    assert flag.accepts(True) and flag.accepts(0) and not flag.accepts(None)
    assert params.Param(kind="bool", optional=True).accepts(None)
    with pytest.raises(ValueError, match=r"topk ratio must be float in \(0.0, 1.0\], got '0.5'"):
        ratio.check("topk", "ratio", "0.5")


def test_randomk_error_feedback_refuses_the_unbiased_scaling():
    c = hvdcompress.get_compressor("randomk", error_feedback=True)
    assert c.unbiased is False  # default: unbiased unless error feedback
    default = hvdcompress.get_compressor("randomk")  # Stich et al.'s memory version
    assert (default.error_feedback, default.unbiased) == (True, False)
    scaled = hvdcompress.get_compressor("randomk", unbiased=True)
    assert (scaled.error_feedback, scaled.unbiased) == (False, True)
    plain = hvdcompress.get_compressor("randomk", error_feedback=False)
    assert (plain.error_feedback, plain.unbiased) == (False, True)
    with pytest.raises(ValueError, match="unbiased=False"):
        hvdcompress.get_compressor("randomk", error_feedback=True, unbiased=True)
