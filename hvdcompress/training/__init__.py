"""What the scripts share: Fashion-MNIST (``data``), the models (``models``), the table
of named compression methods (``methods``), learning-rate schedules (``schedule``) and
the simulated world that plays N ranks in one process (``simulate``); and the run of one
rank of scripts/train.py (``loop``), built from what the flags make (``flags``), the
rank's model and averaging (``replica``, with torch's own DDP hooks in ``torch_hooks``),
checkpoints (``checkpoints``), bytes sent (``traffic``), rank 0's files and summary
(``run_log``) and progress output (``progress``).

scripts/train.py, scripts/bench_*.py and their worker processes import these modules from
the installed package (``pip install -e .``); none of them imports another script. The
distributed side (rank, size, local size, broadcast of parameters, a sum of a few
floats, barrier) is the transport's: ``hvdcompress.transports.make_transport``.
"""
