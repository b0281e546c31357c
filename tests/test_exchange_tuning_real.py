"""``exchange="auto"`` tunes under real torch.distributed where the codec costs more than
it saves (3 gloo ranks under torchrun, tests/torchrun/tuning_worker.py; each 3LC encode
slowed by 80 ms, on the unlimited loopback): every rank ends on a dense allreduce (float32
or the 16-bit one, whichever the round timed faster) within its warm-up, logs the same
decisions and ends with bit-identical parameters.
The 16-bit option held in force on the same ranks: its bytes, rank identity and a
resume. Behind a slow link: tests/test_exchange_tuning_link.py; the tuner alone:
tests/test_exchange_tuning.py."""

from __future__ import annotations

import pytest

from tests.torchrun.tuning_worker import torchrun


def test_a_codec_that_costs_more_than_it_saves_ends_dense(tmp_path):
    (record, *_) = torchrun(tmp_path, "slow-codec", [], 29631)
    assert record["current"] in (["dense"], ["bf16"]) and record["last"] == record["current"]
    assert len(record["decisions"]) == 1
    assert f"takes {record['current'][0]}" in record["decisions"][0]
    # warm-up 2, then at most 4 options x 2 steps: the rest runs on the decision
    assert record["trials"][:2] == [False, False] and not any(record["trials"][10:])


@pytest.mark.parametrize("half", ["bf16", "fp16"])
def test_the_16_bit_option_in_force_is_counted_and_resumes_exactly(tmp_path, half):
    """Every part of the hook held on the 16-bit allreduce but at a job's first step (as a
    round that timed it fastest leaves it): the same on every rank (``torchrun`` compares
    the records), two bytes a value, and a checkpoint taken with it in force resumes to
    the parameters of the uninterrupted run (the same routes), bit for bit."""
    port = {"bf16": 29633, "fp16": 29635}[half]
    (record, *_) = torchrun(tmp_path, f"{half}-held", [], port)
    whole, after = record["whole"], record["after"]
    assert half not in whole[0]["labels"] and half not in whole[4]["labels"]  # first guesses
    assert half not in after[0]["labels"]  # the resumed job's first step
    for step in [*whole[1:4], *whole[5:], *after[1:]]:
        assert step["labels"] == [half] and step["payload"] == 2 * record["numel"]
        assert step["sent"] >= step["payload"]
    assert record["resumed_digest"] == record["digest"]
