"""The simplest store: one folder per checkpoint, each file hashed with BLAKE3 in a manifest.

Layout under ``images/``::

    <checkpoint-id>/            complete images only
        manifest.json           written last, atomically: format, job, per-file size and hash
        <CRIU image files>
    .<checkpoint-id>.partial/   an image being dumped or put; never listed, so a crash leaves no half image

``put`` renames the dump folder into place (same file system: no copy), ``get`` hard-links the files into
the restore folder when it can — CRIU only reads them — and reads every byte once to verify it.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import blake3

from torpor.core.store.base import StoredImage
from torpor.errors import CheckpointNotFound, CorruptImage, StorageFull, StoreError

FORMAT = "torpor-folder-image"
FORMAT_VERSION = 1
_CHUNK = 4 << 20


def _hash_file(path: Path) -> str:
    hasher = blake3.blake3()
    with open(path, "rb") as handle:
        while block := handle.read(_CHUNK):
            hasher.update(block)
    return str(hasher.hexdigest())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def _store_error(exc: OSError, what: str) -> StoreError:
    if exc.errno == errno.ENOSPC:
        return StorageFull(f"{what}: no space left on device; free space or move TORPOR_HOME")
    return StoreError(f"{what}: {exc.strerror or exc}")


def _safe_name(name: str) -> bool:
    return bool(name) and "/" not in name and name not in (".", "..") and "\0" not in name


class FolderStore:
    def __init__(self, root: Path) -> None:
        self.root = root

    def _dir(self, checkpoint_id: str) -> Path:
        if not _safe_name(checkpoint_id) or checkpoint_id.startswith("."):
            raise CheckpointNotFound(f"'{checkpoint_id}' is not a checkpoint id")
        return self.root / checkpoint_id

    def _manifest(self, checkpoint_id: str) -> dict[str, object]:
        path = self._dir(checkpoint_id) / "manifest.json"
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError as exc:
            raise CheckpointNotFound(f"checkpoint {checkpoint_id} has no image in {self.root}") from exc
        except (OSError, ValueError) as exc:
            raise CorruptImage(f"the manifest of checkpoint {checkpoint_id} is unreadable ({exc})") from exc
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise CorruptImage(f"checkpoint {checkpoint_id}: {path} is not a torpor image manifest")
        if data.get("version") != FORMAT_VERSION:
            raise StoreError(
                f"checkpoint {checkpoint_id} has image format {data.get('version')}; this torpor reads "
                f"{FORMAT_VERSION}"
            )
        return data

    def staging_dir(self, checkpoint_id: str) -> Path:
        partial = self.root / f".{self._dir(checkpoint_id).name}.partial"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir()
        except OSError as exc:
            raise _store_error(exc, f"cannot create a staging folder in {self.root}") from exc
        return partial

    def discard(self, image_dir: Path) -> None:
        shutil.rmtree(image_dir, ignore_errors=True)

    def put(self, checkpoint_id: str, job: str, image_dir: Path) -> StoredImage:
        final = self._dir(checkpoint_id)
        partial = self.root / f".{checkpoint_id}.partial"
        try:
            if image_dir != partial:
                shutil.rmtree(partial, ignore_errors=True)
                shutil.copytree(image_dir, partial)
            files = {}
            total = 0
            for entry in sorted(partial.iterdir()):
                if not entry.is_file() or entry.name == "manifest.json":
                    continue
                size = entry.stat().st_size
                files[entry.name] = {"size": size, "blake3": _hash_file(entry)}
                total += size
            manifest = {
                "format": FORMAT,
                "version": FORMAT_VERSION,
                "job": job,
                "id": checkpoint_id,
                "files": files,
            }
            _write_atomic(partial / "manifest.json", json.dumps(manifest, indent=1).encode())
            os.rename(partial, final)
            _fsync_dir(self.root)
        except OSError as exc:
            (partial / "manifest.json").unlink(missing_ok=True)
            if image_dir != partial:
                shutil.rmtree(partial, ignore_errors=True)
            raise _store_error(exc, f"cannot store checkpoint {checkpoint_id} in {self.root}") from exc
        if image_dir != partial:
            shutil.rmtree(image_dir, ignore_errors=True)
        return StoredImage(checkpoint_id, job, total, total)

    def get(self, checkpoint_id: str, dest: Path) -> None:
        manifest = self._manifest(checkpoint_id)
        source = self._dir(checkpoint_id)
        files = manifest.get("files")
        if not isinstance(files, dict):
            raise CorruptImage(f"the manifest of checkpoint {checkpoint_id} lists no files")
        dest.mkdir(parents=True, exist_ok=True)
        for name, entry in files.items():
            if not _safe_name(name) or not isinstance(entry, dict):
                raise CorruptImage(f"checkpoint {checkpoint_id}: the manifest names a bad file {name!r}")
            target = dest / name
            try:
                os.link(source / name, target)
            except FileNotFoundError as exc:
                raise CorruptImage(f"checkpoint {checkpoint_id} is missing its file {name}") from exc
            except OSError:
                shutil.copyfile(source / name, target)
            if target.stat().st_size != entry.get("size") or _hash_file(target) != entry.get("blake3"):
                raise CorruptImage(
                    f"checkpoint {checkpoint_id} is corrupt: {name} does not match its hash; "
                    "restore an older checkpoint with --from"
                )

    def list(self) -> list[StoredImage]:
        if not self.root.is_dir():
            return []
        images = []
        for entry in sorted(self.root.iterdir()):
            if entry.name.startswith(".") or not (entry / "manifest.json").exists():
                continue
            try:
                manifest = self._manifest(entry.name)
            except StoreError:
                continue
            files = manifest.get("files")
            size = sum(int(f["size"]) for f in files.values()) if isinstance(files, dict) else 0
            images.append(StoredImage(entry.name, str(manifest.get("job")), size, size))
        return images

    def delete(self, checkpoint_id: str) -> None:
        path = self._dir(checkpoint_id)
        if path.exists():
            # rename first so a crash mid-delete never leaves a half image that looks complete
            doomed = self.root / f".{checkpoint_id}.deleting"
            os.rename(path, doomed)
            shutil.rmtree(doomed, ignore_errors=True)
