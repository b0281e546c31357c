"""Shared machinery of the compressors that draw random numbers (randomk, gspar, qsgd,
terngrad, dqsg, ndqsg): a seed, this rank's id, a step counter per tensor, and the header
fields from which any receiver regenerates the sender's random numbers, the same on every
backend (hvdcompress.codecs.primitives).

``step`` counts this compressor's compress calls for that tensor name (saved in
``state_dict``). ``rank`` must differ between ranks that compress the same tensor (their
random numbers are then independent); the optimizer sets it through ``bind(rank, size)``.
Decoding checks that the payload's seed is this compressor's (ranks agree on it at
start-up) and, when the receiver names the tensor, that the payload's tensor id is that
name's.
"""

from __future__ import annotations

from hvdcompress import wire
from hvdcompress.buckets import StateKey, state_key, state_text
from hvdcompress.codecs import primitives as prim
from hvdcompress.compressors.base import Encoded, GatherCompressor, check_params_len, empty_body
from hvdcompress.errors import PayloadError


def encoded(params: bytes, body, device) -> Encoded:
    """The payload of a body, or of non-finite input (body None): the flag, an empty body."""
    if body is None:
        return Encoded(wire.FLAG_NONFINITE, params, empty_body(device))
    return Encoded(0, params, body)


def with_fields(fields: bytes):
    """The ``payload`` of ``Stochastic._encode_bucket_with`` for a codec's bodies (None for
    non-finite input): params the RNG fields, then ``fields``."""
    return lambda rng, body, device: encoded(rng + fields, body, device)


def next_stream_key(steps: dict, seed: int, rank: int, name: StateKey) -> tuple[int, int, int]:
    """(step, tensor id, stream key) of ``name``'s next payload from ``rank``, its step
    counted in ``steps`` (compress calls per tensor name; a piece's key: its checkpoint
    name)."""
    step = steps.get(name, 0)
    steps[name] = step + 1
    tid = prim.tensor_id(str(name))
    return step, tid, prim.rng_key(seed, step, prim.check_rank(rank), tid)


def load_steps(what: str, saved) -> dict[StateKey, int]:
    """The step counters of a checkpoint (``state_text`` of ``steps``), checked."""
    from hvdcompress.checkpoint import check_count_map

    return {state_key(text): step for text, step in check_count_map(what, saved).items()}


class Stochastic(GatherCompressor):
    """Base of the seeded compressors; subclasses call ``_rng_params`` / ``_stream_key``."""

    def _init_rng(self, seed: int, rank: int) -> None:
        self.seed = prim.check_seed(seed)
        self.rank = prim.check_rank(rank)
        self.steps: dict[StateKey, int] = {}

    def bind(self, rank: int, size: int) -> None:
        self.rank = prim.check_rank(rank)

    def _rng_params(self, name: StateKey) -> tuple[bytes, int]:
        """(the packed RNG header fields, the stream key) for this tensor's next payload."""
        step, tid, key = next_stream_key(self.steps, self.seed, self.rank, name)
        return prim.RNG_PARAMS.pack(self.seed, step, tid, self.rank), key

    def _encode_bucket_with(self, tensors, names, encode_segments, payload):
        """``encode_bucket`` through a codec's one-call bucket encoder ``encode_segments(xs,
        keys)``: each tensor's payload is ``payload(its RNG fields, its result, device)``."""
        xs = [prim.f32_data(t) for t in tensors]  # addresses and sizes only
        if len({x.device for x in xs}) != 1:  # none, or on several devices
            return super().encode_bucket(tensors, names)
        rngs = [self._rng_params(name) for name in names]  # steps advance as in encode
        results = encode_segments(xs, [key for _, key in rngs])
        return [
            payload(rng, result, x.device)
            for x, (rng, _), result in zip(xs, rngs, results, strict=True)
        ]

    def _checked_fields(self, header, name: StateKey | None, fields) -> tuple:
        """The codec's ``fields`` (a struct.Struct) after the RNG fields, once the length of
        the parameters, this compressor's seed and, when the receiver names the tensor,
        that tensor's id are checked."""
        check_params_len(self, header, prim.RNG_PARAMS.size + fields.size)
        seed, _, tid, _ = prim.RNG_PARAMS.unpack_from(header.params, 0)
        if seed != self.seed:
            raise PayloadError(
                "seed", f"expected {self.seed}, got {seed} (ranks disagree on the seed)"
            )
        if name is not None and tid != prim.tensor_id(str(name)):
            raise PayloadError(
                "tensor_id",
                f"payload is for tensor id 0x{tid:016x}, expected {str(name)!r} "
                f"(0x{prim.tensor_id(str(name)):016x}): ranks disagree on tensor order",
            )
        return fields.unpack_from(header.params, prim.RNG_PARAMS.size)

    @staticmethod
    def _stream_key(params: bytes) -> int:
        """The random stream key of a (validated) payload's RNG fields."""
        seed, step, tid, rank = prim.RNG_PARAMS.unpack_from(params, 0)
        return prim.rng_key(seed, step, rank, tid)

    def state_dict(self) -> dict:
        return {"seed": self.seed, "steps": state_text(self.steps)}

    def load_state_dict(self, state: dict) -> None:
        from hvdcompress.checkpoint import check_keys

        check_keys(f"{self.name} state", state, required=("seed",), optional=("steps",))
        self._load_rng_state(state)

    def _load_rng_state(self, state: dict) -> None:
        """The seed checked, then the steps (checked before they replace the current ones)."""
        from hvdcompress.checkpoint import check_saved_value

        check_saved_value("seed", state.get("seed"), self.seed)
        self.steps = load_steps(f"{self.name} steps", state.get("steps", {}))
