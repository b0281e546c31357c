"""Keyed collectives (hvdcompress.transports.slots): one round per call in the steady
state, the same bytes as the path before keys, a second round for a payload that
outgrew its slot, forged slot headers refused on every rank.

Three gloo ranks (an odd world) run tests/torchrun/slots_worker.py and report in JSON;
the capacity rule and the key's plumbing through the transport base class are checked
in this process. The MPI side: tests/mpi/test_slots.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hvdcompress.transports import slots
from hvdcompress.transports.simulated import SimulatedWorld
from tests.helpers import LocalTransport

WORKER = Path(__file__).parent / "torchrun" / "slots_worker.py"
ROOT = Path(__file__).parent.parent
SIZE = 3


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    out = tmp_path_factory.mktemp("slots")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(out), str(r), str(SIZE)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )  # fmt: skip
        for r in range(SIZE)
    ]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=300)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(SIZE)]


@pytest.mark.parametrize("case", ["allgatherv", "allgatherv_threaded", "alltoallv"])
def test_every_call_gives_the_bytes_of_the_path_before_keys(reports, case):
    """Varying lengths across ranks and calls (empty ones too), inline and threaded."""
    for r in reports:
        assert all(r[case]["same"]), r[case]["same"]


@pytest.mark.parametrize("case", ["allgatherv", "allgatherv_threaded", "alltoallv"])
def test_steady_calls_take_one_round_and_an_outgrown_payload_two(reports, case):
    got = reports[0][case]
    assert got["rounds"] == got["want_rounds"]
    assert got["rounds"][:5] == [2, 1, 1, 1, 2]  # first call; steady; 400 bytes outgrow 192
    assert got["rounds"][5] == 1  # the capacity grew with it
    assert all(r[case]["rounds"] == got["rounds"] for r in reports)


def test_the_capacity_grows_then_shrinks_and_bytes_are_counted_as_sent(reports):
    got = reports[0]["allgatherv"]
    caps = got["caps"]
    assert caps[0] == 144 and caps[4] == 520  # 5/4 of 114, of 414, rounded up to 8
    assert caps[-1] == 88  # the last 8 calls, of at most 66 bytes: 5/4 of 66, rounded up
    # a one-round call sends its slot (header + capacity) to each of the other ranks;
    # gloo's all_gather takes equal sizes: every slot is padded to the largest
    assert got["sent"][1] == (SIZE - 1) * (slots.HEADER + caps[0])
    # the first call: headers, then every payload padded to the largest (gloo)
    assert got["sent"][0] == (SIZE - 1) * (slots.HEADER + 114)
    # every call waited for counts its rounds: 18 keyed, 18 without a key (one all-empty)
    assert got["traffic_rounds"] == sum(got["rounds"]) + 2 * len(got["rounds"]) - 1


@pytest.mark.parametrize("exchange,per_bucket", [("allgather", 1), ("twostage", 2)])
def test_a_bucket_costs_one_round_per_stage_after_the_first_step(reports, exchange, per_bucket):
    """DistributedOptimizer steps (3LC, 4 buckets): the first step is two rounds per
    stage (no capacity yet), the steady state one (a frame that outgrows its slot early
    on costs one more); keys change no bit of the result (the run with capacities always
    0, the two rounds of before, ends with the same parameters on every rank)."""
    for r in reports:
        run, plain = r[exchange], r[f"{exchange}_unkeyed"]
        assert run["kinds"] == [exchange] and run["buckets"] == 4
        assert run["collectives"] == [per_bucket * 4] * 5
        assert run["rounds"][0] == 2 * run["collectives"][0]
        assert run["rounds"][2:] == run["collectives"][2:]
        assert plain["rounds"] == [2 * c for c in plain["collectives"]]
        assert run["digest"] == plain["digest"] == reports[0][exchange]["digest"]


def test_a_forged_slot_header_raises_a_payload_error_on_every_rank(reports):
    """Rank 1's headers announce 2**61 bytes (an allocation of that would fail), or more
    than their slot without the overflow bit: every rank raises PayloadError naming rank
    1, nobody hangs, and the next call works."""
    for r in reports:
        forged = r["forged"]
        assert forged["huge"][:2] == ["length", 1] and "more than the most" in forged["huge"][2]
        assert forged["no_overflow_bit"][:2] == ["length", 1]
        assert "without overflow" in forged["no_overflow_bit"][2]
        assert forged["alltoallv"][:2] == ["length", 1]
        assert forged["after"] is True


def test_a_forged_stage1_header_fails_the_twostage_step_on_every_rank(reports):
    """Stage 1 is an alltoallv: its receivers report the forged header in stage 2."""
    for r in reports:
        field, rank, text = r["twostage_forged"]["error"]
        assert (field, rank) == ("length", 1) and "stage 1" in text


# ---- in this process ------------------------------------------------------------------------


def test_capacity_rule():
    recent = slots._Recent()
    assert recent.capacity == 0
    recent.lengths.append(100)
    assert recent.capacity == 128  # 125 rounded up to 8
    recent.lengths.append(0)
    assert recent.capacity == 128  # the largest of the window
    recent.lengths.extend([9] * slots.WINDOW)
    assert recent.capacity == 16  # 5/4 of 9, rounded up
    recent.lengths.append(1 << 40)
    assert recent.capacity == slots.MAX_CAPACITY


def test_headers_are_checked_before_use():
    assert slots._check(100 << 1, 128, 0, False) is None
    assert "negative" in slots._check(-2, 128, 0, None)
    assert "more than the most" in slots._check((slots.MAX_LENGTH + 1) << 1 | 1, 0, 0, None)
    assert "without overflow" in slots._check(200 << 1, 128, 0, None)
    assert "overflow bit" in slots._check(100 << 1 | 1, 128, 0, False)
    assert slots._extra(200 << 1 | 1, 128) == 72 and slots._extra(-1, 128) == 0


def test_a_key_reaches_transports_that_take_one_and_not_the_others():
    """A transport written before keys (``start_allgatherv(self, local)``) is called
    without one; the simulated one takes it; both count one round per collective."""
    local = LocalTransport()
    h = local.start_allgatherv(torch.arange(5, dtype=torch.uint8), key=(0, "allgather"))
    h.wait()
    assert h.rounds == 1 and local.traffic.rounds == 1
    world = SimulatedWorld(2)
    ts = [world.transport(r) for r in range(2)]
    hs = [t.start_allgatherv(torch.full((r + 1,), r, dtype=torch.uint8), key="k")
          for r, t in enumerate(ts)]  # fmt: skip
    assert [h.wait()[1] for h in hs] == [[1, 2], [1, 2]]
    assert ts[0].traffic.rounds == 1
