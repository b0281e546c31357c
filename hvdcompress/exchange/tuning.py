"""``exchange="auto"`` measured while training: each bucket keeps the fastest of the
exchanges open to it (docs/exchanges.md, "Measured while training").

A model of the link (bytes, or a ``LinkCost``) guesses which exchange is fastest; the
guess is wrong where encode and decode cost more than the bytes they save (a fast link,
a busy CPU), and compression then makes training slower than DDP's own allreduce
(Agarwal et al., "On the utility of gradient compression", MLSys 2022). So the
``ExchangeTuner`` times the options instead, as Horovod's autotuner times its fusion
settings: after ``Tuning.warmup_steps`` steps it runs a round of trials, each option for
``steps_per_option`` steps (every bucket open to it takes it; the others keep theirs),
then each bucket keeps the option of the least median step time. Every
``recheck_every`` steps a new round re-times the options, and a bucket moves only to an
option faster by ``margin`` than the one it keeps, so it never flaps from step to step.

Besides the compressed exchanges and the float32 allreduce ("dense"), a 16-bit allreduce
(``Tuning.half``: "bf16", the default, or "fp16"; None keeps float32 the only dense
option) is timed too: on a fast link whose step is set by compute it is the fastest thing
a torch user has (half the bytes, no encode, no decode).

Drift (``Tuning.drift``): after a decision the tuner keeps timing the steps, in windows of
``drift_window`` steps (rank-averaged medians). The first window is the baseline; a later
one more than ``drift`` slower or faster than it starts a round of trials at once (a
codec's payload that grew as the model fit its batch, a link whose load changed), which
times every option, those sitting a round out included. A drift
round that moves no bucket doubles the window before the next check, so a noisy step time
costs ever fewer re-checks; ``rounds``, ``drift_rounds`` and ``trial_steps`` count what
the re-checks cost. ``drift=None`` turns it off.

The time of a step runs from its first bucket's start to its end (``begin_step`` to
``end_step``): the backward from the first bucket on, the encodes, the waits, the
decodes, nothing of the forward, the data loading or an evaluation between steps.

Invariants: every rank takes the same option for every bucket at every step: the trial
schedule depends only on the step count, and every measured step time is averaged over
the ranks (one ``sum_floats`` at the start of the step after it, where every rank starts
its collectives in the same order) before any decision reads it. An option whose first
trial step is slower than ``give_up`` x the best median of the round so far is dropped
from the round after that one step (a dense allreduce on a slow link costs one step, not
``steps_per_option``), and at the next re-check it sits out; it is timed again at the one
after.
"""

from __future__ import annotations

import statistics
import time
import warnings
from collections.abc import Hashable
from dataclasses import dataclass, field

from hvdcompress import checks

# the order a round times the options in, after each bucket's first guess
OPTION_ORDER = ("allgather", "twostage", "hierarchical", "allreduce", "bf16", "fp16", "dense")
HALF = ("bf16", "fp16")  # the 16-bit dense options


@dataclass(frozen=True)
class Tuning:
    """How ``exchange="auto"`` times its options (module doc); ``tuning=None`` in the
    adapters keeps the first guess (``choose_exchanges``'s bytes rule) for good.
    ``half``: the 16-bit dense option timed beside the others ("bf16", "fp16"; None:
    float32 only); ``drift``, ``drift_window``: re-time when the kept options' step time
    moves by more than ``drift`` (None: never), checked every ``drift_window`` steps."""

    warmup_steps: int = 5
    steps_per_option: int = 3
    recheck_every: int = 1000
    margin: float = 0.05
    give_up: float = 1.5
    half: str | None = "bf16"
    drift: float | None = 0.25
    drift_window: int = 20

    def __post_init__(self) -> None:
        # each in its canonical type (``checks``): Tuning(warmup_steps=2.0) is warmup_steps=2
        canonical = {
            "warmup_steps": checks.integer("warmup_steps", self.warmup_steps, 1),
            "steps_per_option": checks.integer("steps_per_option", self.steps_per_option, 1),
            "recheck_every": checks.integer("recheck_every", self.recheck_every, 0),
            "margin": checks.number("margin", self.margin, 0.0, 1.0, open_low=True),
            "give_up": checks.number("give_up", self.give_up, 1.0),
            "half": checks.choice("half", self.half, (*HALF, None)),
            "drift": None
            if self.drift is None
            else checks.number("drift", self.drift, 0.0, open_low=True),
            "drift_window": checks.integer("drift_window", self.drift_window, 2),
        }
        for name, value in canonical.items():
            object.__setattr__(self, name, value)


DEFAULT_TUNING = Tuning()


def check_tuning(tuning, exchange: str = "auto") -> None:
    """The adapters' ``tuning`` argument: a ``Tuning`` or None (TypeError otherwise); a
    ``Tuning`` of the user's with another ``exchange`` than "auto", which times nothing,
    gets a warning (the default one is silent)."""
    if tuning is not None and not isinstance(tuning, Tuning):
        raise TypeError(f"tuning must be a hvdcompress.Tuning or None, got {tuning!r}")
    if tuning is not None and tuning != DEFAULT_TUNING and exchange != "auto":
        warnings.warn(
            f"tuning={tuning!r} has no effect with exchange={exchange!r}: only "
            "exchange='auto' times its options while training",
            UserWarning,
            stacklevel=3,
        )


def make_tuner(tuning: Tuning | None, mode: str, transport) -> ExchangeTuner | None:
    """The tuner of an adapter: with ``exchange="auto"`` and a ``Tuning``, over a
    transport of several ranks whose step times say what its link costs
    (``Transport.tunable``: not the simulated world, where one process plays every rank);
    else None (the first guess stays)."""
    if tuning is None or mode != "auto" or transport.size < 2 or not transport.tunable:
        return None
    return ExchangeTuner(tuning, transport.size)


@dataclass(frozen=True)
class TuneDecision:
    """What a round decided for one bucket: at ``step``, ``option`` (``kept``: it was the
    bucket's option already), from the rank-averaged median step ``seconds`` of each
    option the round timed."""

    step: int
    bucket: Hashable
    option: str
    kept: bool
    seconds: dict[str, float] = field(default_factory=dict)

    def __str__(self) -> str:
        times = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in sorted(self.seconds.items()))
        verb = "keeps" if self.kept else "takes"
        return f"step {self.step}: bucket {self.bucket} {verb} {self.option} ({times})"


class ExchangeTuner:
    """The options of every bucket and the one each takes this step (module doc).

    ``add(bucket, options, first)``: a bucket, its open options (labels) and the one it
    takes until a round decides. Each step: ``begin_step(sum_floats)`` before its first
    bucket starts, ``option(bucket)`` for each bucket, ``end_step()`` when the step
    ends. ``sum_floats``: the transport's (collective; the same point on every rank)."""

    def __init__(self, tuning: Tuning, size: int, clock=time.perf_counter) -> None:
        self.tuning = tuning
        self.size = size
        self.clock = clock
        self.options: dict[Hashable, tuple[str, ...]] = {}
        self.current: dict[Hashable, str] = {}
        self.decisions: list[TuneDecision] = []  # every round's, in order
        self.steps = 0  # ended steps
        self._began: float | None = None  # clock at begin_step of the step in progress
        self._trial: str | None = None  # the option every open bucket takes this step
        self._pending: tuple[str, float] | None = None  # last step's (trial, local seconds)
        self._round: list[str] = []  # options still to time in this round
        self._times: dict[str, list[float]] = {}  # this round's rank-averaged step times
        self._left = 0  # steps left for the option being timed
        self._rounds = 0
        self._next_round = tuning.warmup_steps
        self._sit_out: dict[str, int] = {}  # option -> the round it is timed again
        self._labels: dict[Hashable, str] = {}
        self._seen: set = set()  # buckets that started during this round
        self.drift_rounds = 0  # rounds a drift started
        self.trial_steps = 0  # steps spent on trials, all rounds together
        self._window = tuning.drift_window  # steps per drift check (doubles on no move)
        self._watched: list[float] = []  # local step times of this drift window
        self._watch: float | None = None  # a finished window's local median, to average
        self._baseline: float | None = None  # the first window after a decision
        self._by_drift = False  # the round in progress was started by a drift

    @property
    def rounds(self) -> int:
        """Rounds of trials so far (the first, the re-checks and the drift rounds)."""
        return self._rounds

    def add(self, bucket: Hashable, options, first: str, label: str | None = None) -> None:
        """A bucket (``label``: its name in ``decisions``; default ``str(bucket)``)."""
        options = tuple(options)
        if first not in options:
            raise ValueError(f"bucket {bucket}: its first option {first!r} is not in {options}")
        self.options[bucket] = options
        self.current[bucket] = first
        self._labels[bucket] = str(bucket) if label is None else label

    @property
    def tuning_now(self) -> bool:
        """Whether a round of trials is in progress."""
        return self._trial is not None or bool(self._round)

    def option(self, bucket: Hashable) -> str:
        """The option ``bucket`` takes this step: the trial's where it is open to it."""
        if self._trial is not None:
            self._seen.add(bucket)
            if self._trial in self.options[bucket]:
                return self._trial
        return self.current[bucket]

    def begin_step(self, sum_floats) -> None:
        """The step's first bucket is about to start: average the last trial step's time
        over the ranks (collective, trial steps only) and set this step's trial."""
        if self._pending is not None:
            label, seconds = self._pending
            self._pending = None
            mean = sum_floats([seconds])[0] / self.size
            self._times.setdefault(label, []).append(mean)
            if len(self._times[label]) == 1 and self._slower_than_best(label, mean):
                self._left = 0  # given up on this round (module doc)
        if self._watch is not None:  # a drift window ended (collective, the same step)
            self._check_drift(sum_floats([self._watch])[0] / self.size)
            self._watch = None
        if self._trial is not None and self._left == 0:
            self._trial = None
            if not self._round:
                self._decide()
        if self._trial is None and not self._round and self.steps >= self._next_round:
            self._start_round()
        if self._trial is None and self._round:
            self._trial = self._round.pop(0)
            self._left = self.tuning.steps_per_option
        self._began = self.clock()

    def end_step(self) -> None:
        """The step ended: its time is kept where it was a trial step."""
        if self._began is None:  # a step no bucket of which was tuned
            return
        seconds = self.clock() - self._began
        self._began = None
        self.steps += 1
        if self._trial is not None:
            self._pending = (self._trial, seconds)
            self._left -= 1
            self.trial_steps += 1
        elif self.decisions and self.tuning.drift is not None and not self._round:
            self._watched.append(seconds)
            if len(self._watched) == self._window:
                self._watch = statistics.median(self._watched)
                self._watched = []

    def _check_drift(self, seconds: float) -> None:
        """A window's rank-averaged median: the baseline, or against it (module doc)."""
        if self._baseline is None:
            self._baseline = seconds
            return
        factor = 1.0 + self.tuning.drift
        if seconds > factor * self._baseline or seconds * factor < self._baseline:
            self._next_round = self.steps  # a round of trials starts now
            self.drift_rounds += 1
            self._by_drift = True

    # -- rounds ----------------------------------------------------------------------------

    def _start_round(self) -> None:
        multi = {o for opts in self.options.values() if len(opts) > 1 for o in opts}
        if not multi:  # no bucket has a choice: nothing to time, ever
            self._next_round = float("inf")
            return
        firsts = [self.current[b] for b, opts in self.options.items() if len(opts) > 1]
        order = sorted(multi, key=lambda o: (o not in firsts, OPTION_ORDER.index(o)))
        self._rounds += 1
        kept = set(self.current.values())  # a bucket's own option is always timed
        # a drift round times every option: the losses that sat one out were measured
        # before whatever moved the step time
        self._round = [
            o for o in order
            if o in kept or self._by_drift or self._sit_out.get(o, 0) <= self._rounds
        ]  # fmt: skip
        self._times = {}
        self._seen = set()

    def _slower_than_best(self, label: str, seconds: float) -> bool:
        done = [statistics.median(t) for o, t in self._times.items() if o != label]
        return bool(done) and seconds > self.tuning.give_up * min(done)

    def _decide(self) -> None:
        medians = {o: statistics.median(t) for o, t in self._times.items()}
        first_round = not self.decisions
        moved = False
        for bucket, opts in self.options.items():
            timed = {o: medians[o] for o in opts if o in medians}
            if len(opts) < 2 or not timed or bucket not in self._seen:
                continue  # (not seen: a bucket DDP no longer makes, after its rebuild)
            best = min(timed, key=lambda o: (timed[o], opts.index(o)))
            keep = self.current[bucket]
            if not first_round and keep in timed:
                if timed[best] >= (1.0 - self.tuning.margin) * timed[keep]:
                    best = keep  # not faster by the margin: no move (never flaps)
            self.decisions.append(
                TuneDecision(self.steps, self._labels[bucket], best, best == keep, dict(timed))
            )
            moved = moved or best != keep
            self.current[bucket] = best
        best_time = min(medians.values())
        for option, seconds in medians.items():  # the clear losers sit the next round out
            if seconds > self.tuning.give_up * best_time:
                self._sit_out[option] = self._rounds + 2
        every = self.tuning.recheck_every
        self._next_round = self.steps + every if every else float("inf")
        # drift: a new baseline; a drift round that moved nothing waits twice as long
        self._window = (
            self._window * 2 if self._by_drift and not moved else self.tuning.drift_window
        )
        self._by_drift, self._baseline, self._watched, self._watch = False, None, [], None
