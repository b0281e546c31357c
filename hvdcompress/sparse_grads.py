"""Sparse gradients (``nn.Embedding(sparse=True)``): exchanged uncompressed, as Horovod's
``sparse_allreduce_async`` exchanges them.

Each rank sends its COO indices and values as one frame (an 8-byte count of entries, the
int64 indices, the values); one allgatherv moves every rank's frame; every rank
concatenates the entries in rank order into one uncoalesced sparse tensor, divides the
values by the number of ranks for an average (Horovod divides; ``gradient_predivide_factor``
does not apply to sparse gradients there either), and writes it into ``p.grad`` as
Horovod does (``zero_().add_()``). Invariant: every rank builds the same tensor from the
same bytes in the same order.
"""

from __future__ import annotations

import struct

import torch

from hvdcompress.transports import Handle, Transport

_COUNT = struct.Struct("<q")


def start_sparse(transport: Transport, grad: torch.Tensor) -> tuple[Handle, int]:
    """Start the allgatherv of the sparse gradient ``grad``'s indices and values; returns
    its handle and the bytes this rank sends."""
    indices = grad._indices().to(torch.int64).contiguous().cpu()
    values = grad._values().contiguous().cpu()
    count = torch.frombuffer(bytearray(_COUNT.pack(values.shape[0])), dtype=torch.uint8)
    frame = torch.cat(
        [count, indices.reshape(-1).view(torch.uint8), values.reshape(-1).view(torch.uint8)]
    )
    return transport.start_allgatherv(frame), int(frame.numel())


def finish_sparse(result, grad: torch.Tensor, divisor: int | None) -> None:
    """Write the gathered entries (values divided by ``divisor`` unless None) into the
    sparse ``grad``."""
    gathered, sizes = result
    sparse_dim = grad.sparse_dim()
    dense_shape = tuple(grad.shape[sparse_dim:])
    width = torch.Size(dense_shape).numel()
    itemsize = grad.element_size()
    all_indices, all_values, offset = [], [], 0
    for rank, size in enumerate(sizes):
        frame = gathered[offset : offset + size].clone()  # clone: aligned for the views
        offset += size
        (count,) = _COUNT.unpack(frame[: _COUNT.size].numpy().tobytes())
        index_bytes = count * sparse_dim * 8
        if count < 0 or size != _COUNT.size + index_bytes + count * width * itemsize:
            raise RuntimeError(
                f"sparse gradient from rank {rank}: {size} bytes do not hold {count} entries "
                f"of shape {dense_shape} with {sparse_dim} indices each"
            )
        body = frame[_COUNT.size :]
        all_indices.append(body[:index_bytes].view(torch.int64).reshape(sparse_dim, count))
        all_values.append(body[index_bytes:].view(grad.dtype).reshape(count, *dense_shape))
    values = torch.cat(all_values).to(grad.device)
    if divisor is not None:
        values = values / divisor
    summed = torch.sparse_coo_tensor(  # indices out of range: an error, not a bad write
        torch.cat(all_indices, dim=1).to(grad.device), values, grad.shape, check_invariants=True
    )
    grad.zero_().add_(summed)
