"""Handing a restore to the launcher that waits for it, with what must run beside CRIU in the CLI.

Streamed, the CLI serves CRIU the image (:class:`~torpor.adapters.imagestreamer.ImageStreamer`), the
pages straight from the store; otherwise it verifies the pages while CRIU reads them, and CRIU holds the
restored tree until the verdict (:class:`~torpor.adapters.criu.RestoreGate`). What the launcher then does
is :func:`torpor.core.restore.restore_into_launcher`.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path

from torpor.adapters.imagestreamer import ImageStreamer
from torpor.core.context import Context, Progress
from torpor.core.launcher.protocol import PendingLauncher, RestoreSpec
from torpor.core.recordtypes import CheckpointId
from torpor.core.store import Check, PageStream, RestoreSource
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


def fetch_and_release(
    ctx: Context,
    launcher: PendingLauncher,
    checkpoint_id: CheckpointId,
    size_bytes: int,
    image_dir: Path,
    progress: Progress,
    prepare: Callable[[], None],
    *,
    lazy: bool = False,
    copy_of: str | None = None,
    net_namespace: str | None = None,
    net_external: bool = False,
) -> None:
    """Bring checkpoint ``checkpoint_id``'s image into ``image_dir`` the way the store says (streamed,
    lazily, or fetched and verified while CRIU reads it), run ``prepare`` (the job's world made ready for
    it), then let the waiting ``launcher`` restore it; returns once the job runs.

    ``copy_of``, ``net_namespace``, ``net_external``: as :class:`RestoreSpec` has them.
    """
    progress(f"fetching checkpoint {checkpoint_id} ({size_bytes / 2**20:.0f} MiB), verifying")
    source = ctx.store.restore_source(checkpoint_id, lazy=lazy, stream=ctx.settings.stream_restore)
    pages: PageStream | None = None
    try:
        check: Check | None = None
        if source == RestoreSource.LAZY_SERVED:
            # from the cold tier, memory comes in page by page (each chunk verified as it is fetched)
            ctx.store.prepare_lazy(checkpoint_id, image_dir)
        elif source == RestoreSource.LAZY_LOCAL:
            # an image in RAM is verified whole first, then CRIU's own daemon serves it
            ctx.store.get(checkpoint_id, image_dir)
        elif source == RestoreSource.COLD_STREAMED:
            pages = ctx.store.stream_pages(checkpoint_id, image_dir)
        else:  # HOT_LINKED, COLD_WHOLE: all but the pages verified now, those while CRIU reads them
            check = ctx.store.fetch(checkpoint_id, image_dir)
        prepare()
        spec = RestoreSpec(
            image_dir=str(image_dir),
            checkpoint_id=checkpoint_id,
            lazy=lazy,
            served=source == RestoreSource.LAZY_SERVED,
            stream=pages is not None,
            copy_of=copy_of,
            net_namespace=net_namespace,
            net_external=net_external,
        )
        if pages is not None:
            progress("restoring with criu; memory streams in from the store, each chunk verified first")
            release_streamed(launcher, spec, image_dir, pages)
        elif check is None:
            progress("restoring with criu")
            launcher.release(spec)
        else:
            progress("restoring with criu; the job runs once its memory pages are verified")
            release_gated(ctx, launcher, spec, image_dir, check)
    finally:
        if pages is not None:
            pages.close()
