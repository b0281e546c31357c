"""exchange.tuning: the ``ExchangeTuner`` of ``exchange="auto"``, on ranks that are
threads of a simulated world (its ``sum_floats`` is the real reduction) and a clock each
rank advances by what its option costs it in a step. The same tuner under real
torch.distributed, MPI and a rate-limited link: tests/test_exchange_tuning_real.py,
tests/mpi/test_tuning.py.

* After its warm-up and one round it keeps, per bucket, the option of the least
  rank-averaged median step: dense where compression costs more than it saves,
  compressed where the link is slow, the option a bucket has where others have more.
* Every rank takes the same option at every step, even when the ranks' own timings
  disagree (load skew): decisions read only rank-averaged times.
* It does not flap: noise below the margin never moves a bucket; a real change moves it
  once, at the next re-check. A clear loser is timed one step per round, and sits the
  next re-check out.
"""

from __future__ import annotations

import threading

import pytest

from hvdcompress import Tuning
from hvdcompress.exchange.tuning import ExchangeTuner, TuneDecision
from hvdcompress.transports.simulated import SimulatedWorld

FAST = Tuning(warmup_steps=2, steps_per_option=3, recheck_every=50, margin=0.05, give_up=1.5)
OPTIONS = {0: ("allgather", "twostage", "dense"), 1: ("allgather", "dense")}
FIRST = {0: "twostage", 1: "allgather"}


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _run(costs, steps: int, tuning: Tuning = FAST, size: int = 3):
    """Each rank's tuner for ``steps`` steps; ``costs(rank, step, option_of) -> seconds``
    of that rank's step. Returns per rank the options every bucket took at every step,
    the tuners, and whether each step of rank 0 was a trial step."""
    world = SimulatedWorld(size)
    taken = [[] for _ in range(size)]
    trials = [[] for _ in range(size)]  # whether each step was a trial step
    tuners: list[ExchangeTuner | None] = [None] * size
    errors = []

    def rank(r: int) -> None:
        try:
            transport = world.transport(r)
            clock = _Clock()
            tuner = tuners[r] = ExchangeTuner(tuning, size, clock)
            for b, opts in OPTIONS.items():
                tuner.add(b, opts, FIRST[b])
            for step in range(steps):
                tuner.begin_step(transport.sum_floats)
                now = {b: tuner.option(b) for b in OPTIONS}
                taken[r].append(now)
                trials[r].append(tuner.tuning_now)
                clock.now += costs(r, step, now)
                tuner.end_step()
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)
            world.abort(repr(err))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return taken, tuners, trials[0]


def _by_option(table):
    """A step cost: the sum over buckets of ``table[option]``."""
    return lambda r, step, now: sum(table[o] for o in now.values())


def test_it_keeps_dense_where_compression_costs_more_than_it_saves():
    taken, tuners, _ = _run(_by_option({"allgather": 0.09, "twostage": 0.08, "dense": 0.03}), 20)
    # warm-up 2, then allgather, twostage (3 steps each), dense (3): decided by step 11
    assert all(t[12:] == [{0: "dense", 1: "dense"}] * 8 for t in taken)
    assert [str(d) for d in tuners[0].decisions] == [str(d) for d in tuners[1].decisions]
    assert {d.option for d in tuners[0].decisions} == {"dense"}


def test_it_keeps_the_compressed_option_of_each_bucket_on_a_slow_link():
    taken, tuners, _ = _run(_by_option({"allgather": 0.05, "twostage": 0.04, "dense": 2.0}), 20)
    assert all(t[-1] == {0: "twostage", 1: "allgather"} for t in taken)
    # dense is ~40x slower than the best so far: timed for one step only
    assert sum(1 for now in taken[0] if "dense" in now.values()) == 1
    assert tuners[0].current == {0: "twostage", 1: "allgather"}


def test_the_first_guess_goes_first_and_a_bucket_without_the_trial_keeps_its_own():
    taken, _, _ = _run(_by_option({"allgather": 0.05, "twostage": 0.04, "dense": 2.0}), 12)
    # round order: the first guesses (allgather, twostage), then dense
    assert taken[0][2] == {0: "allgather", 1: "allgather"}
    assert taken[0][5] == {0: "twostage", 1: "allgather"}  # bucket 1 has no twostage


def test_ranks_agree_when_their_own_timings_disagree():
    # rank 0 finds allgather fastest, ranks 1 and 2 twostage; the average decides
    own = {
        0: {"allgather": 0.02, "twostage": 0.06, "dense": 0.5},
        1: {"allgather": 0.07, "twostage": 0.02, "dense": 0.5},
        2: {"allgather": 0.07, "twostage": 0.03, "dense": 0.5},
    }
    taken, tuners, _ = _run(lambda r, step, now: sum(own[r][o] for o in now.values()), 16)
    assert taken[0] == taken[1] == taken[2]
    assert tuners[0].current[0] == "twostage"


def test_noise_below_the_margin_never_moves_a_bucket():
    def noisy(r, step, now):  # +-2 % from step to step and rank to rank
        wobble = 1.0 + 0.02 * (-1) ** (step + r)
        return wobble * sum({"allgather": 0.050, "twostage": 0.049, "dense": 0.2}[o]
                            for o in now.values())  # fmt: skip

    taken, tuners, trials = _run(noisy, 400)
    switches = [d for d in tuners[0].decisions if not d.kept and d.step > 20]
    assert switches == []
    steady = [now for i, now in enumerate(taken[0]) if i > 20 and not trials[i]]
    assert len(steady) > 300 and len({tuple(n.items()) for n in steady}) == 1


def test_a_real_change_moves_a_bucket_once_at_the_next_recheck():
    def shifting(r, step, now):  # from step 100 on, the link got fast: dense wins
        dense = 2.0 if step < 100 else 0.01
        return sum({"allgather": 0.05, "twostage": 0.04, "dense": dense}[o] for o in now.values())

    taken, tuners, _ = _run(shifting, 260)
    moves = [d for d in tuners[0].decisions if not d.kept and d.step > 20]
    assert {d.bucket for d in moves} == {"0", "1"} and {d.option for d in moves} == {"dense"}
    assert all(d.step > 100 for d in moves)
    assert taken[0][-1] == {0: "dense", 1: "dense"}


def test_a_clear_loser_sits_the_next_recheck_out():
    taken, _, _ = _run(_by_option({"allgather": 0.05, "twostage": 0.04, "dense": 2.0}), 140)
    dense_steps = [i for i, now in enumerate(taken[0]) if "dense" in now.values()]
    # timed at the first round, skipped at the re-check of ~step 60, timed at ~step 110
    assert len(dense_steps) == 2 and dense_steps[0] < 20 and dense_steps[1] > 100


def test_recheck_every_zero_decides_once():
    _, tuners, _ = _run(_by_option({"allgather": 0.05, "twostage": 0.04, "dense": 2.0}),
                     200, Tuning(warmup_steps=2, steps_per_option=1, recheck_every=0))  # fmt: skip
    assert len({d.step for d in tuners[0].decisions}) == 1


def test_a_decision_reads_as_a_log_line():
    d = TuneDecision(12, "fc1.weight..fc2.bias (4 tensors)", "dense", False,
                     {"allgather": 0.05, "dense": 0.0123})  # fmt: skip
    assert str(d) == (
        "step 12: bucket fc1.weight..fc2.bias (4 tensors) takes dense "
        "(allgather 50.0 ms, dense 12.3 ms)"
    )


@pytest.mark.parametrize(
    "field,bad",
    [("warmup_steps", 0), ("steps_per_option", 0), ("recheck_every", -1), ("margin", 0.0),
     ("margin", 1.5), ("give_up", 0.9), ("warmup_steps", 2.5), ("half", "bf32"),
     ("drift", -0.1), ("drift", 0.0), ("drift_window", 1)],
)  # fmt: skip
def test_bad_settings_are_refused_by_name(field, bad):
    with pytest.raises((TypeError, ValueError), match=field):
        Tuning(**{field: bad})


def test_a_first_option_that_is_not_open_is_refused():
    tuner = ExchangeTuner(FAST, 2)
    with pytest.raises(ValueError, match="first option 'hierarchical'"):
        tuner.add(0, ("allgather", "dense"), "hierarchical")


def test_an_integral_float_is_taken_as_its_int():
    assert Tuning(warmup_steps=2.0).warmup_steps == 2
    assert type(Tuning(warmup_steps=2.0).warmup_steps) is int
    assert repr(Tuning(warmup_steps=2.0)) == repr(Tuning(warmup_steps=2))


DRIFT = Tuning(warmup_steps=2, steps_per_option=3, recheck_every=0, drift=0.25, drift_window=5)


def _growing(after: int):
    """The allgather's step grows 4x from step ``after`` on (a payload that grew as the
    model fit its batch); the two-stage exchange and dense stay as they were."""

    def cost(r, step, now):
        table = {"allgather": 0.05 if step < after else 0.2, "twostage": 0.08, "dense": 0.5}
        return sum(table[o] for o in now.values())

    return cost


def test_a_kept_option_that_drifts_is_re_timed_and_the_bucket_moves():
    taken, tuners, _ = _run(_growing(40), 80, DRIFT)
    assert all(t[20] == {0: "allgather", 1: "allgather"} for t in taken)  # the first round
    assert all(t[-1] == {0: "twostage", 1: "allgather"} for t in taken)  # after the drift
    assert [tu.drift_rounds for tu in tuners] == [1, 1, 1]
    assert [str(d) for d in tuners[0].decisions] == [str(d) for d in tuners[2].decisions]
    moved = [d for d in tuners[0].decisions if not d.kept and d.step > 40]
    assert len(moved) == 1 and moved[0].option == "twostage" and moved[0].bucket == "0"


def test_without_drift_the_choice_stays_until_the_recheck():
    still = Tuning(**{**vars(DRIFT), "drift": None})
    taken, tuners, _ = _run(_growing(40), 80, still)
    assert all(t[-1] == {0: "allgather", 1: "allgather"} for t in taken)
    assert tuners[0].drift_rounds == 0 and tuners[0].rounds == 1


def test_a_drift_that_moves_nothing_waits_twice_as_long_before_the_next_check():
    """A step time that swings 40% every window but whose best option never changes:
    each drift round keeps every bucket, and the check window doubles each time, so the
    re-checks' cost shrinks (bounded: a few rounds in 200 steps)."""

    def swinging(r, step, now):
        table = {"allgather": 0.05 if (step // 5) % 2 else 0.07, "twostage": 0.3, "dense": 0.9}
        return sum(table[o] for o in now.values())

    taken, tuners, _ = _run(swinging, 200, DRIFT)
    tuner = tuners[0]
    assert all(t[-1] == {0: "allgather", 1: "allgather"} for t in taken)
    assert 1 <= tuner.drift_rounds <= 4, tuner.drift_rounds
    assert tuner._window >= 2 * DRIFT.drift_window
    assert tuner.trial_steps < 40, tuner.trial_steps  # bounded, and reported


def test_a_drift_round_times_the_options_that_sat_out():
    """Dense lost by far at the first round (it sits the next re-check out), then the
    allgather's step grows 20x: the drift round times dense again and the buckets move to
    it, instead of a round of one option that can only keep what it has."""

    def cost(r, step, now):
        table = {"allgather": 0.05 if step < 40 else 1.0, "twostage": 2.0, "dense": 0.4}
        return sum(table[o] for o in now.values())

    taken, tuners, _ = _run(cost, 90, DRIFT)
    assert all(t[20] == {0: "allgather", 1: "allgather"} for t in taken)
    assert all(t[-1] == {0: "dense", 1: "dense"} for t in taken)
    assert tuners[0].drift_rounds == 1
    late = [d for d in tuners[0].decisions if d.step > 40]
    assert late and all("dense" in d.seconds for d in late)
