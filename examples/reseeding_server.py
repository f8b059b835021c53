"""A server that knows when it was restored: a copy started from a torpor template reseeds itself.

A job started from a template (``torpor run --from-template``) continues the template's memory: the same
random-number state, the same start time, the same environment. Two copies of this server would hand
out the same "random" tokens. torpor sends every process of a restored job that handles ``SIGCONT`` one
``SIGCONT`` once it runs again; this server handles it by reseeding its generator from the system's and
asking ``torpor whoami`` which job it is now (its environment is the template's, so it cannot say).

    torpor run --name web -- python examples/reseeding_server.py 8000
    torpor template save web-ready web
    torpor rm --force web
    torpor run --from-template web-ready --name copy1
    curl -s 127.0.0.1:8000        # {"job": "copy1", "token": ..., "restores": 1}

Without torpor it is an ordinary server (``whoami`` then says it runs on its own).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

state: dict[str, Any] = {"job": None, "restores": 0}
generator = random.Random(1234)  # deterministic on purpose: what a copy must not repeat
restored = threading.Event()


def whoami() -> str | None:
    """The torpor job this process is in, or None when it runs on its own."""
    torpor = shutil.which("torpor") or os.path.join(os.path.dirname(sys.executable), "torpor")
    try:
        out = subprocess.run([torpor, "whoami", "--json"], capture_output=True, text=True, timeout=10)
    except OSError:
        return None
    return json.loads(out.stdout)["job"] if out.returncode == 0 else None


def after_restore() -> None:
    """Runs in a thread of its own, not in the signal handler: reseed, and learn who we are now."""
    while True:
        restored.wait()
        restored.clear()
        generator.seed(os.urandom(32))
        state["restores"] += 1
        state["job"] = whoami()
        print(f"restored as job {state['job']}: reseeded", flush=True)


class Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = json.dumps({"job": state["job"], "token": generator.random(), "restores": state["restores"]})
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body.encode() + b"\n")

    def log_message(self, format: str, *args: Any) -> None:
        pass


def main() -> None:
    port = int(sys.argv[1]) if len(sys.argv) > 1 else 8000
    host = sys.argv[2] if len(sys.argv) > 2 else "127.0.0.1"  # 0.0.0.0 for copies with --own-network
    signal.signal(signal.SIGCONT, lambda *_: restored.set())
    threading.Thread(target=after_restore, daemon=True).start()
    state["job"] = whoami()
    server = ThreadingHTTPServer((host, port), Handler)
    print(f"ready on {port} as job {state['job']}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
