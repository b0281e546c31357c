"""The two compressor interfaces: gather-only (byte payloads) and summable (dense payloads).

A compressor is a codec (pure tensor math, ``hvdcompress.codecs``) plus per-tensor state
(error-feedback residuals, RNG step counters, PowerSGD's Q). Its registry entry is a
``CompressorSpec`` passed to ``@register`` (``hvdcompress.compressors.registry``); the
class overrides only what it needs of the defaults declared here: ``bind`` and
``check_optimizer`` once, ``compress`` per tensor and step, ``pop_metrics`` per step,
``state_dict`` in checkpoints.

* ``GatherCompressor``: ``compress`` encodes a tensor into a self-describing uint8
  payload (``hvdcompress.wire``); the payloads of all ranks are gathered and every rank
  decodes every payload in rank order (``decode_parsed``, accumulating into float32). A
  subclass implements what the class lists under "to implement". Invariant: a payload
  either decodes to a tensor of exactly the header's (and, when given, the receiver's
  expected) shape and dtype, or raises ``PayloadError`` naming the field; the output is
  untouched then.
* ``SummableCompressor``: ``compress`` gives a dense tensor that an allreduce may sum;
  ``phases`` > 1 (PowerSGD: P, then Q) makes the next phase's dense tensor from the
  summed one (``next_phase``); ``decompress`` turns the last sum into the gradient sum.
"""

from __future__ import annotations

import math
from typing import ClassVar, NamedTuple

import numpy as np
import torch

from hvdcompress import wire
from hvdcompress.compressors import receive
from hvdcompress.compressors.memory import ErrorFeedback
from hvdcompress.compressors.spec import CompressorSpec
from hvdcompress.errors import PayloadError


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


def check_agreed(field: str, expected, got) -> None:
    """PayloadError ``field`` unless a header's codec parameter(s) are this rank's own."""
    if got != expected:
        raise PayloadError(
            field, f"expected {expected}, got {got} (ranks disagree on the compressor)"
        )


class Ctx(NamedTuple):  # a NamedTuple: a bucket makes one per tensor and step
    """What the sender knows about a tensor that the payload must match."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device


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

    def __repr__(self) -> str:
        """The class and its constructor parameters (``params``) but the rank ``bind`` sets."""
        args = ", ".join(f"{p}={getattr(self, p)}" for p in self.spec.params if p != "rank")
        return f"{type(self).__name__}({args})"

    # ---- life cycle in the optimizer (defaults: nothing to do) ---------------------------
    def bind(self, rank: int, size: int) -> None:
        """Told by the optimizer which rank this is, out of how many. Compressors that
        draw random numbers key them by rank; the others ignore it."""

    def check_optimizer(self, optimizer) -> None:
        """Refuse a wrapped optimizer this compressor cannot work with (DGC: momentum)."""

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
        raise NotImplementedError

    def bits_per_value(self, payload: torch.Tensor) -> float:
        raise NotImplementedError


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

    def decode(self, payload, **kwargs):
        raise TypeError(f"{self.name} payloads are summed by an allreduce, not decoded alone")

    def bits_per_value(self, payload: torch.Tensor) -> float:
        return float(payload.element_size() * 8)


class GatherCompressor(Compressor):
    """Self-describing byte payloads, gathered and decoded by every rank (module doc)."""

    summable: ClassVar[bool] = False
    uses_side_info: ClassVar[bool] = False  # decode_into gets side_info (NDQSG)
    # decode_segments also adds into outputs on a CUDA device (one launch sequence a
    # frame): decode_frame's fast path then takes GPU outputs, else only CPU ones.
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

    # ---- to implement ----------------------------------------------------------------------
    def encode(self, tensor: torch.Tensor, name: str) -> Encoded:
        """(flags, packed codec parameters, body bytes on the tensor's device). By default
        ``encode_bucket`` of a bucket of one: a compressor with a one-call bucket encoder
        implements only that (one implementation per codec), the others only this."""
        return self.encode_bucket([tensor], [name])[0]

    def check_params(self, header: wire.Header, name: str | None) -> None:
        """Validate a received header's codec parameters against what this rank expects
        for tensor ``name`` (None: not known); raise PayloadError."""
        raise NotImplementedError

    def _check_params_len(self, header: wire.Header, size: int) -> None:
        if len(header.params) != size:
            raise PayloadError(
                "params_len",
                f"{self.name} has {size} bytes of parameters, got {len(header.params)}",
            )

    def max_numel(self, body_len: int, name: str | None) -> int:
        """The most elements a body of this many bytes can describe (guards allocation)."""
        raise NotImplementedError

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

    def fresh_fill(self, header: wire.Header) -> float | None:
        """v where this payload's written ``decode_into`` is, bit for bit, the added one
        into a tensor filled with v (None: none), so that a new tensor needs no copy."""
        return None

    def decode_new(self, header: wire.Header, body: torch.Tensor, side_info) -> torch.Tensor:
        """The checked body decoded into a new flat float32 tensor on the body's device:
        added into one filled with ``fresh_fill`` where there is one, else written."""
        fill, shape, dev = self.fresh_fill(header), (header.numel,), body.device
        flat = (torch.empty(shape, dtype=torch.float32, device=dev) if fill is None
                else torch.full(shape, fill, dtype=torch.float32, device=dev))  # fmt: skip
        self.decode_into(header, body, flat, fill is not None, side_info)
        return flat

    def decoded_bound(self, header: wire.Header, body: torch.Tensor) -> float | None:
        """A float32 B >= |v| for every value v a decode of this (checked) body into a new
        tensor writes, from the parameters or a sparse body's values (None: unknown):
        ``checked_cast`` skips its read of the tensor where B fits the dtype."""
        return None

    # ---- send ------------------------------------------------------------------------------
    def compress(self, tensor: torch.Tensor, name: str) -> tuple[torch.Tensor, Ctx]:
        self.check_dtype(name, tensor.dtype)
        ctx = Ctx(name, tuple(tensor.shape), tensor.dtype, tensor.device)
        flags, params, body = self.encode(tensor, name)
        header = wire.Header(self.name, flags, tensor.dtype, ctx.shape, params, body.numel())
        return wire.assemble(header, body), ctx

    # ---- whole buckets (one call per bucket) ---------------------------------------------
    def compress_bucket(
        self, tensors: list[torch.Tensor], names: list[str]
    ) -> tuple[torch.Tensor, list[Ctx]]:
        """One rank's frame of a bucket (``wire.frame`` of the payloads ``compress`` gives
        for each tensor in order, byte for byte, the state updated in the same order) and
        the tensors' contexts. The compressor describes each payload (``encode_bucket``:
        flags, params, body); the wire format builds the frame (``wire.frame_bucket``)."""
        if len(tensors) != len(names):
            raise ValueError(f"{len(tensors)} tensors but {len(names)} names")
        ctxs = [
            Ctx(name, tuple(t.shape), t.dtype, t.device)
            for t, name in zip(tensors, names, strict=True)
        ]
        layout = self.frame_layout(ctxs)  # checks the dtypes (once per set of tensors)
        return wire.frame_bucket(layout, self.encode_bucket(tensors, names)), ctxs

    def frame_layout(self, ctxs: list[Ctx]) -> wire.FrameLayout:
        """The ``wire.FrameLayout`` of a bucket of these tensors, made once per set of
        tensors (their dtypes checked then) and kept."""
        key = tuple(ctxs)
        layouts = self.__dict__.setdefault("_frame_layouts", {})
        layout = layouts.get(key)
        if layout is None:
            for ctx in ctxs:
                self.check_dtype(ctx.name, ctx.dtype)
            if len(layouts) >= 256:  # buckets come and go (sparse gradients): stay bounded
                layouts.clear()
            layout = layouts[key] = wire.FrameLayout(
                self.name, [c.shape for c in ctxs], [c.dtype for c in ctxs]
            )
        return layout

    def encode_bucket(self, tensors: list[torch.Tensor], names: list[str]) -> list[Encoded]:
        """``encode`` of each tensor in order. A compressor whose codec has a batched native
        encoder overrides this (and not ``encode``): one native call for the bucket, each
        tensor keeping its own scale and parameters; tensors on several devices come back
        here, one by one."""
        return [self.encode(t, name) for t, name in zip(tensors, names, strict=True)]

    def decode_bucket(
        self,
        parsed: list[tuple[wire.Header, torch.Tensor]],
        outs: list[torch.Tensor],
        ctxs: list[Ctx],
        *,
        rank: int | None = None,
    ) -> None:
        """Add one rank's decoded payloads of a bucket into ``outs`` (contiguous float32, one
        per tensor, holding the sums of the lower ranks' payloads): ``decode_parsed(...,
        accumulate=True)`` of each in order, with the same checks and errors. A compressor
        that decodes with side information (NDQSG) gets the gather path's: the mean of the
        lower ranks' decoded tensors, ``out / rank`` for rank > 0."""
        for (header, payload), out, ctx in zip(parsed, outs, ctxs, strict=True):
            side = out / rank if self.uses_side_info and rank else None
            self.decode_parsed(
                header,
                payload,
                expect=ctx,
                name=ctx.name,
                rank=rank,
                out=out,
                accumulate=True,
                side_info=side,
            )

    def decode_frame(
        self,
        frame: torch.Tensor,
        outs: list[torch.Tensor],
        ctxs: list[Ctx],
        *,
        rank: int | None = None,
    ) -> None:
        """Add one rank's frame of a bucket (``compress_bucket``'s) into ``outs``: exactly
        ``decode_bucket`` of ``wire.unframe_parsed(frame, ...)`` (same sums, checks and
        errors). Fast path (CPU outputs, or GPU ones for ``cuda_decode_segments``): one
        native scan checks every header against ``frame_layout`` (``wire.scan_frame``),
        ``accepts_bucket`` the codec parameters, ``decode_segments`` adds the bodies;
        what they do not accept goes the per-payload way, whose errors name the field."""
        names = [ctx.name for ctx in ctxs]
        scanned = receive.scan_accepted(self, frame, outs, ctxs, names)
        if scanned is None:
            device = outs[0].device if outs else torch.device("cpu")
            parsed = wire.unframe_parsed(frame, rank, names, device)
            self.decode_bucket(parsed, outs, ctxs, rank=rank)
            return
        params, starts, lens, numels, nonfinite = scanned
        for out in outs:
            receive.check_out(out)
        outs = [out if out.dim() == 1 else out.view(-1) for out in outs]
        finite = np.flatnonzero(~nonfinite)
        pick = finite.tolist()
        failed = None
        if pick:
            segments = [params[i] for i in pick], starts[finite], lens[finite], numels[finite]
            picked = [outs[i] for i in pick], [names[i] for i in pick]
            failed = self.decode_segments(frame, *segments, *picked, rank)
        # a non-finite payload's output is all NaN, in bucket order: up to a failed body
        stop = len(outs) if failed is None else pick[failed[0]]
        for i in np.flatnonzero(nonfinite[:stop]).tolist():
            outs[i].fill_(float("nan"))
        if failed is not None:
            raise failed[1].locate(rank=rank, tensor=names[stop]) from None

    def accepts_bucket(
        self,
        names: list[str],
        flags: np.ndarray,
        params: list[bytes],
        body_lens: np.ndarray,
        numels: np.ndarray,
    ) -> bool:
        """True when every payload of a scanned frame passes ``check_params`` and, unless
        non-finite, ``numel <= max_numel(body_len)`` (a compressor may override this with
        array arithmetic over the same conditions); False: the per-payload way."""
        for name, flag, param, body_len, numel in zip(
            names, flags.tolist(), params, body_lens.tolist(), numels.tolist(), strict=True
        ):
            header = wire.Header(self.name, flag, torch.float32, (numel,), param, body_len)
            try:
                self.check_params(header, name)
            except PayloadError:
                return False
            if not header.nonfinite and numel > self.max_numel(body_len, name):
                return False
        return True

    def decode_segments(
        self,
        frame: torch.Tensor,
        params: list[bytes],
        starts: np.ndarray,
        lens: np.ndarray,
        numels: np.ndarray,
        outs: list[torch.Tensor],
        names: list[str],
        rank: int | None = None,
    ) -> tuple[int, PayloadError] | None:
        """Add the accepted bodies ``frame[starts[i]:][:lens[i]]`` decoded into
        ``outs[i]``: None, or (i, the PayloadError) of the first that does not decode (the
        ones before it added, ``outs[i]`` untouched). ``decode_into`` of each by default; a
        codec with a batched native decoder overrides it with one call (docs/backends.md,
        "One call per bucket"); side information as in ``decode_bucket``."""
        for i, (param, start, length, numel) in enumerate(
            zip(params, starts.tolist(), lens.tolist(), numels.tolist(), strict=True)
        ):
            header = wire.Header(self.name, 0, torch.float32, (numel,), param, length)
            side = outs[i] / rank if self.uses_side_info and rank else None
            try:
                self.decode_into(header, frame[start : start + length], outs[i], True, side)
            except PayloadError as err:
                return i, err
        return None

    def bits_per_value(self, payload: torch.Tensor) -> float:
        """Bits on the wire per tensor element, header included."""
        header = wire.parse(payload)
        return 8.0 * payload.numel() / max(header.numel, 1)

    def read_header(self, payload: torch.Tensor) -> tuple[wire.Header, bytes]:
        """The parsed header and its raw bytes (see ``wire.parse``)."""
        header = wire.parse(payload)
        return header, header.raw

    # ---- receive ---------------------------------------------------------------------------
    def decompress(self, payload: torch.Tensor, ctx: Ctx) -> torch.Tensor:
        return self.decode(payload, expect=ctx)

    def decode(
        self,
        payload: torch.Tensor,
        *,
        expect: Ctx | None = None,
        rank: int | None = None,
        name: str | None = None,
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
        return self.decode_parsed(
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

    def decode_parsed(
        self,
        header: wire.Header,
        payload: torch.Tensor,
        *,
        expect: Ctx | None = None,
        name: str | None = None,
        rank: int | None = None,
        out: torch.Tensor | None = None,
        accumulate: bool = False,
        side_info: torch.Tensor | None = None,
        max_numel: int | None = None,
    ) -> torch.Tensor:
        """``decode`` of a payload whose header was parsed already (the gather path parses
        each payload once, ``wire.parse``)."""
        if side_info is not None and not self.uses_side_info:
            raise TypeError(f"{self.name} decodes without side information")
        if out is not None:
            receive.check_out(out)
        limit, source = receive.numel_limit(
            None if expect is None else expect.shape, out, max_numel
        )
        try:
            receive.check_header(self, header, payload, expect, name, limit, source)
            body = payload[header.size :]
            if out is not None:
                if header.numel != out.numel():
                    raise PayloadError(
                        "numel", f"{header.numel} elements for an output of {out.numel()}"
                    )
                if header.nonfinite:
                    out.fill_(float("nan"))
                else:
                    self.decode_into(header, body, out.view(-1), accumulate, side_info)
                return out
            if header.nonfinite:
                return torch.full(
                    header.shape, float("nan"), dtype=header.dtype, device=payload.device
                )
            flat = self.decode_new(header, body, side_info)
            bound = self.decoded_bound(header, body)  # the body decoded: checked
            return receive.checked_cast(flat.view(header.shape), header.dtype, bound)
        except PayloadError as err:
            raise err.locate(rank=rank, tensor=name) from None
