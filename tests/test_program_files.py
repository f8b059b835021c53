"""procfs.program_files: the files that make a running program what it is (what a template stamps), on a
real process: mapped and read-only ones in, its own output and data out."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from torpor.adapters.system import procfs

HOLDER = """
import mmap, os, sys, time
folder = sys.argv[1]
model = open(os.path.join(folder, "model.bin"), "rb")
weights = mmap.mmap(model.fileno(), 0, prot=mmap.PROT_READ)  # mapped read-only: part of the program
config = open(os.path.join(folder, "config.txt"))  # open read-only: part of it too
out = open(os.path.join(folder, "out.log"), "a")  # its output: it changes it itself
data_fd = os.open(os.path.join(folder, "data.bin"), os.O_RDWR)
data = mmap.mmap(data_fd, 4096)  # mapped shared and writable: its data
os.close(data_fd)
gone = open(os.path.join(folder, "gone.txt"))
os.unlink(os.path.join(folder, "gone.txt"))  # deleted while open
print("ready", flush=True)
time.sleep(60)
"""


def test_mapped_and_read_only_files_are_the_programs_and_its_output_and_data_are_not(tmp_path: Path) -> None:
    for name, size in (("model.bin", 8192), ("config.txt", 10), ("data.bin", 4096), ("gone.txt", 3)):
        (tmp_path / name).write_bytes(b"x" * size)
    with subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True
    ) as child:
        try:
            assert child.stdout is not None and child.stdout.readline() == "ready\n"
            found = procfs.program_files([child.pid])
        finally:
            child.kill()
    ours = {Path(path).name for path in found if Path(path).parent == tmp_path}
    assert ours == {"model.bin", "config.txt"}
    assert str(Path(sys.executable).resolve()) in found  # the interpreter it runs
    assert found == sorted(found)
