"""The compressor registry: declarations are checked, and everything derives from them.

A compressor declares its name, wire id, parameter ranges and example configurations
(hvdcompress.compressors.registry); the names, wire ids, ``Compression`` entries, CAT's table, the
fuzz and API test configurations, the MPI bit-identity test and bench_codec's cases all
come from there. The last test registers a compressor from outside the package
(tests/plugins/toy_compressor.py) and checks, in fresh processes, that the fuzz tests, the
MPI bit-identity test and bench_codec pick it up without an edit.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hvdcompress
from hvdcompress import wire
from hvdcompress.compression import resolve_compressor
from hvdcompress.compressors import GatherCompressor, SummableCompressor, registry
from hvdcompress.compressors.params import Param
from hvdcompress.compressors.registry import register
from hvdcompress.compressors.spec import CompressorSpec
from hvdcompress.policies.cat import KINDS, compressor_for
from tests.helpers import powersgd_one_rank

ROOT = Path(__file__).resolve().parents[1]
NAMES = registry.names()


@pytest.fixture
def scratch_registry():
    """Registrations made in the test are undone afterwards."""
    saved = (dict(registry.REGISTRY), dict(wire.CODEC_IDS), dict(wire.CODEC_NAMES))
    yield
    tables = (registry.REGISTRY, wire.CODEC_IDS, wire.CODEC_NAMES)
    for table, old in zip(tables, saved, strict=True):
        table.clear()
        table.update(old)


def test_every_kind_of_compressor_is_registered():
    assert set(registry.names(summable=True)) == {"none", "fp16", "bf16", "powersgd"}
    assert {"3lc", "topk", "dqsg", "ndqsg", "dgc"} <= set(registry.names(summable=False))
    for name in NAMES:
        cls = registry.REGISTRY[name]
        assert issubclass(cls, SummableCompressor if cls.summable else GatherCompressor)


@pytest.mark.parametrize("name", NAMES)
def test_every_constructor_parameter_has_a_declared_range(name):
    cls = registry.REGISTRY[name]
    assert set(cls.spec.params) == set(registry.constructor_params(cls))
    for pname, spec in cls.spec.params.items():
        assert spec.describe() in hvdcompress.available(), (name, pname)


@pytest.mark.parametrize("name", NAMES)
def test_values_outside_the_declared_ranges_are_refused(name):
    cls = registry.REGISTRY[name]
    checked = 0
    for pname, spec in cls.spec.params.items():
        for value in spec.outside():
            with pytest.raises(ValueError):
                hvdcompress.get_compressor(name, **{pname: value})
            checked += 1
    assert checked >= sum(1 for s in cls.spec.params.values() if s.kind != "bool")


def test_param_describes_and_bounds_intervals():
    assert Param(1.0, 2.0, high_open=True).describe() == "float in [1.0, 2.0)"
    assert Param(0.0, 1.0, low_open=True).outside() == [0.0, 1.0000000000000002]
    assert Param(1, 127, kind="int").outside() == [0, 128]
    assert Param(0.0, None).outside() == [-5e-324]
    assert Param(kind="bool").outside() == []


@pytest.mark.parametrize("name,params", registry.examples())
def test_every_example_round_trips(name, params):
    c = hvdcompress.get_compressor(name, **params)
    c.bind(0, 2)
    x = torch.randn(6, 7)
    if isinstance(c, GatherCompressor):
        payload, ctx = c.compress(x, "w")
        receiver = hvdcompress.get_compressor(name, **params)
        receiver.bind(0, 2)
        side = {"side_info": x.reshape(-1)} if c.uses_side_info else {}
        out = receiver.decode(payload, expect=ctx, **side)
        assert out.shape == x.shape and out.dtype == x.dtype
        assert torch.isfinite(out).all()
    elif c.phases > 1:
        assert powersgd_one_rank(c, x).shape == x.shape
    else:
        payload, ctx = c.compress(x, "w")
        assert c.decompress(payload, ctx).shape == x.shape


def test_wire_ids_come_from_the_registry_and_are_unique():
    gather = {n: registry.REGISTRY[n].spec.wire_id for n in registry.names(summable=False)}
    assert wire.CODEC_IDS == gather
    assert len(set(gather.values())) == len(gather)
    assert {v: k for k, v in gather.items()} == wire.CODEC_NAMES
    # the released ids never change
    assert gather["3lc"] == 1 and gather["dqsg"] == 2 and gather["gspar"] == 12


@pytest.mark.parametrize("name", NAMES)
def test_every_compressor_has_a_compression_entry(name):
    cls = registry.REGISTRY[name]
    attribute = cls.spec.compression_attribute
    assert attribute in dir(hvdcompress.Compression)
    entry = getattr(hvdcompress.Compression, attribute)
    built = resolve_compressor(entry if name in ("none", "fp16", "bf16") else entry())
    assert type(built) is cls


def test_unknown_compression_entry_lists_the_valid_ones():
    with pytest.raises(AttributeError, match="threelc"):
        hvdcompress.Compression.fourlc  # noqa: B018


def test_cat_kinds_resolve_to_registered_compressors():
    for kind in KINDS:
        assert registry.REGISTRY[compressor_for(kind)].spec.cat_kind == kind
    with pytest.raises(ValueError, match="no registered compressor"):
        compressor_for("topk+zz")


def _toy(name="toyx", wire_id=254, summable=False, params=None, examples=({},), encodes=True):
    base = SummableCompressor if summable else GatherCompressor

    class Toy(base):
        def __init__(self, level: int = 1) -> None:
            self.level = level

    if encodes and not summable:
        Toy.encode = lambda self, tensor, name: None  # registration only: never called

    params = {"level": Param(1, 3, kind="int")} if params is None else params
    return CompressorSpec(name, wire_id, params, examples), Toy


def _register(toy):
    """``register`` of a ``_toy`` (its spec, its class)."""
    spec, cls = toy
    return register(spec)(cls)


@pytest.mark.usefixtures("scratch_registry")
def test_registration_checks_the_declaration():
    _register(_toy())
    assert "toyx" in registry.names() and wire.CODEC_IDS["toyx"] == 254
    with pytest.raises(ValueError, match="taken"):
        _register(_toy())  # another class, same name
    with pytest.raises(ValueError, match="wire id 1, taken by '3lc'"):
        _register(_toy(name="toyy", wire_id=1))
    with pytest.raises(ValueError, match="needs a wire id"):
        _register(_toy(name="toyz", wire_id=None))
    with pytest.raises(ValueError, match="carry no wire id"):
        _register(_toy(name="toyw", summable=True))
    with pytest.raises(ValueError, match="constructor takes"):
        _register(_toy(name="toyv", wire_id=253, params={}))
    with pytest.raises(ValueError, match="unknown parameters"):
        _register(_toy(name="toyu", wire_id=252, examples=({"levle": 2},)))
    with pytest.raises(ValueError, match="lower-case"):
        _register(_toy(name="ToyT", wire_id=251))
    with pytest.raises(TypeError, match="implements encode or encode_bucket"):
        _register(_toy(name="toys", wire_id=250, encodes=False))


def _run(cmd: list[str], timeout: int = 600) -> str:
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    done = subprocess.run(
        cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{out[-3000:]}"
    return out


PLUGIN = ["-p", "tests.plugins.toy_compressor"]
PYTEST = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *PLUGIN]


def test_a_registered_compressor_is_fuzzed_and_api_tested_without_edits():
    out = _run([*PYTEST, "tests/fuzz/test_payload_mutations.py", "-k", "toyint8"])
    assert "6 passed" in out, out[-2000:]  # the six fuzz tests, for the new compressor
    out = _run([*PYTEST, "tests/test_compressor_api.py", "-k", "toyint8"])
    assert " passed" in out and "failed" not in out, out[-2000:]


def test_a_registered_compressor_is_benchmarked_without_edits(tmp_path):
    code = (
        "import runpy, sys; import tests.plugins.toy_compressor; "
        "sys.argv = ['bench_codec.py', '--sizes', '1e3', '--min-time', '0.005', "
        f"'--json', {str(tmp_path / 'b.json')!r}]; "
        "runpy.run_path('scripts/bench_codec.py', run_name='__main__')"
    )
    out = _run([sys.executable, "-c", code])
    assert "toyint8" in out and "3lc" in out


def test_a_registered_compressor_is_checked_for_bit_identity_on_mpi_ranks():
    out = _run(
        [
            "mpirun", "-np", "2", "--oversubscribe", "--bind-to", "none",
            "--mca", "pml", "ob1", "--mca", "btl", "self,vader",
            "--mca", "btl_vader_single_copy_mechanism", "none",
            *PYTEST, "--with-mpi", "tests/mpi/test_gather_bit_identity.py", "-k", "toyint8",
        ]
    )  # fmt: skip
    assert out.count("1 passed") == 2, out[-2000:]  # both ranks ran the new compressor
