"""``exchange="auto"`` tunes under real torch.distributed where the codec costs more than
it saves (3 gloo ranks under torchrun, tests/torchrun/tuning_worker.py; each 3LC encode
slowed by 80 ms, on the unlimited loopback): every rank ends on a dense allreduce (float32
or the 16-bit one, whichever the round timed faster) within its warm-up, logs the same
decisions and ends with bit-identical parameters.
Behind a slow link: tests/test_exchange_tuning_link.py; the tuner alone:
tests/test_exchange_tuning.py."""

from __future__ import annotations

from tests.torchrun.tuning_worker import torchrun


def test_a_codec_that_costs_more_than_it_saves_ends_dense(tmp_path):
    (record, *_) = torchrun(tmp_path, "slow-codec", [], 29631)
    assert record["current"] in (["dense"], ["bf16"]) and record["last"] == record["current"]
    assert len(record["decisions"]) == 1
    assert f"takes {record['current'][0]}" in record["decisions"][0]
    # warm-up 2, then at most 4 options x 2 steps: the rest runs on the decision
    assert record["trials"][:2] == [False, False] and not any(record["trials"][10:])
