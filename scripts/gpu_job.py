"""A CUDA job written with cuda-bindings alone, for the device check (scripts/gpu-check).

It allocates ``--gib`` GiB of device memory, fills it with a seeded pattern, then transforms every word
on the GPU step after step and prints each step's checksum: ``step N CHECKSUM``. Its kernels are PTX
written here and compiled by the driver (no NVRTC, no toolkit). Integer arithmetic only, and a checksum
that does not depend on the order its parts are added in: two runs on the same GPU type print the same
lines, so a run that was checkpointed, hibernated and resumed must print exactly what an uninterrupted
run prints.

``--torch`` runs a small PyTorch training loop on the GPU instead (deterministic algorithms, seeded),
printing ``step N loss L`` with 9 significant digits, which identifies a float32 exactly.

``--bandwidth`` instead measures the plain device→host copy into pageable memory (``cuMemcpyDtoH`` of
the whole buffer into an anonymous mapping) and prints ``dtoh_pageable_bytes_per_s VALUE``: the anchor
the GPU stage is measured against, in the same run.

Needs an NVIDIA GPU and cuda-bindings (``cuda.bindings.driver``, 12.8 or later); it has not run here.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import sys
import time
from typing import Any

from cuda.bindings import driver as cu

#: each kernel's first lines: %rd3 = this thread's first word, %rd5 = the grid's stride (a grid-stride
#: loop); %rd1 = the buffer and %rd2 = its words, loaded before
INDEX = """\
    mov.u32 %r2, %ctaid.x;
    mov.u32 %r3, %ntid.x;
    mov.u32 %r4, %tid.x;
    mov.u32 %r5, %nctaid.x;
    mul.wide.u32 %rd3, %r2, %r3;
    cvt.u64.u32 %rd4, %r4;
    add.u64 %rd3, %rd3, %rd4;
    mul.wide.u32 %rd5, %r5, %r3;
"""

PTX = r"""
.version 7.0
.target sm_70
.address_size 64

.visible .entry fill(.param .u64 p_buf, .param .u64 p_n, .param .u32 p_seed)
{
    .reg .pred %p<2>;
    .reg .b32 %r<10>;
    .reg .b64 %rd<10>;
    ld.param.u64 %rd1, [p_buf];
    ld.param.u64 %rd2, [p_n];
    ld.param.u32 %r1, [p_seed];
INDEX
FILL_LOOP:
    setp.ge.u64 %p1, %rd3, %rd2;
    @%p1 bra FILL_DONE;
    cvt.u32.u64 %r6, %rd3;
    shr.u64 %rd6, %rd3, 32;
    cvt.u32.u64 %r7, %rd6;
    mad.lo.u32 %r8, %r6, 0x9E3779B1, %r1;
    mad.lo.u32 %r8, %r7, 0x85EBCA77, %r8;
    shl.b64 %rd7, %rd3, 2;
    add.u64 %rd8, %rd1, %rd7;
    st.global.u32 [%rd8], %r8;
    add.u64 %rd3, %rd3, %rd5;
    bra FILL_LOOP;
FILL_DONE:
    ret;
}

.visible .entry step(.param .u64 p_buf, .param .u64 p_n)
{
    .reg .pred %p<2>;
    .reg .b32 %r<8>;
    .reg .b64 %rd<10>;
    ld.param.u64 %rd1, [p_buf];
    ld.param.u64 %rd2, [p_n];
INDEX
STEP_LOOP:
    setp.ge.u64 %p1, %rd3, %rd2;
    @%p1 bra STEP_DONE;
    shl.b64 %rd7, %rd3, 2;
    add.u64 %rd8, %rd1, %rd7;
    ld.global.u32 %r6, [%rd8];
    mad.lo.u32 %r6, %r6, 1664525, 1013904223;
    st.global.u32 [%rd8], %r6;
    add.u64 %rd3, %rd3, %rd5;
    bra STEP_LOOP;
STEP_DONE:
    ret;
}

.visible .entry checksum(.param .u64 p_buf, .param .u64 p_n, .param .u64 p_out)
{
    .reg .pred %p<2>;
    .reg .b32 %r<8>;
    .reg .b64 %rd<14>;
    ld.param.u64 %rd1, [p_buf];
    ld.param.u64 %rd2, [p_n];
    ld.param.u64 %rd10, [p_out];
INDEX
    mov.u64 %rd11, 0;
SUM_LOOP:
    setp.ge.u64 %p1, %rd3, %rd2;
    @%p1 bra SUM_DONE;
    shl.b64 %rd7, %rd3, 2;
    add.u64 %rd8, %rd1, %rd7;
    ld.global.u32 %r6, [%rd8];
    cvt.u64.u32 %rd9, %r6;
    xor.b64 %rd9, %rd9, %rd3;
    mul.lo.u64 %rd9, %rd9, 0x9E3779B97F4A7C15;
    add.u64 %rd11, %rd11, %rd9;
    add.u64 %rd3, %rd3, %rd5;
    bra SUM_LOOP;
SUM_DONE:
    atom.global.add.u64 %rd12, [%rd10], %rd11;
    ret;
}
""".replace("INDEX\n", INDEX)

GRID, BLOCK = 4096, 256


def check(result: Any) -> Any:
    """The values of a cuda-bindings call, which returns (error, *values); raises on an error."""
    error, *values = result if isinstance(result, tuple) else (result,)
    if error != cu.CUresult.CUDA_SUCCESS:
        name = cu.cuGetErrorName(error)[1]
        raise SystemExit(f"gpu_job: CUDA error {name.decode() if isinstance(name, bytes) else name}")
    return values[0] if len(values) == 1 else values


class Kernels:
    def __init__(self) -> None:
        check(cu.cuInit(0))
        device = check(cu.cuDeviceGet(0))
        self.context = check(cu.cuDevicePrimaryCtxRetain(device))
        check(cu.cuCtxSetCurrent(self.context))
        self._ptx = ctypes.create_string_buffer(PTX.encode())  # NUL-terminated, alive while loaded
        module = check(cu.cuModuleLoadData(ctypes.addressof(self._ptx)))
        self.functions = {
            name: check(cu.cuModuleGetFunction(module, name.encode()))
            for name in ("fill", "step", "checksum")
        }

    def launch(self, name: str, *args: ctypes.c_uint64 | ctypes.c_uint32) -> None:
        pointers = (ctypes.c_void_p * len(args))(*(ctypes.addressof(arg) for arg in args))
        check(
            cu.cuLaunchKernel(
                self.functions[name], GRID, 1, 1, BLOCK, 1, 1, 0, 0, ctypes.addressof(pointers), 0
            )
        )
        check(cu.cuCtxSynchronize())


def run(gib: float, steps: int, interval_s: float, seed: int) -> None:
    kernels = Kernels()
    nbytes = int(gib * 2**30) // 4 * 4
    words = nbytes // 4
    buffer = check(cu.cuMemAlloc(nbytes))
    out = check(cu.cuMemAlloc(8))
    address, count = ctypes.c_uint64(int(buffer)), ctypes.c_uint64(words)
    kernels.launch("fill", address, count, ctypes.c_uint32(seed))

    def checksum() -> str:
        check(cu.cuMemsetD32(out, 0, 2))
        kernels.launch("checksum", address, count, ctypes.c_uint64(int(out)))
        value = ctypes.c_uint64()
        check(cu.cuMemcpyDtoH(ctypes.addressof(value), out, 8))
        return f"{value.value:016x}"

    print(f"step 0 {checksum()}", flush=True)
    for n in range(1, steps + 1):
        kernels.launch("step", address, count)
        print(f"step {n} {checksum()}", flush=True)
        if interval_s:
            time.sleep(interval_s)


def bandwidth(gib: float) -> None:
    kernels = Kernels()
    nbytes = int(gib * 2**30)
    buffer = check(cu.cuMemAlloc(nbytes))
    kernels.launch("fill", ctypes.c_uint64(int(buffer)), ctypes.c_uint64(nbytes // 4), ctypes.c_uint32(1))
    host = mmap.mmap(-1, nbytes)  # pageable: neither pinned nor registered with the driver
    target = ctypes.addressof(ctypes.c_char.from_buffer(host))
    check(cu.cuMemcpyDtoH(target, buffer, nbytes))  # the first copy faults the host pages in
    started = time.monotonic()
    check(cu.cuMemcpyDtoH(target, buffer, nbytes))
    took = time.monotonic() - started
    print(f"dtoh_pageable_bytes_per_s {nbytes / took:.0f}", flush=True)


def train(steps: int, interval_s: float, seed: int) -> None:
    import os

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS's deterministic mode
    import torch
    from torch import nn

    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    model = nn.Sequential(nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 10)).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = torch.randn(4096, 1024, generator=torch.Generator().manual_seed(seed)).cuda()
    labels = torch.randint(0, 10, (4096,), generator=torch.Generator().manual_seed(seed + 1)).cuda()
    for n in range(1, steps + 1):
        rows = torch.arange((n * 256) % 4096, (n * 256) % 4096 + 256, device="cuda")
        loss = nn.functional.cross_entropy(model(data[rows]), labels[rows])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        print(f"step {n} loss {loss.item():.9g}", flush=True)
        if interval_s:
            time.sleep(interval_s)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=8.0)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--interval", type=float, default=0.0, help="seconds between steps")
    parser.add_argument("--seed", type=int, default=20261207)
    parser.add_argument("--bandwidth", action="store_true")
    parser.add_argument("--torch", action="store_true")
    args = parser.parse_args()
    if args.bandwidth:
        bandwidth(args.gib)
    elif args.torch:
        train(args.steps, args.interval, args.seed)
    else:
        run(args.gib, args.steps, args.interval, args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
