"""The Fashion-MNIST CNN of scripts/train.py under Hugging Face Accelerate, compressed by
hvdcompress: Accelerate's usual loop, with one line added after ``prepare``.

    pip install 'hvdcompress[accelerate]'
    accelerate launch --multi_gpu --num_processes 2 examples/accelerate_fmnist.py --cpu

(``--multi_gpu`` is the name of Accelerate's multi-process launcher; with ``--cpu`` the
script's Accelerator runs on CPUs over gloo. Drop ``--cpu`` on GPUs.)
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset

import hvdcompress.accelerate
from hvdcompress.training.data import load_fashion_mnist
from hvdcompress.training.models import build_model


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compression", default="3lc")
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--max-steps", type=int, default=None, help="per epoch")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument(
        "--no-tuning", action="store_true", help="keep exchange='auto''s first guess"
    )
    args = parser.parse_args(argv)

    accelerator = Accelerator(cpu=args.cpu)
    torch.manual_seed(42)
    (x, y), (tx, ty) = load_fashion_mnist()
    train = DataLoader(TensorDataset(x, y), batch_size=args.batch_size, shuffle=True)
    test = DataLoader(TensorDataset(tx, ty), batch_size=1000)
    model = build_model("cnn")
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    model, optimizer, train, test = accelerator.prepare(model, optimizer, train, test)
    tuning = None if args.no_tuning else hvdcompress.Tuning()  # docs/exchanges.md
    state = hvdcompress.accelerate.register(
        accelerator, model, compression=args.compression, tuning=tuning
    )

    for epoch in range(args.epochs):
        model.train()
        for step, (xb, yb) in enumerate(train):
            if args.max_steps is not None and step >= args.max_steps:
                break
            optimizer.zero_grad()
            loss = F.cross_entropy(model(xb), yb)
            accelerator.backward(loss)
            optimizer.step()
        model.eval()
        correct = total = 0
        with torch.no_grad():
            for xb, yb in test:
                hits = accelerator.gather_for_metrics((model(xb).argmax(1) == yb).long())
                correct, total = correct + int(hits.sum()), total + hits.numel()
        if accelerator.is_main_process:
            bits = state.last_stats.bits_per_value if state is not None else 32.0
            print(
                f"accelerate_fmnist: epoch {epoch + 1}: test accuracy {correct / total:.4f}, "
                f"loss {loss.item():.4f}, {bits:.3f} bits per value ({args.compression})",
                flush=True,
            )
    # as the README's recipe: end the hook's threads and process groups, then the world's,
    # so that no gloo thread is left to be torn down at interpreter exit (an abort)
    if state is not None:
        state.close()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
