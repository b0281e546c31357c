"""``op=hvd.Adasum``: Horovod's own Adasum optimizer, for a compression Horovod has."""

from __future__ import annotations


def _adasum_optimizer(
    optimizer, named_parameters, compressor, backward_passes_per_step, op,
    gradient_predivide_factor, groups, sparse_as_dense, process_set, *, backend, policy,
):  # fmt: skip
    if not compressor.summable:
        raise ValueError(
            f"op=Adasum cannot be combined with {compressor!r}: Adasum merges the ranks' "
            "gradients pairwise, scaling each pair by their dot product and norms, inside "
            "Horovod's allreduce of the full vectors; a gather-only codec's payloads are not "
            "vectors that can be merged that way (every rank decodes and sums them), so there "
            "is no Adasum step to apply. Use op=Average or op=Sum with this compression, or "
            "Adasum with compression 'none' or 'fp16'."
        )
    if compressor.name not in ("none", "fp16") or policy is not None:
        raise ValueError(
            "op=Adasum runs Horovod's own Adasum optimizer, which has compression none and "
            f"fp16 only and no policy; got {compressor!r}"
            + (f" and policy {policy!r}" if policy is not None else "")
        )
    if backend != "horovod":
        raise ValueError(
            f"op=Adasum needs backend='horovod' (Horovod's allreduce), got {backend!r}"
        )
    import horovod.torch as hvd

    compression = {"none": hvd.Compression.none, "fp16": hvd.Compression.fp16}[compressor.name]
    return hvd.DistributedOptimizer(
        optimizer,
        named_parameters=named_parameters,
        compression=compression,
        backward_passes_per_step=backward_passes_per_step,
        op=hvd.Adasum,
        gradient_predivide_factor=gradient_predivide_factor,
        groups=groups,
        sparse_as_dense=sparse_as_dense,
        process_set=process_set if process_set is not None else hvd.global_process_set,
    )
