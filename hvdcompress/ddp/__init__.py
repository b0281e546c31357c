"""The DDP communication hook: hvdcompress's compressors for ``torch.nn.parallel.
DistributedDataParallel`` users without Horovod (docs/horovod-parity.md, "Horovod parity
and the DDP hook", for the exchanges, the uncompressed buckets and the overlap; the late
binding: docs/integrations.md, "The hook state binds late").

    state = hvdcompress.DDPHookState("3lc")   # before or after init_process_group
    state.register(ddp_model)                  # = ddp_model.register_comm_hook(state, ddp_hook)

DDP calls the hook (``hook.py``) with each gradient bucket; the hook splits it into the
part to compress and the part to send as is, and hands them to the same ``Reducer`` as
``hvdcompress.DistributedOptimizer`` (``hvdcompress.reducer``: the exchange of each part,
two-stage shards planned per tensor, the tuner, the stats, the checkpoint), over
``transports.torch_dist``; the exchanges average the bucket's buffer in place. The state
(``state.py``) is the configuration, the binding to DDP's group and the checkpoint. With
``overlap=True`` on gloo over the world group, the hook's collectives run on a threaded
transport and a finisher thread completes each bucket's future, so backward goes on while
the bytes move; otherwise each bucket finishes inside the hook.

Invariants: every transport's collectives are started from one thread, in bucket order,
the same on every rank (the hook starts every part's collectives before it returns; the
finisher starts only ``finish``'s, on its own transport); each hook call returns one
future, completed with the buffer or the error; on the gather paths every rank holds
bit-identical averaged gradients; a payload error fails every rank's backward with the
``PayloadError``'s text; the state (``state_dict``: this rank's residuals) is
checkpointable like the optimizer's, with the same rule for another rank's state (both in
``hvdcompress.reducer``). The first optimizer step over the state's parameters warns when
DDP never called the hook (Lightning's ``DDPStrategy`` registers comm hooks on CUDA only).
"""

import torch.distributed

if torch.distributed.is_available() and not torch.distributed.is_initialized():
    # Before the user's world exists (docs/checkpoints-and-faults.md, "Clean exits"): the
    # functions of torch.distributed.nn.functional take ``group=group.WORLD`` as a default
    # argument, evaluated at their first import, which DDP makes when its first model is
    # built. Imported after init_process_group, ten defaults keep the world's gloo group
    # and its threads alive past destroy_process_group, to be torn down at interpreter
    # shutdown, where the README's recipe aborted now and then.
    import torch.distributed.nn.functional  # noqa: F401

from hvdcompress.ddp.hook import ddp_hook
from hvdcompress.ddp.state import NEVER_CALLED, DDPHookState

__all__ = ["NEVER_CALLED", "DDPHookState", "ddp_hook"]
