"""One rank of tests/test_horovod_split_gloo.py, under ``horovodrun --gloo``: the checks of
tests/mpi/test_horovod_split.py (Horovod's transport split into process sets and the
hierarchical exchange over them), each test function run in turn; every rank prints one
line ``HVDC_SPLIT {"rank": r, "results": {test: "ok" or the error}}``."""

from __future__ import annotations

import inspect
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
if os.environ.get("HVDC_SPLIT_NO_DYNAMIC") != "1":
    os.environ["HOROVOD_DYNAMIC_PROCESS_SETS"] = "1"

import horovod.torch as hvd  # noqa: E402
import pytest  # noqa: E402

from tests.mpi import test_horovod_split as checks  # noqa: E402

TESTS = (
    "test_split_runs_each_collective_on_its_process_set",
    "test_the_hierarchical_exchange_is_bit_identical_on_every_rank",
    "test_a_lossless_codec_matches_the_flat_exchange",
    "test_without_dynamic_process_sets_every_rank_is_told_how_to_enable_them",
)


def main() -> None:
    if os.environ.get("HVDC_SPLIT_NO_DYNAMIC") == "1":  # Horovod started without them
        os.environ.pop("HOROVOD_DYNAMIC_PROCESS_SETS", None)
        hvd.init()
        from hvdcompress.transports import make_transport

        t = make_transport("horovod")
        try:
            t.split(checks.layout(t.size)[1])
            got = "no error"
        except RuntimeError as err:
            got = f"RuntimeError: {err}"
        t.barrier()
        print("HVDC_SPLIT " + json.dumps({"rank": t.rank, "results": {"no_dynamic": got}}))
        return
    hvd.init()
    results = {}
    for name in TESTS:
        mp = pytest.MonkeyPatch()
        try:
            test = getattr(checks, name)
            given = {"hvd": hvd, "monkeypatch": mp}  # the fixtures it takes
            test(**{k: given[k] for k in inspect.signature(test).parameters})
            results[name] = "ok"
        except Exception as err:  # noqa: BLE001 - reported by the test
            results[name] = f"{type(err).__name__}: {err}"[:1000]
        finally:
            mp.undo()
    print("HVDC_SPLIT " + json.dumps({"rank": hvd.rank(), "results": results}), flush=True)
    hvd.barrier()


if __name__ == "__main__":
    main()
