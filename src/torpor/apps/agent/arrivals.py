"""The routes a peer's agent calls on this one to move a job here (issue 30): so far the look before the
freeze, ``POST /v1/arrivals/look`` (:func:`torpor.core.migrate.look`). Over TCP they need the bearer
token, as every route does; the image's transfer and the hand-off's messages are not built yet.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, Field

from torpor.core import migrate


class LookRequest(BaseModel):
    paths: list[str] = Field(default_factory=list, max_length=migrate.MAX_LOOKED_AT)
    ports: list[int] = Field(default_factory=list, max_length=migrate.MAX_LOOKED_AT)


def add_routes(app: FastAPI) -> None:
    @app.post("/v1/arrivals/look")
    def look(body: LookRequest) -> dict[str, Any]:
        """Before a job is moved here: each of ``paths`` as it is here (``[size, mtime_ns]``, or null:
        not here, or not a regular file), and which of ``ports`` a process listens on here."""
        return migrate.look(body.paths, body.ports)
