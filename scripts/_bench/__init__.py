"""The benchmarks' shared harness (scripts/bench_*.py, scripts/fuzz_payloads.py).

* ``netns``: a network namespace whose loopback is the benchmark's link, its rate (tc
  tbf), its tx bytes, and its removal whatever happens (signals, stale namespaces);
* ``launch``: the ranks of a benchmark under horovodrun / mpirun, their events, timeouts
  and relaunches;
* ``stats``: repeated timings, the slowest rank, spread over repeats or seeds;
* ``steps``: the optimizer and the timed training step of the step benchmarks;
* ``report``: markdown and fixed-width tables, JSON, figures, the machine's description;
* ``netreport``: bench_network's speedups, tables and figures;
* ``networker``: bench_network's worker mode (a rank's training-step loop), its cases;
* ``peerreport``: bench_peers' tables, targets, bytes check and figure;
* ``launchlog``: bench_peers' launches recorded as resumable pieces, and their table;
* ``payloads``: the payload mutation fuzzer's payloads, mutations and checks (also the
  checks of tests/fuzz).

A script imports it as ``_bench`` (``python scripts/<name>.py``: scripts/ is first on
sys.path) or, loaded by file path from the repository root (the tests), as
``scripts._bench``.
"""
