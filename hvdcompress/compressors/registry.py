"""The compressor registry: a compressor registers itself, everything else derives from it.

What the rest of the project needs to know about a compressor is one ``CompressorSpec``
(hvdcompress.compressors.spec) passed to ``@register(spec)`` on its class; a new
compressor is one new module in ``hvdcompress/compressors/``, imported with the package
(docs/adding-a-compressor.md). From the registry derive: ``get_compressor`` /
``available`` (names and parameter ranges), ``hvdcompress.Compression.<attribute>``
entries, the wire codec-id table (``wire.CODEC_IDS``), CAT's compressor for each budget
kind (``cat_kind``), the configurations the fuzz tests, the per-codec MPI bit-identity test
and the API tests run, and bench_codec's default cases.

Registration checks the declaration: a unique name, a unique wire id (gather-only
compressors carry one, summable ones do not), a ``Param`` for every constructor
parameter, and examples that construct.
"""

from __future__ import annotations

import functools
import inspect

from hvdcompress import wire
from hvdcompress.compressors.base import Compressor, GatherCompressor
from hvdcompress.compressors.params import Param
from hvdcompress.compressors.spec import CompressorSpec

__all__ = ["REGISTRY", "CompressorSpec", "Param", "available", "get_compressor", "register"]

REGISTRY: dict[str, type[Compressor]] = {}


def register(spec: CompressorSpec):
    """Class decorator: check ``spec`` against the class, give the class its ``spec`` and
    ``name`` (what its messages and payload headers say) and add it to the registry."""

    def registered(cls: type[Compressor]) -> type[Compressor]:
        _check(spec, cls)
        cls.spec, cls.name = spec, spec.name
        _enforce_params(cls)
        REGISTRY[spec.name] = cls
        return cls

    return registered


def _check(spec: CompressorSpec, cls: type[Compressor]) -> None:
    """Refuse a declaration the project could not derive from; a gather-only compressor's
    wire id is registered (``wire.register_codec``) on the way."""
    name = spec.name
    if not name or name != name.lower():
        raise ValueError(f"{cls.__qualname__}: a compressor needs a lower-case name, got {name!r}")
    if name in REGISTRY and REGISTRY[name] is not cls:
        raise ValueError(f"compressor name {name!r} is taken by {REGISTRY[name].__qualname__}")
    if cls.summable:
        if spec.wire_id is not None:
            raise ValueError(f"{name}: summable payloads are dense tensors and carry no wire id")
    else:
        if spec.wire_id is None:
            raise ValueError(f"{name}: a gather-only compressor needs a wire id (codec id)")
        wire.register_codec(name, spec.wire_id)
        defaults = (GatherCompressor.encode, GatherCompressor.encode_bucket)
        if (cls.encode, cls.encode_bucket) == defaults:
            raise TypeError(f"{name}: a gather-only compressor implements encode or encode_bucket")
    declared = set(spec.params)
    accepted = set(constructor_params(cls))
    if declared != accepted:
        raise ValueError(
            f"{name}: params declares {sorted(declared)}, the constructor takes {sorted(accepted)}"
        )
    for example in (*spec.examples, *spec.bench_configs):
        unknown = set(example) - accepted
        if unknown:
            raise ValueError(f"{name}: example {example} has unknown parameters {sorted(unknown)}")


def _enforce_params(cls) -> None:
    """Make the constructor refuse what ``params`` declares invalid, also when it is
    called directly (``TopK(ratio="0.5")``), not only through ``get_compressor``.

    The constructor runs first, so its own messages stay; a value it let through
    (a string it converted, a bool taken for a number, an out-of-range value it
    did not check) is then refused with the declared range. Subclasses without their
    own ``__init__`` inherit the check."""
    init = cls.__dict__.get("__init__")
    if init is None or getattr(init, "_checks_params", False):
        return
    signature = inspect.signature(init)

    @functools.wraps(init)
    def checked_init(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()

        def invalid() -> list[str]:
            got = bound.arguments
            return [p for p, s in cls.spec.params.items() if p in got and not s.accepts(got[p])]

        def refuse(param: str):
            cls.spec.params[param].check(cls.name, param, bound.arguments[param])

        try:
            init(self, *args, **kwargs)
        except (TypeError, ValueError, OverflowError) as err:
            # keep the constructor's message when it names the parameter; float(None),
            # int(nan) and the like get the declared range instead
            bad = invalid()
            if bad and not any(p in str(err) for p in bad):
                refuse(bad[0])
            raise
        for param in invalid():
            refuse(param)

    checked_init._checks_params = True
    cls.__init__ = checked_init


def constructor_params(cls) -> dict[str, object]:
    """The constructor's parameters and their defaults, in order."""
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    return {p.name: p.default for p in params}


def _signature(cls) -> str:
    return ", ".join(f"{n}={d!r}" for n, d in constructor_params(cls).items())


def available() -> str:
    """One line per compressor: its name and parameters with defaults, then its kind and
    the parameters' valid ranges."""
    lines = []
    for name, cls in sorted(REGISTRY.items()):
        about = ["summable" if cls.summable else "gather-only"]
        about += [f"{p}: {spec.describe()}" for p, spec in cls.spec.params.items()]
        lines.append(f"  {name}({_signature(cls)})  [{'; '.join(about)}]")
    return "\n".join(lines)


def get_compressor(name: str, **params) -> Compressor:
    """A new compressor (own state) by name; a wrong name or parameter lists the valid ones."""
    cls = REGISTRY.get(name.lower())
    if cls is None:
        raise ValueError(f"unknown compressor {name!r}; available:\n{available()}")
    try:
        inspect.signature(cls.__init__).bind(None, **params)
    except TypeError:
        raise TypeError(
            f"compressor {name!r} takes ({_signature(cls)}), got {sorted(params)}"
        ) from None
    return cls(**params)


def names(*, summable: bool | None = None) -> list[str]:
    """Registered names, sorted; ``summable`` True / False keeps one kind."""
    return sorted(n for n, c in REGISTRY.items() if summable is None or c.summable == summable)


def examples() -> list[tuple[str, dict]]:
    """(name, params) of every example configuration of every compressor (for tests)."""
    return [(n, dict(p)) for n in names() for p in REGISTRY[n].spec.examples]


def bench_cases() -> list[tuple[str, dict]]:
    """(name, params) of every compressor's benchmark configurations (bench_codec)."""
    return [(n, dict(p)) for n in names() for p in REGISTRY[n].spec.bench_configs]


def by_attribute(attribute: str) -> type[Compressor] | None:
    """The compressor whose ``Compression.<attribute>`` entry this is."""
    for cls in REGISTRY.values():
        if cls.spec.compression_attribute == attribute:
            return cls
    return None


def for_cat_kind(kind: str) -> type[Compressor] | None:
    """The compressor CAT drives for a budget kind ("topk", "topk+q", "randomk")."""
    for cls in REGISTRY.values():
        if cls.spec.cat_kind == kind:
            return cls
    return None
