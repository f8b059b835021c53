"""Deterministic training fed by a DataLoader with two worker processes (pipes, shared memory in
/dev/shm, a multiprocessing listener socket in /tmp/pymp-*): prints every batch's exact loss.

usage: train_dataloader.py EPOCHS [SLEEP_S]
"""

import sys
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

epochs = int(sys.argv[1])
pause = float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
torch.manual_seed(0)
torch.set_num_threads(1)
data = TensorDataset(torch.randn(1024, 16), torch.randn(1024, 1))
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
order = torch.Generator().manual_seed(1)
for epoch in range(epochs):
    loader = DataLoader(data, batch_size=64, shuffle=True, num_workers=2, generator=order)
    for batch, (x, y) in enumerate(loader):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        print(f"step {epoch * 100 + batch} loss {float(loss).hex()}", flush=True)
        if pause:
            time.sleep(pause)
print("done", flush=True)
