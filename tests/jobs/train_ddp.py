"""A deterministic DDP training loop for torchrun: gloo on CPU, fixed seeds, each rank prints its losses.

usage: torchrun --nproc-per-node N --standalone train_ddp.py STEPS [SLEEP_S] — an uninterrupted run and a
checkpointed/restored one must print the same ``rank R step N loss X`` lines (X is the float's repr, which
round-trips, so equality is bit-for-bit). Each line is one write(2), so ranks sharing a log never mix one.
"""

import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

steps = int(sys.argv[1])
pause = float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(1234)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
torch.set_num_threads(1)
inputs = torch.randn(512, 32)
targets = torch.randn(512, 1)
model = DistributedDataParallel(
    torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
generator = torch.Generator().manual_seed(99 + rank)  # each rank its own batches
for step in range(steps):
    batch = torch.randint(0, inputs.shape[0], (32,), generator=generator)
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(model(inputs[batch]), targets[batch])
    loss.backward()  # gradients averaged across the ranks over gloo (TCP on loopback)
    optimizer.step()
    os.write(1, f"rank {rank} step {step} loss {float(loss.detach())!r}\n".encode())
    if pause:
        time.sleep(pause)
dist.barrier()
os.write(1, f"rank {rank} done\n".encode())
dist.destroy_process_group()
