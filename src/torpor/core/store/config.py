"""The store configuration of a state directory: which cold tier, with which key, keeping how many.

It lives in ``HOME/store.json`` (a format name and version, mode 0600, written atomically: temp file,
fsync, rename), so that every process working on one state directory — the CLI, each job's launcher,
the destager — stores and reads images in the same place with the same key, whatever environment each
of them was started with:

* the first command on a fresh state directory writes it from its environment (``TORPOR_STORE``,
  ``TORPOR_S3_ENDPOINT``, ``TORPOR_KEY_FILE``, ``TORPOR_KEEP_LAST``), each value checked first and a bad
  one refused, naming its variable;
* a later command whose environment sets one of them to another value is refused, with the configured
  value and the ``torpor store set`` that changes it — never silently one or the other;
* ``torpor store set`` changes it; a long-lived process (a launcher) sees the change at its next use,
  as :class:`ConfigFile` looks at the file each time (one ``stat``; a rename gives it a new inode).

What is not here stays a setting of each process (:class:`~torpor.settings.Settings`): the hot tier's
folder and capacity, the worker threads and streamed restores say how this machine works, not where a
job's images are or who can read them.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from torpor.core.store.backend import normalize_url
from torpor.core.store.objects import read_key_file
from torpor.errors import EnvironmentProblem, TorporError, UsageError
from torpor.settings import STORE_VARIABLES

FILE = "store.json"
FORMAT = "torpor-store-config"
VERSION = 1

#: the ``torpor store set`` flag of each field
FLAGS = {"url": "--url", "s3_endpoint": "--s3-endpoint", "key_file": "--key-file", "keep_last": "--keep-last"}


@dataclass(frozen=True)
class StoreConfig:
    """The store settings every process of one state directory shares."""

    #: the cold tier: an absolute folder path or ``s3://BUCKET[/PREFIX]``; ``None``: ``HOME/images``
    url: str | None = None
    #: S3 endpoint URL for S3-compatible servers (MinIO, Ceph, moto); credentials: boto3's usual chain
    s3_endpoint: str | None = None
    #: encrypt stored images (AES-256-GCM) with the 32-byte key in this file
    key_file: Path | None = None
    #: keep this many newest checkpoints per job, plus pinned ones; 0 keeps all
    keep_last: int = 0

    def cold_url(self, home: Path) -> str:
        return self.url or str(home / "images")

    def place(self, home: Path) -> tuple[str, str | None]:
        """Where the images are: two configurations with the same place see the same checkpoints."""
        return self.cold_url(home), self.s3_endpoint if self.cold_url(home).startswith("s3://") else None

    def replace(self, **changes: Any) -> StoreConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "s3_endpoint": self.s3_endpoint,
            "key_file": str(self.key_file) if self.key_file else None,
            "keep_last": self.keep_last,
        }

    def shown(self, field: str, home: Path) -> str:
        """One field as a person reads it (in errors and ``torpor store show``)."""
        if field == "url":
            return self.cold_url(home)
        if field == "s3_endpoint":
            return self.s3_endpoint or "none (AWS)"
        if field == "key_file":
            return str(self.key_file) if self.key_file else "no key file, images stored unencrypted"
        return f"keep the last {self.keep_last}" if self.keep_last else "keep all checkpoints"


@dataclass(frozen=True)
class Disagreement:
    """A store variable of this process's environment that differs from the state directory's value."""

    variable: str
    given: str
    configured: str
    fix: str
    file: str

    @property
    def message(self) -> str:
        return (
            f"{self.variable}={self.given} differs from the store configuration in {self.file}, which says: "
            f"{self.configured}; change it with '{self.fix}', or unset {self.variable} to use that"
        )

    def to_dict(self) -> dict[str, str]:
        return dataclasses.asdict(self)


# -- checking values ---------------------------------------------------------------------------------


def parse_value(field: str, text: str, source: str, home: Path) -> Any:
    """One store setting from text, checked; ``source`` (a variable or a flag) is named when refused."""

    def refuse(reason: str) -> UsageError:
        return UsageError(f"{source}={text!r}: {reason}")

    if field == "url":
        try:
            url = normalize_url(text)
        except UsageError as exc:
            raise refuse(exc.message) from None
        return None if url == str(home / "images") else url
    if field == "s3_endpoint":
        parts = urlsplit(text.strip())
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise refuse("an S3 endpoint is an http:// or https:// URL, e.g. http://127.0.0.1:9000")
        return text.strip().rstrip("/")
    if field == "key_file":
        if not text.strip():
            raise refuse("a key file needs a path")
        path = Path(text).absolute()
        try:
            read_key_file(path)
        except TorporError as exc:
            raise refuse(exc.message) from None
        return path
    if field == "keep_last":
        try:
            value = int(text)
        except ValueError:
            raise refuse("not a whole number") from None
        if value < 0:
            raise refuse("must not be negative")
        return value
    raise ValueError(f"no store setting {field!r}")


def parse_values(values: Mapping[str, str], names: Mapping[str, str], home: Path) -> dict[str, Any]:
    """The fields ``values`` (text by field) set, checked; ``names`` names each field's source."""
    return {field: parse_value(field, text, names[field], home) for field, text in values.items()}


def from_variables(variables: Mapping[str, str], home: Path) -> dict[str, Any]:
    """The fields the store variables in ``variables`` (an environment) set, checked."""
    by_variable = {variable: field for field, variable in STORE_VARIABLES.items()}
    given = {by_variable[name]: text for name, text in variables.items() if name in by_variable and text}
    return parse_values(given, STORE_VARIABLES, home)


def disagreements(config: StoreConfig, variables: Mapping[str, str], home: Path) -> list[Disagreement]:
    """The store variables in ``variables`` whose (checked) value differs from ``config``."""
    found = []
    for field, value in from_variables(variables, home).items():
        if getattr(config, field) != value:
            variable = STORE_VARIABLES[field]
            given = config.replace(**{field: value}).shown(field, home)
            shown_fix = str(value) if value is not None else given
            fix = f"torpor store set {FLAGS[field]} {shown_fix}"
            found.append(
                Disagreement(
                    variable, variables[variable], config.shown(field, home), fix, str(path_of(home))
                )
            )
    return found


# -- the file ----------------------------------------------------------------------------------------


def path_of(home: Path) -> Path:
    return home / FILE


def load(home: Path) -> StoreConfig | None:
    """The state directory's store configuration; ``None`` if it has none yet."""
    path = path_of(home)
    try:
        with open(path, "rb") as handle:
            mode = os.fstat(handle.fileno()).st_mode
            raw = handle.read()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise EnvironmentProblem(f"cannot read the store configuration {path}: {exc.strerror}") from exc
    if mode & 0o022:
        # it says where memory images go and which key seals them: only its owner may change it
        raise EnvironmentProblem(
            f"the store configuration {path} is writable by others (mode {mode & 0o777:o}); "
            f"check its values ('torpor store show'), then 'chmod 600 {path}'"
        )
    return _parse(raw, path)


def _parse(raw: bytes, path: Path) -> StoreConfig:
    def damaged(why: str) -> UsageError:
        return UsageError(
            f"the store configuration {path} is damaged ({why}); remove it and set the store again "
            "with 'torpor store set'"
        )

    try:
        data = json.loads(raw)
    except ValueError:
        raise damaged("not JSON") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise damaged(f"not a {FORMAT} file")
    if data.get("version") != VERSION:
        raise damaged(f"format version {data.get('version')!r}; this torpor reads {VERSION}")
    url, endpoint, key, keep = (data.get(name) for name in ("url", "s3_endpoint", "key_file", "keep_last"))
    if not all(value is None or isinstance(value, str) for value in (url, endpoint, key)):
        raise damaged("url, s3_endpoint and key_file must be text or null")
    if not isinstance(keep, int) or isinstance(keep, bool) or keep < 0:
        raise damaged("keep_last must be a whole number, 0 or more")
    try:
        normalized = normalize_url(url) if url else None
    except UsageError as exc:
        raise damaged(exc.message) from None
    return StoreConfig(normalized, endpoint, Path(key) if key else None, keep)


def _encode(config: StoreConfig) -> bytes:
    return json.dumps({"format": FORMAT, "version": VERSION, **config.to_dict()}, indent=2).encode() + b"\n"


def _write_temp(home: Path, config: StoreConfig) -> Path:
    tmp = home / f".{FILE}.{os.getpid()}.{os.urandom(3).hex()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, _encode(config))
        os.fsync(fd)
    finally:
        os.close(fd)
    return tmp


def _sync_folder(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(home: Path, config: StoreConfig) -> None:
    """Replace the state directory's store configuration, atomically."""
    try:
        tmp = _write_temp(home, config)
        try:
            os.rename(tmp, path_of(home))
        finally:
            tmp.unlink(missing_ok=True)
        _sync_folder(home)
    except OSError as exc:
        raise EnvironmentProblem(f"cannot write {path_of(home)}: {exc.strerror or exc}") from exc


def _create(home: Path, config: StoreConfig) -> bool:
    """Write the configuration unless one exists; False if another process wrote one first."""
    try:
        tmp = _write_temp(home, config)
        try:
            os.link(tmp, path_of(home))  # fails if it exists: of two first commands, one wins
        except FileExistsError:
            return False
        finally:
            tmp.unlink(missing_ok=True)
        _sync_folder(home)
    except OSError as exc:
        raise EnvironmentProblem(f"cannot write {path_of(home)}: {exc.strerror or exc}") from exc
    return True


def establish(home: Path, variables: Mapping[str, str], *, check: bool = True) -> StoreConfig:
    """The state directory's store configuration, written from ``variables`` if it has none yet.

    Every store variable in ``variables`` is checked (a bad value is refused, naming it). With
    ``check``, one that differs from an existing configuration is refused too.
    """
    requested = from_variables(variables, home)
    current = load(home)
    if current is None:
        created = StoreConfig(**requested)
        if _create(home, created):
            return created
        current = load(home)
        assert current is not None  # another process created it a moment ago
    if check:
        for disagreement in disagreements(current, variables, home):
            raise UsageError(disagreement.message)
    return current


class ConfigFile:
    """The store configuration as it is now, for a process that lives long (a launcher, the destager).

    Each :meth:`current` looks at the file (one ``stat``) and reads it again only when it changed; a
    state directory without one (yet) has the default configuration.
    """

    def __init__(self, home: Path) -> None:
        self.home = home
        self._seen: tuple[int, int, int, int] | None = None
        self._config = StoreConfig()

    def current(self) -> StoreConfig:
        try:
            info = os.stat(path_of(self.home))
        except FileNotFoundError:
            self._seen = None
            self._config = StoreConfig()
            return self._config
        except OSError as exc:
            raise EnvironmentProblem(
                f"cannot read the store configuration {path_of(self.home)}: {exc.strerror}"
            ) from exc
        seen = (info.st_ino, info.st_mtime_ns, info.st_ctime_ns, info.st_size)
        if seen != self._seen:
            loaded = load(self.home)
            self._config = loaded or StoreConfig()
            self._seen = seen if loaded is not None else None
        return self._config
