"""Benchmark workload: a CPU training process (an MLP and its Adam state) and framework checkpointing.

``scripts/bench.py`` uses it three ways, always with the same model and optimizer state:

* ``serve``: train a step, sleep, repeat — the running job torpor checkpoints; with ``--tick`` a thread
  also ticks every 5 ms and prints ``gap S s`` for every tick more than 20 ms late (how long a checkpoint
  froze it, as the job feels it: ``scripts/bench_freeze.py`` reads these);
* ``save PATH``: after the same warm-up steps, time ``torch.save`` of model + optimizer state,
  ``torch.load`` of it back into the model and optimizer (in this process), and ``torch.save`` into
  another file then fsynced (durable, what torpor's time until durable compares with), a few times;
  print JSON;
* ``restart PATH``: what resuming from a ``torch.save`` file costs a fresh process — start Python, import
  torch, build the model and optimizer, load the file; print JSON with the time spent in this process.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

import torch
from bench_memory import tick
from torch import nn

BATCH = 8


def build(layers: int, hidden: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU()) for _ in range(layers)))
    return model, torch.optim.Adam(model.parameters(), lr=1e-4)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, hidden: int) -> float:
    optimizer.zero_grad(set_to_none=False)  # keep the gradients allocated: a steady footprint to dump
    loss = model(torch.randn(BATCH, hidden)).square().mean()
    loss.backward()
    optimizer.step()
    return float(loss.item())


def state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, object]:
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["serve", "save", "restart"])
    parser.add_argument("path", nargs="?")
    parser.add_argument("--layers", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--pace", type=float, default=0.5)
    parser.add_argument("--tick", action="store_true", help="serve: report the gaps of a 5 ms loop")
    args = parser.parse_args()
    started = time.monotonic()
    torch.set_num_threads(1)
    model, optimizer = build(args.layers, args.hidden)
    params = sum(p.numel() for p in model.parameters())

    if args.mode == "restart":
        loaded = torch.load(args.path, weights_only=True)
        model.load_state_dict(loaded["model"])
        optimizer.load_state_dict(loaded["optimizer"])
        print(json.dumps({"params": params, "in_process_s": time.monotonic() - started}), flush=True)
        return 0

    for _ in range(2):  # Adam's moments exist only after a step
        train_step(model, optimizer, args.hidden)

    if args.mode == "save":
        results = []
        for _ in range(args.repeat):
            began = time.monotonic()
            torch.save(state(model, optimizer), args.path)
            save_s = time.monotonic() - began
            size = os.path.getsize(args.path)
            began = time.monotonic()
            loaded = torch.load(args.path, weights_only=True)
            model.load_state_dict(loaded["model"])
            optimizer.load_state_dict(loaded["optimizer"])
            load_s = time.monotonic() - began
            del loaded
            synced = f"{args.path}.fsync"
            began = time.monotonic()
            with open(synced, "wb") as file:
                torch.save(state(model, optimizer), file)
                file.flush()
                os.fsync(file.fileno())
            save_fsync_s = time.monotonic() - began
            os.unlink(synced)
            results.append({"save_s": save_s, "save_fsync_s": save_fsync_s, "load_s": load_s, "bytes": size})
        print(json.dumps({"params": params, "runs": results}), flush=True)
        return 0

    if args.tick:
        threading.Thread(target=tick, daemon=True).start()
    print(f"ready: {params} parameters", flush=True)
    step = 0
    while True:
        step += 1
        loss = train_step(model, optimizer, args.hidden)
        if step % 20 == 0:
            print(f"step {step} loss {loss:.6g}", flush=True)
        time.sleep(args.pace)


if __name__ == "__main__":
    sys.exit(main())
