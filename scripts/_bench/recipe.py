"""What a rank of scripts/bench_peers.py steps on: its ``--recipe``.

``training`` (the default): the job scripts/train.py trains for the accuracy runs that
the step times are joined with (scripts/bench_tta.py), so that the bits timed are the
bits trained (3LC's payload depends on the gradients): the model as train.py initialises
it for ``--seed`` ``SEED``, the SGD train.py builds for the row's method (lr and momentum:
``hvdcompress.training.flags.method_sgd`` for an ``hvdc-`` row, the job's ``BASE_LR`` /
``BASE_MOMENTUM`` for ``ddp`` and torch's hooks) and, step after step, the rank's
Fashion-MNIST training batches in the order train.py's loop reads them
(``training.loop.load_data`` / ``plan_steps`` / ``batch_indices``), ``BATCH_SIZE`` per rank
unless ``--batch`` says otherwise. At the start of a run train.py's step schedule keeps
the learning rate at its base value, so no schedule is applied here.

``random``: what bench_peers timed before: a model seeded 0, one fixed random batch per
rank (seeded ``1000 + rank``) at every step, plain SGD at lr 0.01 without momentum.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace

RECIPES = ("training", "random")
SEED = 1  # the accuracy runs' first seed (bench_tta's MODEL_SEEDS)
RANDOM_BATCH = 32  # per rank, the random recipe's default --batch
RANDOM_LR = 0.01


@dataclass
class Recipe:
    """One rank's model, its SGD's settings, ``batch(step)`` -> (inputs, labels) of the
    step (0 the first warm-up step), and ``fields``: what a bench_peers row records."""

    model: object
    lr: float
    momentum: float
    batch: Callable[[int], tuple]
    fields: dict = field(default_factory=dict)


def default_batch(recipe: str) -> int:
    """``--batch``'s default: train.py's batch size per rank for ``training``."""
    from hvdcompress.training.flags import BATCH_SIZE

    return BATCH_SIZE if recipe == "training" else RANDOM_BATCH


def train_args(batch: int, seed: int = SEED) -> SimpleNamespace:
    """The train.py arguments that its data functions read, train.py's defaults but the
    batch size and the seed (the data directory: ``HVDC_DATA_DIR`` or Debian's)."""
    from hvdcompress.training.data import DATA_DIR

    return SimpleNamespace(
        dataset="fashion-mnist", data_dir=DATA_DIR, seed=seed, batch_size=batch, steps=None,
        epochs=1, until_epoch=None,
    )  # fmt: skip


def load(recipe: str):
    """The data a worker's rows share (train.py's ``load_data``: the (train, test) pairs
    of Fashion-MNIST; missing files end the worker with the message saying how to get
    them), None for ``random``."""
    if recipe != "training":
        return None
    from hvdcompress.training.loop import load_data

    return load_data(train_args(default_batch(recipe)))


def sgd_settings(method: str | None) -> tuple[float, float]:
    """(lr, momentum) train.py trains with: for ``method`` of the methods table (an
    ``hvdc-`` row's) through ``method_sgd``, the job's plain defaults for None (``ddp``
    and torch's hooks)."""
    from hvdcompress.training.flags import BASE_LR, BASE_MOMENTUM, method_sgd
    from hvdcompress.training.methods import METHODS

    return (BASE_LR, BASE_MOMENTUM) if method is None else method_sgd(METHODS[method])


def build(recipe: str, model_name: str, method: str | None, rank: int, size: int, batch: int,
          width: int, data=None) -> Recipe:  # fmt: skip
    """Rank ``rank`` of ``size``'s recipe on ``model_name`` for a row of ``method`` (the
    methods table's name of an ``hvdc-`` row, None for ``ddp`` and torch's hooks);
    ``data``: what ``load`` gave (None: loaded here)."""
    import torch

    from hvdcompress.training.models import INPUT_SHAPES, MODELS
    from hvdcompress.training.models import build_model as training_model

    if recipe == "random":
        torch.manual_seed(0)  # the same parameters on every rank
        model = training_model(model_name, width)  # train.py's models (its default width: 16)
        g = torch.Generator().manual_seed(1000 + rank)
        x = torch.randn(batch, *INPUT_SHAPES[model_name], generator=g)
        y = torch.randint(0, 10, (batch,), generator=g)
        fields = {"recipe": "random", "data": "random", "seed": None, "batch": batch,
                  "lr": RANDOM_LR, "momentum": 0.0}  # fmt: skip
        return Recipe(model, RANDOM_LR, 0.0, lambda step: (x, y), fields)
    if recipe != "training":
        raise ValueError(f"recipe {recipe!r}: one of {', '.join(RECIPES)}")
    from hvdcompress.training.loop import batch_indices, plan_steps
    from hvdcompress.training.simulate import seeded

    args = train_args(batch)
    (x_train, y_train), _ = data if data is not None else load(recipe)
    world = SimpleNamespace(rank=rank, size=size)
    steps_per_epoch, _ = plan_steps(args, world, len(x_train))
    # train.py's replica: seeded(--seed, MODELS[--model](--width)), rank 0's on every rank
    model = seeded(args.seed, lambda: MODELS[model_name](width))
    lr, momentum = sgd_settings(method)

    def batch_of(step: int):
        idx = batch_indices(args, world, len(x_train), step, steps_per_epoch)
        return x_train[idx], y_train[idx]

    fields = {"recipe": "training", "data": "fashion-mnist", "seed": args.seed,
              "batch": batch, "lr": lr, "momentum": momentum}  # fmt: skip
    return Recipe(model, lr, momentum, batch_of, fields)
