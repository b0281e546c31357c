"""CAT: communication-aware adaptive tuning (Khirirat et al., arXiv 2003.06377;
docs/policies.md, "CAT", for the derivation, the bits and descent of each kind, the cost
models, calibration and refresh).

Per tensor, CAT picks the budget T (kept entries) that maximises the guaranteed decrease
per second of communication,

    T* = argmax_{1 <= T <= n}  D(T) / C(bits(T))

evaluated at every T from one descending sort and prefix sums (exact, O(n log n), no
unimodality assumed), among the budgets whose payload is at most an allreduce of the
dense tensor. T becomes the compressor's per-tensor ``ratio``: (T - 1/2) / n for the
top-k kinds (ceil(n ratio) = T exactly), T / n for gspar (its expected budget).

Agreement: rank 0 computes T* from its own gradient every ``recompute_every`` steps, and
one ``allgather_object`` at the end of that step gives every rank rank 0's choices (and,
with ``refresh``, pools every rank's timings so all refit the same cost model), so every
rank uses the same T from the next step on.
"""

from __future__ import annotations

import numpy as np
import torch

from hvdcompress import checks
from hvdcompress.checkpoint import CheckpointError, check_count_map, check_finite_number, check_keys
from hvdcompress.compressors import registry
from hvdcompress.policies.base import Policy, checked_levels
from hvdcompress.transports.cost import CostModel, PacketCost, calibrate

HEADER_BITS = 8 * 48  # wire header of a 1-D top-k payload
KINDS = ("topk", "topk+q", "randomk")  # the budget kinds (docs/policies.md, "Derivation")


def compressor_for(kind: str) -> str:
    """The registered compressor that implements budget ``kind`` (its ``cat_kind``)."""
    cls = registry.for_cat_kind(kind)
    if cls is None:
        raise ValueError(f"no registered compressor implements CAT kind {kind!r}")
    return cls.name


# ---- the budget ----------------------------------------------------------------------------------
def budget_bits(T, n: int, kind: str = "topk", header_bits: int = HEADER_BITS):
    """bits(T) of docs/policies.md, "CAT" for ``kind`` (vectorised over T)."""
    T = np.asarray(T, dtype=np.float64)
    ib = 32 if n < 2**31 else 64  # index bits, as the top-k codec sends them
    if kind in ("topk", "randomk"):
        return T * (32 + ib) + header_bits
    if kind == "topk+q":
        return T * (1 + ib) + 32
    raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")


def descent(grad, kind: str = "topk") -> np.ndarray:
    """D(T) for T = 1..n (up to the constant 1/2L) for ``kind``; float64."""
    g = np.abs(np.asarray(torch.as_tensor(grad).detach().reshape(-1).double().cpu()))
    a = -np.sort(-g)  # descending magnitudes
    if kind == "topk":
        return np.cumsum(a * a)
    if kind == "topk+q":
        t = np.arange(1, a.size + 1, dtype=np.float64)
        return np.cumsum(a) ** 2 / t
    if kind == "randomk":
        return _randomk_descent(a)
    raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")


def _randomk_descent(a: np.ndarray) -> np.ndarray:
    """D(T) = ||g||^4 / sum(g_i^2 / p_i), p_i = min(1, c a_i), sum p_i = T, T = 1..n, for
    descending magnitudes a. With j entries saturated (p = 1), c = (T - j) / S_j where
    S_j = sum a[j:], consistent iff c a_j <= 1, i.e. T <= B_j = j + S_j / a_j; the fewest
    saturated entries j(T) is the first j with B_j >= T (a search in the prefix maximum
    of B, which exists for T < nz since B_{T-1} >= T), and then
    sum g_i^2 / p_i = sum_{i < j} a_i^2 + S_j / c."""
    n = a.size
    out = np.zeros(n, dtype=np.float64)
    nz = int(np.count_nonzero(a))
    if nz == 0:
        return out
    a = a[:nz]
    sq = a * a
    norm2 = sq.sum()
    pre_sq = np.concatenate([[0.0], np.cumsum(sq)])  # sum of the j largest a^2
    suffix = np.cumsum(a[::-1])[::-1]  # S_j = sum a[j:], j < nz
    reach = np.maximum.accumulate(np.arange(nz) + suffix / a)  # prefix max of B_j
    T = np.arange(1, nz, dtype=np.float64)  # T < nz; T >= nz keeps everything: D = ||g||^2
    j = np.searchsorted(reach, T, side="left")
    c = (T - j) / suffix[j]
    out[: nz - 1] = norm2 * norm2 / (pre_sq[j] + suffix[j] / c)
    out[nz - 1 :] = norm2
    return out


def cat_best_budget(
    grad,
    cost: CostModel,
    kind: str = "topk",
    header_bits: int = HEADER_BITS,
    dense_fraction: float = 1.0,
) -> tuple[int, float, float]:
    """(T*, D(T*)/C(T*), C(T*)): the budget maximising descent per unit of cost, among the
    budgets whose payload is at most ``dense_fraction`` of the dense float32 tensor
    (bits(T) <= dense_fraction * 32 n + header; T = 1 always allowed): beyond that,
    sparse coding costs more than sending everything, which a large fixed cost c0 would
    otherwise make CAT do. The policy uses dense_fraction = min(1, 2 / ranks): an
    allgather of the payload then moves no more than an allreduce of the dense tensor."""
    d = descent(grad, kind)
    n = d.size
    if n == 0:
        return 0, 0.0, float(cost(budget_bits(0, 0, kind, header_bits)))
    bits = budget_bits(np.arange(1, n + 1), n, kind, header_bits)
    cap = dense_fraction * 32.0 * n + header_bits
    allowed = max(1, int(np.count_nonzero(bits <= cap)))
    d = d[:allowed]  # bits grow with T: the allowed budgets are a prefix
    c = cost(bits[:allowed])
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(c > 0, d / c, np.where(d > 0, np.inf, 0.0))
    best = int(np.argmax(ratio))  # first maximum: the smallest such T
    return best + 1, float(ratio[best]), float(c[best])


# ---- the policy ----------------------------------------------------------------------------------
class CAT(Policy):
    """Per tensor budget T maximising D(T)/C(T), recomputed every ``recompute_every`` steps
    by rank 0 and shared with every rank (see module doc). ``compressor``: the kind
    ("topk", "topk+q", "randomk"; the optimizer's compressor must be
    ``compressor_for(kind)``); ``cost_model``: a CostModel, or None to ``calibrate`` the
    transport at bind time; ``refresh``: refit the model from measured collectives."""

    def __init__(
        self,
        compressor: str = "topk",
        cost_model: CostModel | None = None,
        recompute_every: int = 200,
        header_bits: int = HEADER_BITS,
        refresh: bool = False,
    ) -> None:
        self.kind = checks.choice("compressor", compressor, KINDS)
        if cost_model is not None and not isinstance(cost_model, CostModel):
            raise TypeError(f"cost_model must be None or a CostModel, got {cost_model!r}")
        self.cost = cost_model
        self.recompute_every = checks.integer("recompute_every", recompute_every, 1)
        self.header_bits = checks.integer("header_bits", header_bits, 0)
        self.refresh = checks.boolean("refresh", refresh)
        self.budgets: dict[str, int] = {}  # T in force per tensor
        self._pending: dict[str, int] = {}
        self._fresh: list[tuple[float, float]] = []  # this rank's new (bits, seconds)
        self._numel: dict[str, int] = {}
        self._steps = 0
        self._metrics: dict = {}
        self._compressor = self._transport = self._optimizer = None

    def __repr__(self) -> str:
        return f"CAT(compressor={self.kind!r}, cost_model={self.cost!r}, S={self.recompute_every})"

    def bind(self, optimizer, compressor, transport, names: list[str]) -> None:
        need = compressor_for(self.kind)
        if compressor.name != need:
            raise TypeError(
                f"CAT(compressor={self.kind!r}) drives the {need!r} compressor, the optimizer "
                f"has {compressor!r}: use compression={need!r}"
            )
        self._optimizer, self._compressor, self._transport = optimizer, compressor, transport
        if self.cost is None:
            self.cost = calibrate(transport)

    def _deciding(self) -> bool:
        return self._steps % self.recompute_every == 0

    def _ratio(self, T: int, n: int) -> float:
        return T / n if self.kind == "randomk" else (T - 0.5) / n  # topk: ceil(n r) == T

    def observe(self, name: str, grad) -> None:
        self._numel[name] = grad.numel()
        if self._deciding() and self._transport.rank == 0:
            dense = min(1.0, 2.0 / max(self._transport.size, 1))  # gather <= dense allreduce
            self._pending[name] = cat_best_budget(
                grad, self.cost, self.kind, self.header_bits, dense
            )[0]

    def after_step(self, stats) -> None:
        timings = [
            (8.0 * t.payload_bytes, t.seconds) for t in stats.timings if t.seconds is not None
        ]
        modelled = sum(float(self.cost(bits)) for bits, _ in timings)
        measured = sum(t for _, t in timings)
        if self.refresh:
            self._fresh.extend(timings)
        if self._deciding():
            # one small collective: rank 0's budgets and every rank's new timings
            shared = self._transport.allgather_object((self._pending, self._fresh))
            if self.refresh:
                for _, fresh in shared:  # rank order: every rank refits the same numbers
                    for bits, t in fresh:
                        self.cost.observe(bits, t)
                self.cost.refit()
                self._fresh = []
            for name, T in shared[0][0].items():
                n = self._numel.get(name, 0)
                if n and T:
                    self.budgets[name] = T
                    self._compressor.set_level(name, self._ratio(T, n))
            self._pending = {}
        self._steps += 1
        self._metrics = {f"T/{n}": t for n, t in self.budgets.items()}
        self._metrics.update(
            {"cat/modelled_s": modelled, "cat/measured_s": measured, "cat/c0": self.cost.c0,
             "cat/c1": self.cost.c1}
        )  # fmt: skip

    def state_dict(self) -> dict:
        cost = {"c0": self.cost.c0, "c1": self.cost.c1, "observations": self.cost.observations}
        if isinstance(self.cost, PacketCost):
            cost["packet_bits"] = self.cost.packet_bits
        return {
            "kind": self.kind,
            "steps": self._steps,
            "budgets": dict(self.budgets),
            "levels": {n: self._compressor.level(n) for n in self.budgets},
            "numel": dict(self._numel),
            "cost": cost,
        }

    def load_state_dict(self, state: dict) -> None:
        """Everything is checked before anything changes (``CheckpointError`` naming the
        entry: non-finite costs, budgets that are not positive ints, refused levels)."""
        check_keys(
            "CAT state", state, required=("kind", "steps", "budgets", "levels", "numel", "cost")
        )
        if state.get("kind") != self.kind:
            raise CheckpointError(
                f"state is of CAT({state.get('kind')!r}), this is CAT({self.kind!r})"
            )
        cost = check_keys(
            "CAT cost", state["cost"], required=("c0", "c1", "observations"),
            optional=("packet_bits",),
        )  # fmt: skip
        if ("packet_bits" in cost) != isinstance(self.cost, PacketCost):
            raise CheckpointError("state and this CAT have different kinds of cost model")
        c0 = check_finite_number("CAT cost c0", cost["c0"], low=0.0)
        c1 = check_finite_number("CAT cost c1", cost["c1"], low=0.0)
        observations = []
        for i, o in enumerate(cost["observations"]):
            if not isinstance(o, (list, tuple)) or len(o) != 2:
                raise CheckpointError(f"CAT cost observations[{i}]: expected (bits, seconds)")
            observations.append(
                tuple(check_finite_number(f"CAT cost observations[{i}]", v) for v in o)
            )
        steps = state["steps"]
        if type(steps) is not int or steps < 0:
            raise CheckpointError(f"CAT steps: expected an int >= 0, got {steps!r}")
        budgets = check_count_map("CAT budgets", state["budgets"])
        numel = check_count_map("CAT numel", state["numel"])
        levels = checked_levels("CAT levels", state["levels"], self._compressor)
        self.cost.c0, self.cost.c1 = c0, c1
        self.cost.observations = observations
        self._steps = steps
        self._numel = numel
        self.budgets = budgets
        for name, level in levels.items():
            self._compressor.set_level(name, level)
