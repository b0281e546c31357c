"""The coverage-guided fuzz targets (scripts/_bench/fuzz_targets.py; the atheris driver is
scripts/fuzz_coverage.py, a local tool) run here over their seed corpus without atheris,
so the harness cannot rot: every seed is handled as documented, and the oracles still
catch what they are for. Its findings are regression tests in test_checkpoint_safety.py
(section "found by the coverage-guided fuzzer")."""

import pytest
import torch

from hvdcompress import checkpoint as ck
from scripts._bench import fuzz_targets as ft


@pytest.mark.parametrize("target", sorted(ft.TARGETS))
def test_every_seed_is_handled_as_documented(target):
    seeds = ft.seed_corpus(target)
    assert len(seeds) >= 20
    for data in seeds:
        ft.TARGETS[target](data)


def test_short_and_empty_inputs_are_no_findings():
    for data in (b"", b"\0", b"\x02\x00", b"\x06\x06\x00", bytes(64)):
        ft.frame_target(data)
        ft.checkpoint_target(data)


def test_the_oracles_catch_code_unbounded_work_and_a_changed_refusal():
    with pytest.raises(ft.CodeRan), ft._no_code_runs():
        try:
            exec(compile("1 + 1", "<file>", "eval"))  # as a crafted pickle's code would
        except ft.CodeRan:
            pass  # the library swallowing it does not hide it
    with pytest.raises(ft.UnboundedWork), ft._no_code_runs():
        torch.isfinite(torch.zeros(1).expand(2**40))
    o = ft._optimizer(0)
    before = o.snapshot()
    state = ft.copy.deepcopy(o.good)
    state[ft.STATE_KEY]["size"] = 2  # another job size: refused, the optimizer unchanged
    with pytest.raises(ck.CheckpointError):
        o.opt.load_state_dict(state)
    ft._expect_load(o, state)  # a refusal is no finding
    assert o.snapshot() == before


def test_a_repeating_view_in_a_forged_file_is_refused():
    """The input of the stride-0 finding, as the checkpoint target reads it (kind 1: a
    forged file's payload): a CheckpointError, not the 2**40-element walk."""
    o = ft._optimizer(0)
    state = ft.copy.deepcopy(o.good)
    state[ft.STATE_KEY]["compressor_state"]["residuals"]["0.weight"] = torch.zeros(1).expand(2**40)
    blob = ck.encode_checkpoint(state)
    ft.checkpoint_target(bytes([1, 0]) + blob[ck._HEADER.size :])
