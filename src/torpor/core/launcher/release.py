"""Handing a restore to the launcher that waits for it, with what must run beside CRIU in the CLI.

Streamed, the CLI serves CRIU the image (:class:`~torpor.adapters.imagestreamer.ImageStreamer`), the
pages straight from the store; otherwise it verifies the pages while CRIU reads them, and CRIU holds the
restored tree until the verdict (:class:`~torpor.adapters.criu.RestoreGate`). What the launcher then does
is :func:`torpor.core.restore.restore_into_launcher`.
"""

from __future__ import annotations

import os
import threading
from dataclasses import replace
from functools import partial
from pathlib import Path

from torpor.adapters.imagestreamer import ImageStreamer
from torpor.core.context import Context
from torpor.core.launcher.protocol import PendingLauncher, RestoreSpec
from torpor.core.store import Check, PageStream
from torpor.errors import StoreError, TorporError


def release_streamed(
    launcher: PendingLauncher, spec: RestoreSpec, image_dir: Path, pages: PageStream
) -> None:
    """Let the launcher run ``criu restore --stream`` while this process hands CRIU the image.

    The files in ``image_dir`` (verified already) go to CRIU as they are; the memory pages come from
    the store straight into CRIU's pipe, with no copy in RAM first, each chunk verified before it is
    written. A damaged chunk cuts its file short, so CRIU fails before the job runs.
    """
    streamer = ImageStreamer(image_dir, {name: partial(pages.write, name) for name in pages.names})
    streamer.start()
    try:
        launcher.release(spec)
    except TorporError as exc:
        streamer.stop()
        if isinstance(streamer.error, TorporError):  # says more than "criu restore failed"
            raise streamer.error from exc
        raise
    finally:
        streamer.stop()


def release_gated(
    ctx: Context, launcher: PendingLauncher, spec: RestoreSpec, image_dir: Path, check: Check
) -> None:
    """Let the launcher restore while this process runs ``check``; the job runs only if it passes.

    CRIU reads the pages while they are verified (two cores at work instead of one after the
    other) and holds the restored tree at its post-restore step until the verdict (RestoreGate).
    """
    gate = ctx.restore_gate(image_dir / ".torpor-verdict", os.getpid())
    failed: list[TorporError] = []

    def verify() -> None:
        try:
            check()
        except TorporError as exc:
            failed.append(exc)
            gate.shut(exc.message)
        except BaseException as exc:  # whatever went wrong, unverified memory must not run
            failed.append(StoreError(f"verifying the image failed: {exc}"))
            gate.shut(str(exc))
            raise
        else:
            gate.open()

    verifier = threading.Thread(target=verify, name="verify", daemon=True)
    verifier.start()
    try:
        launcher.release(replace(spec, gate=str(gate.verdict), gate_pid=os.getpid()))
    finally:
        verifier.join()
        if failed:  # the image's own error says more than "criu restore failed"
            raise failed[0]
