"""An identity removed from the store the pods share (torpor.core.podstore.remove_identity) when some of
its slots keep their images in S3: emptied by the operator's purge, or, without one, left whole."""

from __future__ import annotations

from pathlib import Path

import pytest

from torpor.core import podstore
from torpor.core.records import Records
from torpor.core.recordtypes import JobName
from torpor.core.store import config as store_config
from torpor.core.store.config import StoreConfig
from torpor.errors import TorporError
from torpor.settings import Settings

IDENTITY = "team-a/web-0"


def slot(store: Path, n: int, config: StoreConfig | None) -> Path:
    """Slot ``n`` of :data:`IDENTITY` as a pod leaves it: its lock, its record and a state directory."""
    folder = store / "team-a" / "web-0"
    home = folder / f"slot-{n}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"slot-{n}.lock").touch()
    (folder / f"slot-{n}.json").write_text('{"pod": "web-0", "where": "elsewhere"}')
    records = Records(home / "torpor.db")
    records.create_job(JobName("job"), ["true"], "/", str(home / "output.log"))
    if config is not None:
        store_config.save(home, config)
    return home


def test_a_slot_in_s3_is_emptied_by_the_purge_and_without_one_nothing_of_the_identity_goes(
    tmp_path: Path,
) -> None:
    store = tmp_path / "store"
    in_s3 = StoreConfig(url="s3://bucket/torpor/team-a/web-0/slot-1", s3_endpoint="http://s3:9000")
    slot(store, 0, None)  # its images in its own folder
    slot(store, 1, in_s3)
    settings = Settings(home=tmp_path / "operator")
    with pytest.raises(TorporError, match="slot-1 of team-a/web-0 has its images in S3"):
        podstore.remove_identity(store, IDENTITY, settings)
    assert (store / "team-a/web-0/slot-0/torpor.db").is_file()  # not even the other slot was touched

    asked: list[tuple[str, int, StoreConfig]] = []

    def refuse(identity: str, n: int, config: StoreConfig) -> int:
        raise TorporError("the bucket is unreachable")

    with pytest.raises(TorporError, match="unreachable"):
        podstore.remove_identity(store, IDENTITY, settings, purge_s3=refuse)
    # the slot in S3 goes first: where it cannot, the other is still whole, to be tried again
    assert Records(store / "team-a/web-0/slot-0/torpor.db").jobs()

    def purge(identity: str, n: int, config: StoreConfig) -> int:
        asked.append((identity, n, config))
        return 3

    assert podstore.remove_identity(store, IDENTITY, settings, purge_s3=purge) == []
    assert asked == [(IDENTITY, 1, in_s3)]
    assert not (store / "team-a/web-0").exists()
