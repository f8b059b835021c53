"""A deterministic CPU PyTorch training loop: fixed seeds, one thread, prints every step's exact loss.

usage: train.py STEPS [SLEEP_S [GATE_STEP GATE_FILE]]   — an uninterrupted run and a checkpointed/restored
one must print the same ``step N loss X`` lines (X is float.hex, so equality is bit-for-bit). With a gate,
the job waits before step GATE_STEP until GATE_FILE exists: a test can stop it mid-run however slow the
machine is, and the job it resumes goes on once the test made the file.
"""

import os
import sys
import time

import torch

steps = int(sys.argv[1])
pause = float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
torch.manual_seed(1234)
torch.set_num_threads(1)
inputs = torch.randn(512, 32)
targets = torch.randn(512, 1)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
generator = torch.Generator().manual_seed(99)
gate_step, gate_file = (int(sys.argv[3]), sys.argv[4]) if len(sys.argv) > 4 else (None, "")
for step in range(steps):
    while step == gate_step and not os.path.exists(gate_file):
        time.sleep(0.05)
    batch = torch.randint(0, inputs.shape[0], (64,), generator=generator)
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(model(inputs[batch]), targets[batch])
    loss.backward()
    optimizer.step()
    print(f"step {step} loss {float(loss).hex()}", flush=True)
    if pause:
        time.sleep(pause)
print("done", flush=True)
