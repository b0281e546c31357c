"""Every boolean, numeric and enumerated parameter of the public API is checked for its
type and range and refused with a message that names it (hvdcompress.checks): a table
walks the signatures of ``DDPHookState``, ``DistributedOptimizer``, the policies and the
integrations, classifies each parameter by its annotation and default, and feeds each
class its bad values. A parameter the walk cannot classify must be listed with the
reason it is checked elsewhere, so that a new parameter cannot slip past unchecked.
scripts/train.py: every flag has a type, choices or is a switch, and a value of the
wrong type is a one-line argparse error naming it (tests/test_train_args.py checks the
ranges)."""

from __future__ import annotations

import importlib.util
import inspect
import math
from pathlib import Path

import pytest
import torch

import hvdcompress
from hvdcompress import checks
from tests.helpers import LocalTransport, small_model

ROOT = Path(__file__).resolve().parents[1]


def _optimizer(**kw):
    model = small_model()
    return hvdcompress.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
        compression="3lc", backend=LocalTransport(), **kw,
    )  # fmt: skip


def _strategy(**kw):
    from hvdcompress.lightning import CompressedDDPStrategy

    return CompressedDDPStrategy("3lc", **kw)


def _accelerate_register(**kw):
    import hvdcompress.accelerate

    # the arguments are checked before the accelerator or the model is looked at
    return hvdcompress.accelerate.register(None, None, **kw)


# (the public callable, a call with its required arguments, the parameters the walk
# leaves to checks of their own and why)
API = [
    (
        hvdcompress.DDPHookState,
        lambda **kw: hvdcompress.DDPHookState("3lc", **kw),
        {
            "compression": "resolve_compressor: a name, Compressor or Compression entry",
            "process_group": "a torch.distributed group, checked at bind",
            "named_parameters": "an iterable of (name, tensor)",
            "link_cost": "check_exchange: None, 'measure' or a LinkCost (TypeError)",
            "tuning": "check_tuning: a Tuning or None (TypeError)",
        },
    ),
    (
        hvdcompress.DistributedOptimizer,
        _optimizer,
        {
            "optimizer": "TypeError unless a torch.optim.Optimizer",
            "named_parameters": "an iterable of (name, tensor)",
            "compression": "resolve_compressor",
            "groups": "resolve_groups: an int or lists of tensors",
            "process_set": "an hvd.ProcessSet or a list of ranks",
            "backend": "TypeError unless 'horovod', 'mpi4py' or a Transport",
            "policy": "TypeError unless a Policy",
            "link_cost": "check_exchange",
            "tuning": "check_tuning",
        },
    ),
    (
        hvdcompress.Tuning,
        lambda **kw: hvdcompress.Tuning(**kw),
        {
            "half": "checks.choice: 'bf16', 'fp16' or None",
            "drift": "checks.number > 0, or None (never re-time on drift)",
        },
    ),
    (
        hvdcompress.Accordion,
        lambda **kw: hvdcompress.Accordion(low=1.0, high=1.75, **kw),
        {
            "low": "a compressor level, checked against the compressor at bind",
            "high": "a compressor level, checked against the compressor at bind",
        },
    ),
    (
        hvdcompress.CAT,
        lambda **kw: hvdcompress.CAT(**kw),
        {
            "cost_model": "TypeError unless None or a CostModel",
        },
    ),
    (
        "hvdcompress.lightning.CompressedDDPStrategy",
        _strategy,
        {
            "compression": "resolve_compressor",
            "kwargs": "Lightning's DDPStrategy's own",
            "tuning": "check_tuning (DDPHookState)",
        },
    ),
    (
        "hvdcompress.accelerate.register",
        _accelerate_register,
        {
            "accelerator": "its distributed type is checked",
            "model": "TypeError unless what accelerator.prepare returned",
            "compression": "resolve_compressor",
            "tuning": "check_tuning",
        },
    ),
]
ENUMS = {"exchange", "op", "compressor"}  # parameters whose values are a fixed set
BAD = {
    "bool": ["no", 1, 0, None, 1.0],
    "int": ["3", 2.5, True, float("nan"), float("inf"), -1],
    "float": ["x", float("nan"), float("inf"), True, -1.0, 0.0],  # every float is > 0
    "enum": ["no such thing", None, 7],
}


def _resolve(target):
    if not isinstance(target, str):
        return target
    module, name = target.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


def _kind(param: inspect.Parameter) -> str | None:
    annotation, default = str(param.annotation), param.default
    if param.name in ENUMS:
        return "enum"
    if annotation == "bool" or isinstance(default, bool):
        return "bool"
    if annotation in ("int", "int | None") or type(default) is int:
        return "int"
    if annotation == "float" or type(default) is float:
        return "float"
    return None


def _walk():
    for target, call, unchecked in API:
        fn = _resolve(target)
        for param in inspect.signature(fn).parameters.values():
            if param.name == "self":
                continue
            yield fn, call, unchecked, param, _kind(param)


def _cases():
    for target, call, _ in API:
        fn = _resolve(target)
        for param in inspect.signature(fn).parameters.values():
            kind = _kind(param)
            if kind is None:
                continue
            for bad in BAD[kind]:
                yield pytest.param(call, param.name, bad, id=f"{fn.__name__}-{param.name}-{bad!r}")


def test_every_parameter_of_the_public_api_is_classified_or_says_where_it_is_checked():
    unclassified = [
        f"{fn.__name__}({param.name})"
        for fn, _, unchecked, param, kind in _walk()
        if kind is None and param.name not in unchecked
    ]
    assert unclassified == []
    walked = {(fn.__name__, param.name) for fn, _, _, param, kind in _walk() if kind}
    assert ("DDPHookState", "overlap") in walked and ("CAT", "refresh") in walked


@pytest.mark.parametrize("call,name,bad", list(_cases()))
def test_a_bad_value_is_refused_with_the_parameters_name(call, name, bad):
    with pytest.raises((TypeError, ValueError)) as err:
        call(**{name: bad})
    assert name in str(err.value), str(err.value)


def test_overlap_that_is_not_a_bool_is_refused():
    """The issue's case: a string is truthy, and was taken as overlap on."""
    with pytest.raises(TypeError, match=r"overlap must be a bool \(True or False\), got 'no'"):
        hvdcompress.DDPHookState("3lc", overlap="no")


@pytest.mark.parametrize(
    "check,args,value,want",
    [
        (checks.boolean, (), True, True),
        (checks.integer, (0,), 1024.0, 1024),
        (checks.number, (0.0,), 2, 2.0),
        (checks.choice, (("a", "b"),), "b", "b"),
    ],
)
def test_the_checks_return_the_value_in_its_canonical_type(check, args, value, want):
    got = check("x", value, *args)
    assert got == want and type(got) is type(want)


def test_a_numeric_range_is_named_in_the_message():
    with pytest.raises(ValueError, match=r"x must be an int in \[1, 4\], got 5"):
        checks.integer("x", 5, 1, 4)
    with pytest.raises(ValueError, match=r"x must be a finite number > 0.0, got 0.0"):
        checks.number("x", 0, 0.0, open_low=True)
    assert math.isclose(checks.number("x", 0.5, 0.0, 1.0), 0.5)


def _train_parser():
    spec = importlib.util.spec_from_file_location(
        "_train_public_args", ROOT / "scripts" / "train.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build_parser()


# paths, KEY=VALUE and the cost model: parsed after the flags, errors in test_train_args
FREE_TEXT = {"--data-dir", "--log-dir", "--checkpoint", "--compression-param", "--cat-cost"}


def test_every_train_py_flag_has_a_type_choices_or_is_a_switch():
    untyped = []
    for action in _train_parser()._actions:
        flag = action.option_strings[-1] if action.option_strings else action.dest
        switch = action.nargs == 0
        if not (switch or action.type or action.choices or flag in FREE_TEXT or flag == "--help"):
            untyped.append(flag)
    assert untyped == []


def test_a_train_py_flag_of_the_wrong_type_is_a_one_line_error_naming_it(capsys):
    parser = _train_parser()
    typed = [
        a.option_strings[-1] for a in parser._actions
        if a.option_strings and (a.type or a.choices) and a.nargs is None
    ]  # fmt: skip
    assert len(typed) >= 15
    for flag in typed:
        with pytest.raises(SystemExit) as exit_:
            parser.parse_args([flag, "not-a-value"])
        assert exit_.value.code == 2, flag
        err = capsys.readouterr().err
        assert f"argument {flag}" in err and err.count("error:") == 1, (flag, err)
