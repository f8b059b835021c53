"""An identity's S3 prefix emptied by the operator (adapters/s3.py ``purge``, apps/kubeoperator.py
``S3Purge``) against a real S3 server (moto): only the slot's own prefix goes, only where the webhook's
settings put it; the whole cluster's clean-up is in tests/kube/test_cluster.py."""

from __future__ import annotations

import uuid
from collections.abc import Callable

import boto3
import pytest

from torpor.adapters.s3 import S3Backend
from torpor.apps.kubeoperator import S3Purge
from torpor.core.admission import WebhookConfig
from torpor.core.store.config import StoreConfig
from torpor.errors import StoreError, TorporError

pytestmark = pytest.mark.s3


def bucket_with(endpoint: str, keys: list[str]) -> tuple[str, Callable[[], set[str]]]:
    s3 = boto3.client("s3", endpoint_url=endpoint)
    name = f"torpor-{uuid.uuid4().hex[:8]}"
    s3.create_bucket(Bucket=name)
    for key in keys:
        s3.put_object(Bucket=name, Key=key, Body=b"x")

    def left() -> set[str]:
        pages = s3.get_paginator("list_objects_v2").paginate(Bucket=name)
        return {item["Key"] for page in pages for item in page.get("Contents", [])}

    return name, left


SLOT = "torpor/team-a/web-0/slot-1"
OTHERS = [
    "torpor/team-a/web-0/slot-10/packs/p",  # a slot whose name starts the same
    "torpor/team-a/web-0/slot-0/config",
    "torpor/team-b/web-0/slot-1/config",  # another namespace's
    "elsewhere",
]


def test_a_slot_s_prefix_is_emptied_and_nothing_beside_it(s3_endpoint: str) -> None:
    ours = [f"{SLOT}/config", f"{SLOT}/manifests/a", *(f"{SLOT}/packs/{n}" for n in range(1100))]
    bucket, left = bucket_with(s3_endpoint, ours + OTHERS)
    backend = S3Backend(bucket, SLOT, s3_endpoint, credentials=("testing", "testing"))
    assert backend.purge() == len(ours)  # more than one page of a listing, and of a delete
    assert left() == set(OTHERS)
    assert backend.purge() == 0
    with pytest.raises(StoreError, match="never empties a whole bucket"):
        S3Backend(bucket, "", s3_endpoint).purge()
    assert left() == set(OTHERS)


def test_the_operator_empties_only_the_prefix_the_webhook_gives_the_slot(s3_endpoint: str) -> None:
    bucket, left = bucket_with(s3_endpoint, [f"{SLOT}/config", *OTHERS])
    webhook = WebhookConfig(s3_url=f"s3://{bucket}/torpor", s3_endpoint=s3_endpoint)
    purge = S3Purge(None, webhook)  # type: ignore[arg-type]  # no s3_secret: the API is never asked
    for url, endpoint, n in (
        (
            f"s3://{bucket}/torpor/team-b/web-0/slot-1",
            s3_endpoint,
            1,
        ),  # another namespace's, said by the slot
        (f"s3://{bucket}/torpor/team-a/web-0/slot-1", "http://127.0.0.1:1", 1),  # another server
        (f"s3://{bucket}/torpor/team-a/web-0/slot-1", s3_endpoint, 0),  # not that slot's
    ):
        with pytest.raises(TorporError, match="is not removed"):
            purge("team-a/web-0", n, StoreConfig(url=url, s3_endpoint=endpoint))
    assert left() == {f"{SLOT}/config", *OTHERS}
    assert purge("team-a/web-0", 1, StoreConfig(url=f"s3://{bucket}/{SLOT}", s3_endpoint=s3_endpoint)) == 1
    assert left() == set(OTHERS)
