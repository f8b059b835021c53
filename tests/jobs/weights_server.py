"""A server whose cold start is reading a large weights file, run as a torpor job by the warm-start benchmark.

It reads the whole file into memory (one bytearray: every page of it written), hashes what it read
(BLAKE2b), and then answers ``GET /`` with JSON ``{"digest": HEX, "bytes": N, "pid": PID}`` over the
standard library's ThreadingHTTPServer. It prints ``loaded N bytes in … s``, then ``ready on PORT``
once it listens. Its start costs what a model server's weights cost: reading and touching every byte.

usage: weights_server.py FILE [--host 127.0.0.1] [--port N]
       weights_server.py --make FILE --size BYTES [--seed S]   (write a file of random bytes and exit)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

PIECE = 64 * 2**20


def make_weights(path: Path, size: int, seed: int = 0) -> None:
    """Write ``size`` bytes of random data to ``path`` quickly (numpy's PCG64: over 1 GiB/s here).

    Every piece differs from every other, so a store that keeps each chunk once (torpor's) stores it all:
    a file of one repeated block would checkpoint into almost nothing.
    """
    try:
        import numpy as np
    except ImportError:
        np = None
    generator = np.random.PCG64(seed) if np is not None else None
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as out:
        left = size
        while left > 0:
            n = min(PIECE, left)
            if generator is None:  # slower, but the same kind of bytes
                out.write(os.urandom(n))
            else:
                out.write(memoryview(generator.random_raw((n + 7) // 8)).cast("B")[:n])
            left -= n
    os.replace(tmp, path)


def load(path: Path) -> bytearray:
    """The file's bytes, all of them read into one bytearray (which writes every page of it)."""
    size = path.stat().st_size
    data = bytearray(size)
    view = memoryview(data)
    with open(path, "rb", buffering=0) as source:
        done = 0
        while done < size:
            n = source.readinto(view[done : done + PIECE])
            if not n:
                raise OSError(f"{path} ended at byte {done} of {size}")
            done += n
    return data


def serve(path: Path, host: str, port: int) -> None:
    started = time.monotonic()
    data = load(path)
    digest = hashlib.blake2b(data, digest_size=32).hexdigest()
    answer = json.dumps({"digest": digest, "bytes": len(data), "pid": os.getpid()}).encode()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, format: str, *args: object) -> None:  # a benchmark polls every 5 ms
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    print(f"loaded {len(data)} bytes in {time.monotonic() - started:.3f} s; blake2b {digest}", flush=True)
    print(f"ready on {server.server_address[1]}", flush=True)
    server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("file", type=Path, nargs="?")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--make", type=Path, help="write a weights file of --size random bytes and exit")
    parser.add_argument("--size", type=int, help="bytes of the file --make writes")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.make is not None:
        if args.size is None or args.size < 0:
            parser.error("--make needs --size BYTES (0 or more)")
        make_weights(args.make, args.size, args.seed)
        return
    if args.file is None:
        parser.error("give the weights FILE to serve (or --make FILE --size BYTES)")
    serve(args.file, args.host, args.port)


if __name__ == "__main__":
    main()
