"""The two compressor interfaces: gather-only (byte payloads) and summable (dense payloads).

A compressor is a codec (pure tensor math, ``hvdcompress.codecs``) plus per-tensor state
(error-feedback residuals, RNG step counters, PowerSGD's Q), kept in objects it makes in
``__init__`` (``memory.ErrorFeedback``, ``levels.TensorLevels``). Its registry entry is a
``CompressorSpec`` passed to ``@register`` (``hvdcompress.compressors.registry``); the
class overrides only what it needs of the defaults declared here: ``bind`` and
``check_optimizer`` once, ``compress`` per tensor and step, ``pop_metrics`` per step,
``state_dict`` in checkpoints.

* ``GatherCompressor``: ``compress`` encodes a tensor into a self-describing uint8
  payload (``hvdcompress.wire``); the payloads of all ranks are gathered and every rank
  decodes every payload in rank order, accumulating into float32. The frames, their scan
  and every check a payload goes through are ``hvdcompress.framing``'s, which calls the
  compressor for what only it knows: ``encode_bucket`` (or ``encode``), the bounds its
  payloads obey (``check_params``, ``max_numel``), ``decode_into`` (and the batched
  ``decode_segments``). Invariant: a payload either decodes to a tensor of exactly the
  header's (and, when given, the receiver's expected) shape and dtype, or raises
  ``PayloadError`` naming the field; the output is untouched then.
* ``SummableCompressor``: ``compress`` gives a dense tensor that an allreduce may sum;
  ``phases`` > 1 (PowerSGD: P, then Q) makes the next phase's dense tensor from the
  summed one (``next_phase``); ``decompress`` turns the last sum into the gradient sum.
"""

from __future__ import annotations

import math
from typing import ClassVar, NamedTuple

import torch

from hvdcompress import framing, wire
from hvdcompress.compressors.memory import ErrorFeedback
from hvdcompress.compressors.spec import CompressorSpec
from hvdcompress.errors import PayloadError
from hvdcompress.framing import Ctx


def empty_body(device) -> torch.Tensor:
    """The body of a non-finite payload (the flag says it all)."""
    return torch.empty(0, dtype=torch.uint8, device=device)


def check_scale(header, scale: float) -> None:
    """A payload's scale parameter: 0 when the input was non-finite, else finite >= 0."""
    if header.nonfinite:
        if scale != 0.0:
            raise PayloadError("scale", f"a non-finite payload has scale 0, got {scale}")
    elif not (math.isfinite(scale) and scale >= 0.0):
        raise PayloadError("scale", f"expected a finite scale >= 0, got {scale}")


def check_params_len(comp: Compressor, header: wire.Header, size: int) -> None:
    """PayloadError "params_len" unless a header carries ``size`` bytes of parameters."""
    if len(header.params) != size:
        raise PayloadError(
            "params_len", f"{comp.name} has {size} bytes of parameters, got {len(header.params)}"
        )


def check_agreed(field: str, expected, got) -> None:
    """PayloadError ``field`` unless a header's codec parameter(s) are this rank's own."""
    if got != expected:
        raise PayloadError(
            field, f"expected {expected}, got {got} (ranks disagree on the compressor)"
        )


class Encoded(NamedTuple):
    """What ``GatherCompressor.encode`` returns: header flags, packed codec parameters and
    the body bytes on the tensor's device."""

    flags: int
    params: bytes
    body: torch.Tensor


class Compressor:
    """What both kinds share: binding, metrics and state."""

    # the registry entry and its name, set by ``@register`` (hvdcompress.compressors.spec)
    spec: ClassVar[CompressorSpec]
    name: ClassVar[str] = ""

    summable: ClassVar[bool] = False
    error_feedback: bool = False  # an instance attribute where it is a parameter
    # the error-feedback residuals, an ErrorFeedback made in __init__ by a compressor that
    # keeps them (with error feedback, or where it is a parameter)
    memory: ErrorFeedback | None = None
    # the gradient dtypes this compressor sends (None: every floating dtype); the
    # optimizer checks its parameters against it at construction
    supported_dtypes: ClassVar[tuple[torch.dtype, ...] | None] = None
    # True where what it sends is only right under the wrapped optimizer that
    # ``check_optimizer`` demands (block3lc's ef21: SGD adding up the differences): the
    # DDP hook, which never sees the optimizer, refuses such a compressor
    needs_wrapped_optimizer: bool = False

    def __repr__(self) -> str:
        """The class and its constructor parameters (``params``) but the rank ``bind`` sets."""
        args = ", ".join(f"{p}={getattr(self, p)}" for p in self.spec.params if p != "rank")
        return f"{type(self).__name__}({args})"

    # ---- life cycle in the optimizer (defaults: nothing to do) ---------------------------
    def bind(self, rank: int, size: int) -> None:
        """Told by the optimizer which rank this is, out of how many. Compressors that
        draw random numbers key them by rank; the others ignore it."""

    def check_optimizer(self, optimizer) -> None:
        """Refuse a wrapped optimizer this compressor cannot work with (DGC: momentum,
        ``refuse_inner_momentum``)."""

    def pop_metrics(self) -> dict:
        """Per-step measurements (NDQSG's aliasing rates), reset by the call."""
        return {}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        """No state: anything but an empty dict is a CheckpointError, as the stateful
        compressors' checks raise."""
        from hvdcompress.checkpoint import check_keys

        check_keys(f"{self.name} state (it keeps none)", state)

    def check_dtype(self, name: str, dtype: torch.dtype) -> None:
        """TypeError unless this compressor can send tensor ``name`` of ``dtype``."""
        ok = self.supported_dtypes
        if not dtype.is_floating_point or (ok is not None and dtype not in ok):
            names = ", ".join(str(d).replace("torch.", "") for d in ok) if ok else "float*"
            raise TypeError(
                f"{self.name}: tensor {name!r} has dtype {str(dtype).replace('torch.', '')}; "
                f"supported: {names}"
            )

    # ---- error feedback (docs/error-feedback.md) -----------------------------------------
    def contraction(self, numel: int) -> float | None:
        """With error feedback: a lower bound delta in (0, 1] on the contraction of what
        the residual sees, E||a - decode(encode(a))||^2 <= (1 - delta) ||a||^2 for a tensor
        of ``numel`` elements (Stich et al. 2018; Karimireddy et al. 2019). None: none
        declared (or no error feedback)."""
        return None

    def residual_bound(self, numel: int) -> float | None:
        """K with ||e_t|| <= K max_s ||g_s|| for every step t (in expectation for random
        compressors): 2 sqrt(1 - delta) / delta for a delta-contraction (the residual's
        fixed point under ||e'|| <= sqrt(1 - delta) (||e|| + G))."""
        delta = self.contraction(numel)
        if delta is None:
            return None
        return 2.0 * math.sqrt(max(0.0, 1.0 - delta)) / delta

    def absorb(self, name: str, delta: torch.Tensor) -> bool:
        """Add ``delta`` (what this rank's share of the applied gradient of ``name`` missed,
        e.g. the rounding of the write into a float16 ``p.grad``) to the error-feedback
        residual of ``name``, so that it is sent with the next gradient. False when there
        is no such residual (no error feedback, or nothing compressed yet)."""
        if not self.error_feedback or self.memory is None:
            return False
        return self.memory.absorb(name, delta)

    # ---- both kinds ----------------------------------------------------------------------
    def compress(self, tensor: torch.Tensor, name: str) -> tuple[torch.Tensor, Ctx]:
        raise NotImplementedError

    def decompress(self, payload: torch.Tensor, ctx: Ctx) -> torch.Tensor:
        """The tensor of ``ctx`` from a payload: a gather payload decoded and checked
        against ``ctx`` (``decode``); a summable compressor's from the last phase's sum."""
        return self.decode(payload, expect=ctx)

    def decode(self, payload: torch.Tensor, **kwargs) -> torch.Tensor:
        raise NotImplementedError

    def bits_per_value(self, payload: torch.Tensor) -> float:
        """Bits on the wire per tensor element: a self-describing payload's, header
        included (``wire.bits_per_value``); a summable one's dense element size."""
        return wire.bits_per_value(payload)


class SummableCompressor(Compressor):
    """Dense payloads summed by allreduces, ``phases`` of them per step (see module doc)."""

    summable: ClassVar[bool] = True
    phases: ClassVar[int] = 1

    def next_phase(self, summed: torch.Tensor, ctx: Ctx, phase: int) -> torch.Tensor:
        """Phase ``phase``'s dense payload from the sum of the previous phase's."""
        raise NotImplementedError(f"{self.name} has {self.phases} phase(s)")

    def decompress_exact(self, payload: torch.Tensor, ctx: Ctx) -> torch.Tensor:
        """``decompress`` without its final cast into a lower-precision gradient dtype
        (the optimizer path: it averages, casts once and feeds the rounding back)."""
        return self.decompress(payload, ctx)

    def decompress_into(
        self, payload: torch.Tensor, ctx: Ctx, out: torch.Tensor, scale: float
    ) -> bool:
        """Write ``scale`` times ``decompress_exact(payload, ctx)`` into the gradient ``out``
        (the exchange's averaged write) without a temporary of the gradient's size, where
        this compressor can: True when written, False (nothing read, nothing changed) where
        it cannot, and the exchange then decompresses and writes. None can by default."""
        return False

    def decode(self, payload, **kwargs):
        raise TypeError(f"{self.name} payloads are summed by an allreduce, not decoded alone")

    def bits_per_value(self, payload: torch.Tensor) -> float:
        return float(payload.element_size() * 8)


class GatherCompressor(Compressor):
    """Self-describing byte payloads, gathered and decoded by every rank (module doc): the
    algorithm (encode a bucket's tensors, decode one payload's body or a frame's accepted
    bodies into an accumulator), the bounds its payloads obey, and its state. Framing,
    scanning and the checks every payload goes through are ``hvdcompress.framing``'."""

    summable: ClassVar[bool] = False
    uses_side_info: ClassVar[bool] = False  # decode_into gets side_info (NDQSG)
    # decode_segments also adds into outputs on a CUDA device (one launch sequence a
    # frame): framing.decode_frame's fast path then takes GPU outputs, else only CPU ones.
    cuda_decode_segments: ClassVar[bool] = False
    supported_dtypes: ClassVar[tuple[torch.dtype, ...] | None] = tuple(wire.DTYPE_IDS)
    # The two-stage exchange (hvdcompress.exchange.TwoStageExchange) has the owner of a
    # shard re-compress the average of the decoded shards with this compressor: False
    # where ``compress`` is more than encoding its input (with error feedback), e.g.
    # DGC's momentum correction, or where decoding needs other ranks' payloads (NDQSG).
    recompressible: ClassVar[bool] = True

    def shard_alignment(self) -> int:
        """Shard boundaries inside a tensor fall on multiples of this many elements (of
        the tensor), the codec's group (3LC: 5 values per quartic byte; DQSG: a bucket),
        so that cutting a tensor into shards adds no partial groups."""
        return 1

    # ---- send ------------------------------------------------------------------------------
    def encode(self, tensor: torch.Tensor, name) -> Encoded:
        """(flags, packed codec parameters, body bytes on the tensor's device). By default
        ``encode_bucket`` of a bucket of one: a compressor with a one-call bucket encoder
        implements only that (one implementation per codec), the others only this."""
        return self.encode_bucket([tensor], [name])[0]

    def encode_bucket(self, tensors: list[torch.Tensor], names: list) -> list[Encoded]:
        """``encode`` of each tensor in order (``framing.compress_bucket`` frames them). A
        compressor whose codec has a batched native encoder overrides this (and not
        ``encode``): one native call for the bucket, each tensor keeping its own scale and
        parameters; tensors on several devices come back here, one by one."""
        return [self.encode(t, name) for t, name in zip(tensors, names, strict=True)]

    def compress(self, tensor: torch.Tensor, name) -> tuple[torch.Tensor, Ctx]:
        self.check_dtype(name, tensor.dtype)
        ctx = Ctx(name, tuple(tensor.shape), tensor.dtype, tensor.device)
        flags, params, body = self.encode(tensor, name)
        header = wire.Header(self.name, flags, tensor.dtype, ctx.shape, params, body.numel())
        return wire.assemble(header, body), ctx

    # ---- the bounds a payload obeys ----------------------------------------------------------
    def check_params(self, header: wire.Header, name) -> None:
        """Validate a received header's codec parameters against what this rank expects
        for tensor ``name`` (None: not known); raise PayloadError."""
        raise NotImplementedError

    def max_numel(self, body_len: int, name) -> int:
        """The most elements a body of this many bytes can describe (guards allocation)."""
        raise NotImplementedError

    def accepts_bucket(self, names, flags, params, body_lens, numels) -> bool:
        """``check_params`` and ``max_numel`` of every payload of a scanned frame
        (``framing.accepts_each``); a compressor may do it with array arithmetic."""
        return framing.accepts_each(self, names, flags, params, body_lens, numels)

    def decoded_bound(self, header: wire.Header, body: torch.Tensor) -> float | None:
        """A float32 B >= |v| for every value v a decode of this (checked) body into a new
        tensor writes, from the parameters or a sparse body's values (None: unknown):
        ``framing.checked_cast`` skips its read of the tensor where B fits the dtype."""
        return None

    # ---- receive -----------------------------------------------------------------------------
    def decode_into(
        self,
        header: wire.Header,
        body: torch.Tensor,
        out: torch.Tensor,
        accumulate: bool,
        side_info: torch.Tensor | None,
    ) -> None:
        """Write (or add) the decoded float32 values into flat ``out``."""
        raise NotImplementedError

    def decode_new(self, header: wire.Header, body: torch.Tensor, side_info) -> torch.Tensor:
        """The checked body decoded into a new flat float32 tensor on the body's device;
        a codec whose written decode is, bit for bit, its add into a tensor of one value
        overrides this with ``framing.decode_filled`` of that value (no copy)."""
        return framing.decode_filled(self, header, body, side_info, None)

    def decode_segments(self, frame, params, starts, lens, numels, outs, names, rank=None):
        """Add the accepted bodies ``frame[starts[i]:][:lens[i]]`` decoded into
        ``outs[i]``: None, or (i, the PayloadError) of the first that does not decode.
        ``decode_into`` of each by default (``framing.decode_each``); a codec with a batched
        native decoder overrides it with one call (docs/backends.md, "One call per
        bucket")."""
        return framing.decode_each(self, frame, params, starts, lens, numels, outs, rank)

    def decode(
        self,
        payload: torch.Tensor,
        *,
        expect: Ctx | None = None,
        rank: int | None = None,
        name=None,
        out: torch.Tensor | None = None,
        accumulate: bool = False,
        side_info: torch.Tensor | None = None,
        max_numel: int | None = None,
    ) -> torch.Tensor:
        """Decode any rank's payload into a new tensor of the header's shape and dtype.

        With ``out`` (contiguous float32 of numel elements) the values are written into
        it, or with ``accumulate`` added to it in float32, and ``out`` is returned: this
        is how the gather path sums the payloads of all ranks in rank order. ``side_info``
        only for compressors that decode with it (NDQSG). Raises PayloadError naming the
        field, and ``rank`` / ``name`` when given; ``out`` is untouched when it raises.

        What a payload may make this call allocate is bounded by the receiver, never by
        the payload: a header claiming more elements than ``expect``'s shape, ``out``'s
        size, or (with neither) ``max_numel`` (default ``wire.DEFAULT_MAX_DECODE_NUMEL``,
        2**24, or ``$HVDCOMPRESS_MAX_DECODE_NUMEL``) holds is a PayloadError (field
        "numel") before anything is allocated. A decode into a new tensor whose values
        are not finite although the payload's non-finite flag is clear (a float32 value
        past float16's 65504, say) raises ``DecodeOverflowError`` (a PayloadError and an
        OverflowError, field "overflow") instead of returning infinities.
        """
        tensor_name = name if name is not None else (expect.name if expect else None)
        try:
            header = wire.parse(payload)
        except PayloadError as err:
            raise err.locate(rank=rank, tensor=tensor_name) from None
        return framing.decode_parsed(
            self,
            header,
            payload,
            expect=expect,
            name=tensor_name,
            rank=rank,
            out=out,
            accumulate=accumulate,
            side_info=side_info,
            max_numel=max_numel,
        )


def refuse_inner_momentum(compressor, optimizer, hint: str = "") -> None:
    """``check_optimizer`` of a compressor with momentum correction (Lin et al., ICLR 2018:
    it applies ``compressor.momentum`` itself): ValueError when the wrapped optimizer
    applies momentum too; ``hint``: what else the user may do."""
    if compressor.momentum == 0.0:
        return
    for group in optimizer.param_groups:
        if float(group.get("momentum", 0.0) or 0.0) > 0.0:
            raise ValueError(
                f"{compressor.name} applies momentum {compressor.momentum} itself (momentum "
                f"correction): the wrapped optimizer must use momentum=0, it has "
                f"{group['momentum']}{hint}"
            )
