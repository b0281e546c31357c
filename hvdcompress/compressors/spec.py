"""What the rest of the project needs to know about a compressor, in one record
(``CompressorSpec``) passed to ``@register`` (hvdcompress.compressors.registry): the
class is the algorithm and its state, the record is what the registry's users read
(``get_compressor`` and ``available``, ``Compression.<attribute>``, the wire codec ids,
CAT's compressor per budget kind, the policies' level parameter, the tests' examples,
bench_codec's cases, train.py's and the benchmarks' SGD settings)."""

from __future__ import annotations

from dataclasses import dataclass, field

from hvdcompress.compressors.params import Param


@dataclass(frozen=True)
class CompressorSpec:
    """One compressor's registry entry (docs/adding-a-compressor.md)."""

    name: str  # get_compressor(name), the payload header's codec
    wire_id: int | None = None  # codec id in the payload header (gather-only); fixed forever
    params: dict[str, Param] = field(default_factory=dict)  # one per constructor parameter
    examples: tuple[dict, ...] = ({},)  # configurations the tests exercise
    benchmarks: tuple[dict, ...] | None = None  # bench_codec's; None: examples[:1]
    attribute: str | None = None  # Compression.<attribute>; None: the name
    cat_kind: str | None = None  # the CAT budget kind this compressor implements
    level_param: str | None = None  # the parameter a policy sets per tensor (PerTensorLevels)
    # Plain SGD's settings that train with this compressor (docs/codecs.md, "Defaults that
    # train"): a factor on the job's learning rate, and a momentum (None: the job's).
    # scripts/train.py and the benchmarks apply them unless --lr / --momentum are given.
    sgd_lr_factor: float = 1.0
    sgd_momentum: float | None = None
    # a constructor parameter that, when set (not None), makes the compressor train at
    # SGD's own learning rate (GSpar's ``variance``: a bounded-variance budget)
    sgd_own_rate_with: str | None = None

    @property
    def bench_configs(self) -> tuple[dict, ...]:
        return self.benchmarks if self.benchmarks is not None else self.examples[:1]

    @property
    def compression_attribute(self) -> str:
        return self.attribute or self.name

    def lr_factor(self, compressor=None) -> float:
        """``sgd_lr_factor``, or 1 for a built ``compressor`` whose ``sgd_own_rate_with``
        parameter is set."""
        own = self.sgd_own_rate_with
        if compressor is not None and own and getattr(compressor, own) is not None:
            return 1.0
        return self.sgd_lr_factor
