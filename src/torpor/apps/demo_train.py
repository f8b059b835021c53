"""The demo's workload: a small, deterministic CPU PyTorch training loop that knows nothing of torpor.

``torpor.apps.demo`` runs this file twice — once directly (the reference) and once as a torpor job that
is checkpointed, hibernated and resumed — and compares what the two print. Everything that could make two
runs differ is pinned: the seeds, one intra-op thread, deterministic algorithms. ``--pace`` only sleeps
between steps (so the demo has time to act on a running job); it changes no number.

Output, one line per step and one at the end::

    step   12  loss 2.30113506
    done: 200 steps, weights sha256 3f5a…

The loss is printed with 9 significant digits, which identifies a float32 exactly.
"""

from __future__ import annotations

import argparse
import hashlib
import time

import torch
from torch import nn

FEATURES = 512
CLASSES = 10
BATCH = 128


def build(data_mib: int) -> tuple[nn.Module, torch.Tensor, torch.Tensor, torch.Generator]:
    """Model, a synthetic data set of ``data_mib`` MiB kept in memory, its labels, and the batch sampler."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    rows = max(BATCH, data_mib * 2**20 // (FEATURES * 4))
    inputs = torch.randn(rows, FEATURES, generator=generator)
    teacher = torch.randn(FEATURES, CLASSES, generator=generator)
    labels = (inputs @ teacher).argmax(dim=1)
    model = nn.Sequential(
        nn.Linear(FEATURES, 1024),
        nn.ReLU(),
        nn.Linear(1024, 1024),
        nn.ReLU(),
        nn.Linear(1024, CLASSES),
    )
    return model, inputs, labels, generator


def weights_digest(model: nn.Module) -> str:
    digest = hashlib.sha256()
    for tensor in model.state_dict().values():
        digest.update(tensor.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--pace", type=float, default=0.0, help="seconds to sleep after each step")
    parser.add_argument("--data-mib", type=int, default=128, help="size of the in-memory data set")
    args = parser.parse_args(argv)

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    model, inputs, labels, generator = build(args.data_mib)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss_fn = nn.CrossEntropyLoss()
    print(f"training: {sum(p.numel() for p in model.parameters())} parameters, {len(inputs)} samples")
    for step in range(1, args.steps + 1):
        batch = torch.randint(0, len(inputs), (BATCH,), generator=generator)
        optimizer.zero_grad()
        loss = loss_fn(model(inputs[batch]), labels[batch])
        loss.backward()
        optimizer.step()
        print(f"step {step:4d}  loss {loss.item():.9g}")
        if args.pace:
            time.sleep(args.pace)
    print(f"done: {args.steps} steps, weights sha256 {weights_digest(model)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
