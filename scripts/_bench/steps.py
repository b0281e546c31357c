"""The training steps the step benchmarks time (bench_network, bench_policy,
bench_compressors, bench_fusion): a DistributedOptimizer over SGD, and one step of
forward, cross-entropy, backward and update."""

from __future__ import annotations

import time


def distributed_sgd(model, compression, backend, lr: float = 0.01, momentum: float = 0.0,
                    **options):  # fmt: skip
    """``hvdcompress.DistributedOptimizer`` over ``torch.optim.SGD`` of ``model``;
    ``options``: the optimizer's other keywords (policy, exchange, fusion_threshold...)."""
    import torch

    import hvdcompress

    return hvdcompress.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum),
        model.named_parameters(),
        compression=compression,
        backend=backend,
        **options,
    )


def train_step(model, opt, x, y) -> float:
    """One training step on the batch (x, y); its seconds."""
    import torch

    t0 = time.perf_counter()
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    return time.perf_counter() - t0
