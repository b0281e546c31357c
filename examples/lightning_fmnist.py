"""The Fashion-MNIST CNN of scripts/train.py under PyTorch Lightning, compressed by
hvdcompress: Lightning's usual script, with the strategy line the only addition.

    pip install 'hvdcompress[lightning]'
    python examples/lightning_fmnist.py --devices 2 --compression 3lc --epochs 2

Lightning starts the other ranks itself (or runs under torchrun / srun, which it
detects); ``--accelerator gpu`` runs the same script on GPUs (NCCL).
"""

from __future__ import annotations

import argparse

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import hvdcompress
from hvdcompress.lightning import CompressedDDPStrategy
from hvdcompress.training.data import load_fashion_mnist
from hvdcompress.training.models import build_model


class FashionMNISTClassifier(pl.LightningModule):
    def __init__(self, lr: float = 0.05, momentum: float = 0.9) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = build_model("cnn")

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        acc = (self(x).argmax(1) == y).float().mean()
        self.log("val_acc", acc, sync_dist=True, prog_bar=True)

    def configure_optimizers(self):
        return torch.optim.SGD(
            self.parameters(), lr=self.hparams.lr, momentum=self.hparams.momentum
        )


def loaders(batch_size: int, train_examples: int | None = None):
    (x, y), (tx, ty) = load_fashion_mnist()
    if train_examples is not None:
        x, y = x[:train_examples], y[:train_examples]
    train = DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=True)
    test = DataLoader(TensorDataset(tx, ty), batch_size=1000)
    return train, test


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compression", default="3lc")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument(
        "--no-tuning", action="store_true", help="keep exchange='auto''s first guess"
    )
    parser.add_argument(
        "--limit-batches", type=float, default=1.0, help="fraction (or count) of batches per epoch"
    )
    args = parser.parse_args(argv)
    limit = int(args.limit_batches) if args.limit_batches > 1 else args.limit_batches

    pl.seed_everything(42)
    train, test = loaders(args.batch_size)
    tuning = None if args.no_tuning else hvdcompress.Tuning()  # docs/exchanges.md
    strategy = CompressedDDPStrategy(args.compression, tuning=tuning)  # the line it adds
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator=args.accelerator,
        devices=args.devices,
        max_epochs=args.epochs,
        limit_train_batches=limit,
        limit_val_batches=limit,
        enable_checkpointing=False,
        logger=False,
    )
    trainer.fit(FashionMNISTClassifier(), train, test)
    if trainer.is_global_zero:
        stats = strategy.last_stats
        print(
            f"lightning_fmnist: {args.compression} on {trainer.world_size} ranks: val_acc "
            f"{float(trainer.callback_metrics['val_acc']):.4f}, {stats.bits_per_value:.3f} bits "
            f"per value, {strategy.hook_state.hook_calls} hook calls"
        )


if __name__ == "__main__":
    main()
