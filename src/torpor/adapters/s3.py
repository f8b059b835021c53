"""S3-compatible object storage as a store backend (AWS S3, MinIO, Ceph RGW, moto), through boto3.

Keeps the backend contract of :mod:`torpor.core.store.backend`: S3's PUT is atomic and, since 2020,
strongly consistent for reads and lists, so ``store`` is one PUT and ``sync`` has nothing to do.
botocore failures become torpor errors here, with the original as the cause; credentials come from
boto3's usual chain (``AWS_ACCESS_KEY_ID``…, ``~/.aws``, instance roles).
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from typing import Any

import boto3
import botocore.config
import botocore.exceptions

from torpor.adapters.objectstore import check_name
from torpor.errors import ObjectNotFound, StorageFull, StoreError

_MISSING = {"NoSuchKey", "404", "NotFound"}
_FULL = {"QuotaExceeded", "XMinioStorageFull", "EntityTooLarge", "InsufficientStorage"}


class S3Backend:
    """Objects as keys under ``prefix`` in ``bucket``: one PUT per object, ranged GETs for parts of one."""

    remote = True

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        endpoint: str | None = None,
        workers: int = 8,
        credentials: tuple[str, str] | None = None,
    ) -> None:
        """``credentials``: (access key id, secret access key) instead of boto3's usual chain."""
        if not bucket:
            raise StoreError("an S3 store URL needs a bucket: s3://BUCKET[/PREFIX]")
        self.bucket = bucket
        self.prefix = f"{prefix.strip('/')}/" if prefix.strip("/") else ""
        self.url = f"s3://{bucket}/{self.prefix}" + (f" at {endpoint}" if endpoint else "")
        config = botocore.config.Config(
            max_pool_connections=max(10, workers * 2),
            retries={"max_attempts": 5, "mode": "standard"},
            connect_timeout=10,
            read_timeout=60,
        )
        try:
            keys: dict[str, str] = {}
            if credentials is not None:
                keys = {"aws_access_key_id": credentials[0], "aws_secret_access_key": credentials[1]}
            self.client: Any = boto3.session.Session(**keys).client(
                "s3", endpoint_url=endpoint, config=config
            )
        except (botocore.exceptions.BotoCoreError, ValueError) as exc:
            raise StoreError(f"cannot set up S3 access to {self.url}: {exc}") from exc

    def _key(self, name: str) -> str:
        return self.prefix + check_name(name)

    def _error(self, exc: Exception, what: str) -> StoreError:
        if isinstance(exc, botocore.exceptions.ClientError):
            code = str(exc.response.get("Error", {}).get("Code", ""))
            message = str(exc.response.get("Error", {}).get("Message", "")) or code
            if code in _MISSING:
                return ObjectNotFound(f"{self.url} has no object {what}")
            if code in _FULL:
                return StorageFull(f"{what}: the S3 store {self.url} is full ({message})")
            if code == "NoSuchBucket":
                return StoreError(f"the bucket {self.bucket} does not exist at {self.url}; create it first")
            return StoreError(f"S3 {what} failed at {self.url}: {code} {message}")
        return StoreError(f"S3 {what} failed at {self.url}: {exc}")

    def create(self) -> None:
        try:
            self.client.head_bucket(Bucket=self.bucket)
            return
        except botocore.exceptions.ClientError as exc:
            code = str(exc.response.get("Error", {}).get("Code", ""))
            if code not in ("404", "NoSuchBucket", "NotFound"):
                raise self._error(exc, "checking the bucket") from exc
        except botocore.exceptions.BotoCoreError as exc:
            raise self._error(exc, "checking the bucket") from exc
        try:
            self.client.create_bucket(Bucket=self.bucket)
        except (botocore.exceptions.ClientError, botocore.exceptions.BotoCoreError) as exc:
            raise self._error(exc, "creating the bucket") from exc

    def store(self, name: str, *parts: bytes | memoryview) -> None:
        body = b"".join(parts)
        try:
            self.client.put_object(Bucket=self.bucket, Key=self._key(name), Body=body)
        except (botocore.exceptions.ClientError, botocore.exceptions.BotoCoreError) as exc:
            raise self._error(exc, f"writing {name}") from exc

    def load(self, name: str) -> bytes:
        try:
            reply = self.client.get_object(Bucket=self.bucket, Key=self._key(name))
            data: bytes = reply["Body"].read()
            return data
        except (botocore.exceptions.ClientError, botocore.exceptions.BotoCoreError) as exc:
            raise self._error(exc, name) from exc

    def in_memory(self, name: str, offset: int, length: int) -> float:
        """None of them: each load is a round trip."""
        return 0.0

    def load_into(self, name: str, buffer: memoryview, offset: int = 0, length: int = -1) -> bytes:
        """New bytes always: boto3 reads a body into memory of its own. A range is one ranged GET."""
        if offset == 0 and length < 0:
            return self.load(name)
        if length == 0:
            return b""
        end = "" if length < 0 else str(offset + length - 1)
        try:
            reply = self.client.get_object(
                Bucket=self.bucket, Key=self._key(name), Range=f"bytes={offset}-{end}"
            )
            data: bytes = reply["Body"].read()
            return data
        except botocore.exceptions.ClientError as exc:
            if str(exc.response.get("Error", {}).get("Code", "")) == "InvalidRange":
                return b""  # the object ends before offset
            raise self._error(exc, name) from exc
        except botocore.exceptions.BotoCoreError as exc:
            raise self._error(exc, name) from exc

    def writer(self, name: str, cache: bool = True) -> _PutWriter:
        """Parts are kept in memory and stored with one PUT at ``commit`` (a pack is some MiB); there is
        no cache here to write around (``cache`` is for backends with one)."""
        return _PutWriter(self, name)

    def exists(self, name: str) -> bool:
        try:
            self.client.head_object(Bucket=self.bucket, Key=self._key(name))
            return True
        except botocore.exceptions.ClientError as exc:
            if str(exc.response.get("Error", {}).get("Code", "")) in _MISSING:
                return False
            raise self._error(exc, f"checking {name}") from exc
        except botocore.exceptions.BotoCoreError as exc:
            raise self._error(exc, f"checking {name}") from exc

    def delete(self, name: str) -> None:
        try:
            self.client.delete_object(Bucket=self.bucket, Key=self._key(name))
        except (botocore.exceptions.ClientError, botocore.exceptions.BotoCoreError) as exc:
            raise self._error(exc, f"deleting {name}") from exc

    def list(self, folder: str) -> Iterator[str]:
        prefix = self._key(folder) + "/"
        try:
            pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
            for page in pages:
                for item in page.get("Contents", []):
                    yield str(item["Key"])[len(self.prefix) :]
        except (botocore.exceptions.ClientError, botocore.exceptions.BotoCoreError) as exc:
            raise self._error(exc, f"listing {folder}") from exc

    def sync(self) -> None:
        return None

    def purge(self) -> int:
        """Delete every object under this backend's prefix (never a whole bucket: StoreError without
        one); how many were deleted."""
        if not self.prefix:
            raise StoreError(f"{self.url} has no prefix: torpor never empties a whole bucket")
        deleted = 0
        try:
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=self.prefix
            )
            for page in pages:
                keys = [{"Key": item["Key"]} for item in page.get("Contents", [])]
                if not keys:
                    continue
                answer = self.client.delete_objects(
                    Bucket=self.bucket, Delete={"Objects": keys, "Quiet": True}
                )
                if answer.get("Errors"):
                    first = answer["Errors"][0]
                    raise StoreError(
                        f"S3 deleting {first.get('Key')} failed at {self.url}: {first.get('Code')} "
                        f"{first.get('Message', '')}".rstrip()
                    )
                deleted += len(keys)
        except (botocore.exceptions.ClientError, botocore.exceptions.BotoCoreError) as exc:
            raise self._error(exc, "emptying its prefix") from exc
        return deleted

    def remove_leftovers(self, min_age_s: float = 3600.0, idle: Collection[str] = ()) -> int:
        """Nothing to remove: a PUT that did not complete leaves no object behind."""
        return 0

    def close(self) -> None:
        self.client.close()


class _PutWriter:
    """An object written in parts, kept in memory until ``commit`` stores it with one PUT."""

    def __init__(self, backend: S3Backend, name: str) -> None:
        self._backend = backend
        self._name = name
        self._parts: list[bytes] = []

    def write(self, *parts: bytes | memoryview) -> None:
        self._parts.extend(bytes(part) for part in parts)

    def commit(self) -> None:
        parts, self._parts = self._parts, []
        self._backend.store(self._name, *parts)

    def abort(self) -> None:
        self._parts = []
