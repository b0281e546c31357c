"""The named compression methods the benchmarks compare: one table, ``METHODS``.

A method is a compressor with parameters, optionally a policy that changes the
compressor's level per tensor during training (Accordion, CAT), and optionally the
per-tensor off switch ``compress_min_numel``. ``Method.train_flags()`` gives the
scripts/train.py flags that train with it, ``compressor()`` and ``make_policy(**overrides)``
the arguments of ``hvdcompress.DistributedOptimizer``, and ``parse_case`` reads a
compressor spelled on a command line. ``build_policy`` and ``parse_cost`` build the
policies for train.py's flags too, so a method and its flags give the same policy.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

import hvdcompress
from hvdcompress.compressors.params import Param
from hvdcompress.policies.cat import KINDS, compressor_for
from hvdcompress.policies.warmup import Warmup

POLICIES = ("accordion", "cat", "warmup")


# ---- policies ------------------------------------------------------------------------------
def build_policy(policy: str, compression: str, **params):
    """A policy driving the ``compression`` compressor: ``"accordion"`` with Accordion's
    parameters (``low`` and ``high`` checked as levels of ``compression``, see
    ``check_level``), ``"cat"`` with ``kind`` (which must drive ``compression``, see
    ``compressor_for``) and CAT's other parameters, ``"warmup"`` with ``warm`` (a level
    of ``compression``) and ``steps`` (hvdcompress.policies.warmup)."""
    if policy == "warmup":
        warm = check_level(compression, params.pop("warm"))
        level = params.pop("level", None)
        level = None if level is None else check_level(compression, level)
        return Warmup(warm, level=level, **params)
    if policy == "accordion":
        low = check_level(compression, params.pop("low"))
        high = check_level(compression, params.pop("high"))
        return hvdcompress.Accordion(low=low, high=high, **params)
    if policy == "cat":
        cat_kind = params.pop("kind")
        if cat_kind not in KINDS:
            raise ValueError(f"CAT kind {cat_kind!r}: one of {', '.join(KINDS)}")
        need = compressor_for(cat_kind)
        if compression != need:
            raise ValueError(
                f"CAT {cat_kind!r} drives the {need!r} compressor, not {compression!r}"
            )
        return hvdcompress.CAT(cat_kind, **params)
    raise ValueError(f"unknown policy {policy!r}: one of {', '.join(POLICIES)}")


def level_param(compression: str) -> tuple[str, Param]:
    """(the name, the declared range) of ``compression``'s per-tensor level: the
    parameter a policy sets (3lc ``sparsity``, topk ``ratio``, powersgd ``matrix_rank``);
    ValueError for a compressor without per-tensor levels."""
    registry = hvdcompress.compressors.REGISTRY
    cls = registry.get(compression)
    if cls is None:
        raise ValueError(f"unknown compressor {compression!r}")
    name = cls.spec.level_param
    if not name:
        with_levels = ", ".join(sorted(n for n, c in registry.items() if c.spec.level_param))
        raise ValueError(
            f"{compression} has no per-tensor level (compressors with one: {with_levels})"
        )
    return name, cls.spec.params[name]


def check_level(compression: str, value):
    """``value`` as a level of ``compression`` (an int for an int parameter), checked
    against the registry's declared range; ValueError naming the range otherwise."""
    name, spec = level_param(compression)
    bad = ValueError(f"{compression} {name} must be {spec.describe()}, got {value!r}")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad
    if spec.kind == "int":
        if int(value) != value:
            raise bad
        value = int(value)
    else:
        value = float(value)
    if not spec.accepts(value):
        raise bad
    return value


def parse_cost(text: str):
    """A CAT cost model from ``C0,C1`` (AffineCost: seconds, seconds per bit) or
    ``C0,C1,PACKET_BITS`` (PacketCost: seconds per packet of PACKET_BITS bits). C0 and C1
    are finite and >= 0, PACKET_BITS an int >= 1; ValueError saying so otherwise."""
    usage = "a cost model is C0,C1[,PACKET_BITS] (finite C0, C1 >= 0; int PACKET_BITS >= 1)"
    items = text.split(",")
    if len(items) not in (2, 3):
        raise ValueError(f"{usage}, got {text!r}")
    try:
        c0, c1 = (float(v) for v in items[:2])
        packet = int(items[2]) if len(items) == 3 else None
    except ValueError:
        raise ValueError(f"{usage}, got {text!r}") from None
    if not all(math.isfinite(c) and c >= 0 for c in (c0, c1)) or (
        packet is not None and packet < 1
    ):
        raise ValueError(f"{usage}, got {text!r}")
    if packet is None:
        return hvdcompress.AffineCost(c0, c1)
    return hvdcompress.PacketCost(c0, c1, packet)


# ---- the table -----------------------------------------------------------------------------
def _frozen(mapping: Mapping | None) -> Mapping:
    return MappingProxyType(dict(mapping or {}))


@dataclass(frozen=True, eq=False)
class Method:
    """A named compression method (see the module docstring)."""

    name: str
    compression: str
    params: Mapping[str, Any] = field(default_factory=dict)
    policy: str | None = None  # "accordion" | "cat" | "warmup"
    policy_params: Mapping[str, Any] = field(default_factory=dict)
    compress_min_numel: int = 0
    about: str = ""
    exchange: str = "auto"  # DistributedOptimizer(exchange=...): auto, allgather, twostage

    def __post_init__(self) -> None:
        object.__setattr__(self, "params", _frozen(self.params))
        object.__setattr__(self, "policy_params", _frozen(self.policy_params))
        if self.policy not in (None, *POLICIES):
            raise ValueError(f"{self.name}: unknown policy {self.policy!r}")

    def compressor(self) -> hvdcompress.Compressor:
        """A new compressor (its own error-feedback state)."""
        return hvdcompress.get_compressor(self.compression, **self.params)

    def make_policy(self, **overrides):
        """A new policy, or None; ``overrides`` replace policy parameters (Accordion:
        ``interval_steps``, ``eta``; CAT: ``cost_model``, ``recompute_every``)."""
        if self.policy is None:
            if overrides:
                raise ValueError(f"{self.name} has no policy to take {sorted(overrides)}")
            return None
        return build_policy(self.policy, self.compression, **{**self.policy_params, **overrides})

    @property
    def fixed(self) -> Method:
        """The same compressor and parameters without the policy."""
        return replace(self, name=f"{self.name} (fixed)", policy=None, policy_params={})

    def on(self, exchange: str) -> Method:
        """The same method with every bucket on ``exchange`` ("allgather", "twostage"),
        named ``<name>-<exchange>``."""
        how = {"allgather": "one allgather", "twostage": "the two-stage exchange"}[exchange]
        return replace(
            self, name=f"{self.name}-{exchange}", exchange=exchange,
            about=f"{self.about}; every bucket by {how}",
        )  # fmt: skip

    def train_flags(self) -> list[str]:
        """The scripts/train.py flags that train with this method."""
        flags = ["--compression", self.compression]
        for key, value in self.params.items():
            if self.compression == "3lc" and key == "sparsity":
                flags += ["--sparsity", str(value)]
            else:
                flags += ["--compression-param", f"{key}={value}"]
        pp = self.policy_params
        if self.policy == "accordion":
            flags += ["--accordion", str(pp["low"]), str(pp["high"])]
            if pp.get("interval_steps") is not None:
                flags += ["--accordion-interval", str(pp["interval_steps"])]
            if "eta" in pp:
                flags += ["--accordion-eta", str(pp["eta"])]
        elif self.policy == "cat":
            flags += ["--cat", pp["kind"]]
            if "recompute_every" in pp:
                flags += ["--cat-every", str(pp["recompute_every"])]
            if pp.get("cost_model") is not None:
                raise ValueError(f"{self.name}: a fixed cost model has no train.py flag here")
        elif self.policy == "warmup":
            if pp.get("level") is not None:
                raise ValueError(f"{self.name}: warm-up's later level is the compressor's own")
            flags += ["--compression-warmup", str(pp["warm"]), str(pp["steps"])]
        if self.compress_min_numel:
            flags += ["--compress-min-numel", str(self.compress_min_numel)]
        if self.exchange != "auto":
            flags += ["--exchange", self.exchange]
        return flags


_ACCORDION_3LC = {"low": 1.0, "high": 1.75, "interval_steps": 40}
_TABLE = [
    Method("none", "none", about="float32 allreduce (the baseline)"),
    Method("fp16", "fp16", about="float16 allreduce"),
    Method("3lc", "3lc", {"sparsity": 1.0}, about="3LC at sparsity 1.0 (Accordion's low)"),
    Method("3lc-1.75", "3lc", {"sparsity": 1.75}, about="3LC at 1.75 (Accordion's high)"),
    Method(
        "3lc-min64k", "3lc", {"sparsity": 1.0}, compress_min_numel=65536,
        about="3LC; tensors under 65,536 elements sent uncompressed",
    ),
    Method(
        "accordion-3lc", "3lc", {"sparsity": 1.0}, "accordion", _ACCORDION_3LC,
        about="Accordion between 3LC sparsity 1.0 and 1.75, every 40 steps",
    ),
    Method(
        "accordion-3lc-eta0.2", "3lc", {"sparsity": 1.0}, "accordion",
        {**_ACCORDION_3LC, "eta": 0.2}, about="accordion-3lc with eta 0.2",
    ),
    Method("topk", "topk", {"ratio": 0.01}, about="top-k, 1% of each tensor"),
    Method("topkq", "topkq", {"ratio": 0.01}, about="top-k 1%, one magnitude and signs"),
    Method("gspar", "gspar", {"ratio": 0.01}, about="gradient sparsification, 1%"),
    Method(
        "cat-topk", "topk", {"ratio": 0.01}, "cat", {"kind": "topk", "recompute_every": 50},
        about="CAT picks each tensor's top-k budget, every 50 steps",
    ),
    Method(
        "cat-topkq", "topkq", {"ratio": 0.01}, "cat",
        {"kind": "topk+q", "recompute_every": 50}, about="CAT over topkq, every 50 steps",
    ),
    Method(
        "cat-randomk", "gspar", {"ratio": 0.01}, "cat",
        {"kind": "randomk", "recompute_every": 50}, about="CAT over gspar, every 50 steps",
    ),
    Method("powersgd", "powersgd", {"matrix_rank": 1}, about="PowerSGD, rank 1"),
    Method("powersgd-r2", "powersgd", {"matrix_rank": 2}, about="PowerSGD, rank 2"),
    # the other codecs with their defaults (and their sgd_lr_factor / sgd_momentum)
    Method("bf16", "bf16", about="bfloat16 allreduce"),
    Method("qsgd", "qsgd", about="QSGD, its default levels"),
    Method("terngrad", "terngrad", about="TernGrad"),
    Method("signsgd", "signsgd", about="signSGD, the mean of the ranks' signs (lr x0.002)"),
    Method("efsignsgd", "efsignsgd", about="EF-signSGD (no momentum, lr x2)"),
    Method("randomk", "randomk", about="random-k 1% with memory (no momentum, lr x0.2)"),
    Method("dgc", "dgc", about="deep gradient compression, its defaults"),
    Method("dqsg", "dqsg", {"levels": 3}, about="dithered quantisation, 3 levels"),
    Method(
        "ndqsg", "ndqsg", {"fine_levels": 3, "coarse_levels": 1},
        about="nested DQSG: half the ranks DQSG at 3 levels, half nested (side information)",
    ),
    # issue 61's candidates (docs/screening.md): block-scaled 3LC, warm-up
    Method(
        "block3lc", "block3lc", {"sparsity": 1.0, "block": 1024},
        about="3LC with a scale per 1024 values (block scales)",
    ),
    Method(
        "block3lc-b256", "block3lc", {"sparsity": 1.0, "block": 256},
        about="3LC with a scale per 256 values",
    ),
    Method(
        "block3lc-b4096", "block3lc", {"sparsity": 1.0, "block": 4096},
        about="3LC with a scale per 4096 values",
    ),
    Method(
        "block3lc-warmup", "block3lc", {"sparsity": 1.0, "block": 1024}, "warmup",
        {"warm": 3, "steps": 234},
        about="block3lc, the first 234 steps (one ViT/CNN epoch at 4 ranks) at 3 levels",
    ),
    Method(
        "block3lc-b4096-s1.25-warmup", "block3lc", {"sparsity": 1.25, "block": 4096},
        "warmup", {"warm": 3, "steps": 234},
        about="block3lc, 4096 values a scale, sparsity 1.25; the first 234 steps at 3 levels",
    ),
    Method(
        "block3lc-b4096-warmup", "block3lc", {"sparsity": 1.0, "block": 4096},
        "warmup", {"warm": 3, "steps": 234},
        about="block3lc-b4096; the first 234 steps at 3 levels",
    ),
    Method(
        "block3lc-tensor-warmup", "block3lc", {"sparsity": 1.0, "block": 1 << 24},
        "warmup", {"warm": 3, "steps": 234},
        about="one scale per tensor (3LC's quantiser); the first 234 steps at 3 levels",
    ),
    Method(
        "block3lc-tensor-mc", "block3lc", {"sparsity": 1.0, "block": 1 << 24, "momentum": 0.9},
        about="one scale per tensor (3LC's quantiser) with DGC's momentum correction",
    ),
    Method(
        "block3lc-b4096-s1.25-mc", "block3lc",
        {"sparsity": 1.25, "block": 4096, "momentum": 0.9},
        about="block3lc-b4096 at sparsity 1.25 with DGC's momentum correction",
    ),
    Method(
        "block3lc-b4096-late3", "block3lc", {"sparsity": 1.0, "block": 4096, "levels": 3},
        "warmup", {"warm": 1, "steps": 1170},
        about="diagnostic: block3lc-b4096 ternary for 5 epochs, 3 levels after the lr drop",
    ),
    Method(
        "block3lc-s1.25", "block3lc", {"sparsity": 1.25, "block": 1024},
        about="block3lc at sparsity 1.25 (fewer digits sent)",
    ),
    Method(
        "block3lc-mc", "block3lc", {"sparsity": 1.0, "block": 1024, "momentum": 0.9},
        about="block3lc with DGC's momentum correction and masking (SGD without momentum)",
    ),
    Method(
        "block3lc-b4096-mc", "block3lc", {"sparsity": 1.0, "block": 4096, "momentum": 0.9},
        about="block3lc-b4096 with DGC's momentum correction and masking",
    ),
    Method(
        "accordion-block3lc", "block3lc", {"sparsity": 1.0, "block": 4096}, "accordion",
        {"low": 3, "high": 1, "interval_steps": 40},
        about="Accordion between block3lc-b4096 at 3 levels (critical) and ternary",
    ),
    Method(
        "accordion-block3lc-tensor", "block3lc", {"sparsity": 1.0, "block": 1 << 24},
        "accordion", {"low": 3, "high": 1, "interval_steps": 40},
        about="Accordion between 3 levels (critical) and 3LC's ternary, one scale a tensor",
    ),
    Method(
        "block3lc-tensor-l3", "block3lc", {"sparsity": 1.0, "block": 1 << 24, "levels": 3},
        about="accordion-block3lc-tensor's low level the whole run (3 levels, error feedback)",
    ),
    # error feedback against precision: block3lc at DQSG's levels (deterministic, error
    # feedback) and DQSG at 3LC's (ternary, dithered, no error feedback)
    Method(
        "block3lc-b4096-l3", "block3lc", {"sparsity": 1.0, "block": 4096, "levels": 3},
        about="diagnostic: block3lc-b4096 at 3 levels the whole run (error feedback)",
    ),
    Method(
        "dqsg-l1", "dqsg", {"levels": 1},
        about="diagnostic: dithered ternary (DQSG, 1 level), no error feedback",
    ),
    # the fifth corner: error feedback with an unbiased (stochastically rounded) ternary;
    # and the unbiased ternary alone, zero-run coded (dqsg-l1's code at 3LC's bits)
    Method(
        "block3lc-b4096-sr", "block3lc",
        {"sparsity": 1.0, "block": 4096, "stochastic": True},
        about="block3lc-b4096, stochastic rounding, error feedback",
    ),
    Method(
        "block3lc-tensor-sr-noef", "block3lc",
        {"sparsity": 1.0, "block": 1 << 24, "stochastic": True, "error_feedback": False},
        about="block3lc, one scale a tensor, stochastic rounding, no error feedback",
    ),
    # what the feedback carries: EF21-SGDM's estimate of the momentum in place of the
    # residual (3LC's quantiser, one scale a tensor; the SGD at momentum 1 adds it up)
    Method(
        "block3lc-tensor-ef21", "block3lc",
        {"sparsity": 1.0, "block": 1 << 24, "momentum": 0.9, "ef21": True},
        about="3LC's quantiser with EF21-SGDM (momentum 0.9 in the compressor)",
    ),
]  # fmt: skip
# methods also run with their exchange fixed (``Method.on``): the tuner's picks, each
# trained on its own, for the time-to-accuracy join (scripts/bench_tta.py); on the
# allgather DQSG skips the two-stage exchange's re-quantised second stage
FIXED_EXCHANGES = {
    "3lc": ("allgather", "twostage"),
    "accordion-3lc": ("allgather", "twostage"),
    "dqsg": ("allgather",),
    # issue 61's screening (docs/screening.md) compares on the allgather, as 3LC's rows
    "3lc-min64k": ("allgather",),
    "block3lc": ("allgather",),
    "block3lc-b256": ("allgather",),
    "block3lc-b4096": ("allgather",),
    "block3lc-warmup": ("allgather",),
    "block3lc-s1.25": ("allgather",),
    "block3lc-tensor-mc": ("allgather",),
    "block3lc-b4096-late3": ("allgather",),
    "block3lc-b4096-s1.25-mc": ("allgather",),
    "block3lc-tensor-warmup": ("allgather",),
    "block3lc-b4096-s1.25-warmup": ("allgather",),
    "block3lc-b4096-warmup": ("allgather",),
    "block3lc-mc": ("allgather",),
    "block3lc-b4096-mc": ("allgather",),
    "accordion-block3lc": ("allgather",),
    "accordion-block3lc-tensor": ("allgather",),
    "block3lc-tensor-l3": ("allgather",),
    "block3lc-b4096-l3": ("allgather",),
    "dqsg-l1": ("allgather",),
    "block3lc-b4096-sr": ("allgather",),
    "block3lc-tensor-sr-noef": ("allgather",),
    "block3lc-tensor-ef21": ("allgather",),
}
_TABLE += [m.on(x) for m in list(_TABLE) for x in FIXED_EXCHANGES.get(m.name, ())]
METHODS: dict[str, Method] = {m.name: m for m in _TABLE}


def get_method(name: str) -> Method:
    try:
        return METHODS[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r}: one of {', '.join(METHODS)}") from None


# ---- command-line spellings ----------------------------------------------------------------
def param_value(text: str):
    """A parameter value from text: true/false, an int, a float, else the text."""
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_params(items: Iterable[str]) -> dict[str, Any]:
    """``["key=value", ...]`` -> ``{key: param_value(value)}``; ValueError on a bad item."""
    params = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"takes KEY=VALUE, got {item!r}")
        params[key.strip()] = param_value(value.strip())
    return params


def parse_case(text: str) -> tuple[str, dict[str, Any]]:
    """``"name:key=value,..."`` -> (compressor name, parameters). A name that is not a
    registered compressor but a method without policy or ``compress_min_numel`` stands for
    the method's compressor and parameters (``"3lc-1.75"`` -> ``("3lc", {"sparsity":
    1.75})``); parameters after the colon override the method's."""
    name, _, rest = text.partition(":")
    params = parse_params(filter(None, rest.split(",")))
    if name not in hvdcompress.compressors.REGISTRY and name in METHODS:
        m = METHODS[name]
        if m.policy is not None or m.compress_min_numel:
            raise ValueError(f"{name} is a method with a policy or compress_min_numel, not a case")
        return m.compression, {**m.params, **params}
    return name, params
