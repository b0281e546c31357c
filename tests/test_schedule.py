"""Learning-rate schedules (hvdcompress.training.schedule): the rate at every step, the
default milestones, warmup, the checks of bad input, and the resume check."""

from __future__ import annotations

import math

import pytest
import torch

from hvdcompress.training.schedule import (
    LRSchedule,
    default_milestones,
    parse_milestones,
)


@pytest.mark.parametrize(
    "epochs,expected", [(10, [5.0, 8.0]), (20, [10.0, 16.0]), (2, [1.0]), (1, []), (3, [2.0])]
)
def test_default_milestones_at_half_and_four_fifths(epochs, expected):
    assert default_milestones(epochs) == expected


def test_step_schedule_drops_by_gamma_at_each_milestone():
    s = LRSchedule("step", 0.05, steps_per_epoch=10, epochs=10, milestones=(5, 8))
    assert s.milestone_steps == [50, 80]
    rates = [s.lr_at(step) for step in range(100)]
    assert rates[:50] == [0.05] * 50
    assert all(r == pytest.approx(0.005, rel=1e-12) for r in rates[50:80])
    assert all(r == pytest.approx(0.0005, rel=1e-12) for r in rates[80:])
    assert rates[49] > rates[50] == rates[79] > rates[80]


def test_fractional_milestone_rounds_to_a_step():
    s = LRSchedule("step", 1.0, steps_per_epoch=8, epochs=1, milestones=(0.5,), gamma=0.5)
    assert [s.lr_at(i) for i in range(8)] == [1.0] * 4 + [0.5] * 4


def test_constant_schedule_is_the_base_rate():
    s = LRSchedule("constant", 0.05, steps_per_epoch=7, epochs=3)
    assert {s.lr_at(i) for i in range(21)} == {0.05}


def test_cosine_falls_from_base_to_near_zero_over_the_planned_run():
    s = LRSchedule("cosine", 0.1, steps_per_epoch=10, epochs=4)
    rates = [s.lr_at(i) for i in range(40)]
    assert rates[0] == 0.1
    assert rates[20] == pytest.approx(0.05)  # half way: half the rate
    assert all(a > b for a, b in zip(rates, rates[1:], strict=False))
    assert 0 < rates[-1] < 0.001
    assert s.lr_at(1000) == pytest.approx(0.0, abs=1e-18)  # --steps beyond the plan: 0


def test_warmup_rises_linearly_to_the_scheduled_rate():
    s = LRSchedule("step", 0.08, steps_per_epoch=4, epochs=10, milestones=(5,), warmup_epochs=1)
    assert s.warmup_steps == 4
    assert [s.lr_at(i) for i in range(5)] == pytest.approx([0.02, 0.04, 0.06, 0.08, 0.08])
    cos = LRSchedule("cosine", 1.0, steps_per_epoch=10, epochs=3, warmup_epochs=1)
    assert cos.lr_at(9) == 1.0 and cos.lr_at(10) == 1.0 and cos.lr_at(11) < 1.0


def test_apply_sets_every_param_group():
    p = torch.nn.Parameter(torch.zeros(2))
    q = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([{"params": [p]}, {"params": [q]}], lr=1.0)
    s = LRSchedule("step", 0.5, steps_per_epoch=2, epochs=2, milestones=(1,))
    assert s.apply(opt, 2) == pytest.approx(0.05)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.05, 0.05])


@pytest.mark.parametrize(
    "text,message",
    [
        ("8,5", "increase strictly"),
        ("5,5", "increase strictly"),
        ("x", "comma-separated epochs"),
        ("-1", "finite epochs > 0"),
        ("0", "finite epochs > 0"),
        ("nan", "finite epochs > 0"),
    ],
)
def test_bad_milestones_are_refused(text, message):
    with pytest.raises(ValueError, match=message):
        parse_milestones(text)


def test_milestones_parse_and_empty_is_none():
    assert parse_milestones("5,8") == [5.0, 8.0]
    assert parse_milestones("0.5, 2.25") == [0.5, 2.25]
    assert parse_milestones("") == []


@pytest.mark.parametrize(
    "kw,message",
    [
        ({"kind": "linear"}, "unknown schedule"),
        ({"kind": "cosine", "milestones": (1,)}, "milestones apply to the step schedule"),
        ({"lr": 0.0}, "lr must be finite"),
        ({"lr": math.inf}, "lr must be finite"),
        ({"gamma": 1.5}, r"gamma must be in \(0, 1\]"),
        ({"warmup_epochs": -1.0}, "warmup epochs"),
        ({"steps_per_epoch": 0}, "steps_per_epoch"),
    ],
)
def test_bad_schedules_are_refused(kw, message):
    base = {"kind": "step", "lr": 0.1, "steps_per_epoch": 5, "epochs": 2}
    with pytest.raises(ValueError, match=message):
        LRSchedule(**{**base, **kw})


def test_checkpoint_round_trip_and_mismatch():
    s = LRSchedule("step", 0.05, steps_per_epoch=10, epochs=10, milestones=(5, 8))
    saved = s.state_dict()
    assert saved["milestones"] == [5.0, 8.0] and saved["kind"] == "step"
    s.check_resumable(saved)  # the same schedule: accepted
    other = LRSchedule("step", 0.05, steps_per_epoch=10, epochs=10, milestones=(6, 8))
    with pytest.raises(ValueError, match="trained with the schedule"):
        other.check_resumable(saved)
