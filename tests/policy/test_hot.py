"""The hot tier's decisions (torpor.policy.hot): which RAM copies go once an image is durable, and which
go, oldest first, to make room — on snapshots built in a line; then that ``HotTier.make_room``, which
measures the tier once and lets the policy decide, drops what re-measuring after each removal dropped."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from torpor.core.store import DURABLE
from torpor.core.store.hot import HotTier
from torpor.policy.hot import HotCopy, Room, Tier, after_durable, make_room, read_back_soon, to_take_over

MiB = 1 << 20


def _copy(id_: str, at: float, state: str = "durable", size: int = MiB, job: str = "job") -> HotCopy:
    return HotCopy(id_, job, state, created_at=at, kind="checkpoint", size=size)


# -- after an image became durable ---------------------------------------------------------------------


def test_a_hibernation_drops_its_own_copy_and_nothing_else() -> None:
    image = HotCopy("h", "job", "destaging", created_at=5, kind="hibernate")
    assert after_durable(image, [_copy("old", 1), image]) == ("h",)


def test_a_checkpoint_drops_the_older_durable_copies_of_its_job_only() -> None:
    image = _copy("new", 5, state="destaging")
    others = [
        _copy("a", 1),
        _copy("staged", 2, state="staged"),  # not durable yet: its only copy
        _copy("other-job", 3, job="other"),
        _copy("b", 4),
        image,
        _copy("newer", 6),
    ]
    assert after_durable(image, others) == ("a", "b")


def test_a_copy_whose_kind_is_unknown_is_not_a_hibernation() -> None:
    image = HotCopy("c", "job", "durable", created_at=5)
    assert after_durable(image, [_copy("a", 1), image]) == ("a",)


# -- making room ---------------------------------------------------------------------------------------


def test_only_a_hibernation_is_read_back_from_the_cold_tier_soon() -> None:
    assert read_back_soon("hibernate")
    assert not read_back_soon("checkpoint")  # stays in RAM: a restore reads that
    assert not read_back_soon(None)  # unknown kind: kept in RAM


def test_what_already_fits_drops_nothing() -> None:
    tier = Tier([_copy("a", 1)], used=MiB, capacity=4 * MiB, free=8 * MiB)
    assert make_room(tier, 3 * MiB) == Room((), True)


def test_durable_copies_go_oldest_first_until_the_need_fits_the_capacity() -> None:
    copies = [_copy("c", 3), _copy("a", 1), _copy("b", 2)]  # in any order
    tier = Tier(copies, used=3 * MiB, capacity=4 * MiB, free=64 * MiB)
    assert make_room(tier, 2 * MiB) == Room(("a",), True)
    assert make_room(tier, 3 * MiB) == Room(("a", "b"), True)


def test_copies_not_yet_durable_stay_however_old() -> None:
    copies = [_copy("staged", 0, state="staged"), _copy("destaging", 1, state="destaging"), _copy("a", 2)]
    tier = Tier(copies, used=3 * MiB, capacity=3 * MiB, free=64 * MiB)
    assert make_room(tier, MiB) == Room(("a",), True)
    assert make_room(tier, 2 * MiB) == Room(("a",), False)


def test_the_file_system_must_have_the_room_too() -> None:
    # the capacity allows it, but /dev/shm is shared: only dropping copies frees enough of it
    tier = Tier([_copy("a", 1), _copy("b", 2, size=2 * MiB)], used=3 * MiB, capacity=1 << 40, free=MiB)
    assert make_room(tier, 2 * MiB) == Room(("a",), True)
    assert make_room(tier, 4 * MiB) == Room(("a", "b"), True)
    assert make_room(tier, 5 * MiB) == Room(("a", "b"), False)


def test_an_empty_tier_fits_what_its_file_system_and_capacity_allow() -> None:
    assert make_room(Tier([], used=0, capacity=MiB, free=MiB), MiB).fits
    assert not make_room(Tier([], used=0, capacity=MiB, free=MiB), MiB + 1).fits
    assert make_room(Tier([], used=0, capacity=0, free=0), 0) == Room((), True)


# -- whose memory a new checkpoint takes over -----------------------------------------------------------


def test_a_new_checkpoint_takes_over_the_newest_durable_copy_of_its_own_job() -> None:
    copies = [
        _copy("old", 1),
        _copy("newest", 3),
        _copy("staged", 4, state="staged"),  # the only copy of that checkpoint: never
        _copy("destaging", 5, state="destaging"),
        _copy("other", 6, job="other"),  # another job's
    ]
    assert to_take_over("job", copies) == "newest"
    assert to_take_over("other", copies) == "other"
    assert to_take_over("job", [_copy("staged", 1, state="staged")]) is None
    assert to_take_over("nobody", copies) is None


# -- the hot tier acts on it as it did when it re-measured after each removal ---------------------------


@pytest.fixture
def tmpfs_pair(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """Two tmpfs mounts of one size, so that both tiers built in them measure alike (free bytes too)."""
    mounts = [tmp_path / "one", tmp_path / "two"]
    for mount in mounts:
        mount.mkdir()
        result = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=12m", "tmpfs", str(mount)], capture_output=True
        )
        if result.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {result.stderr.decode().strip()}")
    yield mounts[0], mounts[1]
    for mount in mounts:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def _remeasuring_make_room(hot: HotTier, need: int) -> bool:
    """``HotTier.make_room`` before its decision moved to the policy: it measured the tier again after
    every removal."""
    capacity = hot.capacity

    def fits() -> bool:
        return hot.used() + need <= capacity and need <= hot.free_bytes()

    for record in hot.records():
        if fits():
            return True
        if record.state == DURABLE:
            hot.remove(record.id)
    return fits()


def _tier(root: Path, capacity: int, images: list[tuple[str, str, int]]) -> HotTier:
    hot = HotTier(root, capacity)
    hot.ensure()
    for at, (id_, state, size) in enumerate(images):
        partial = root / f"{id_}.partial"
        partial.mkdir()
        (partial / "pages-1.img").write_bytes(os.urandom(size))
        hot.commit(id_, "job", partial, {"created_at": float(at + 1), "kind": "checkpoint"})
        hot.update(id_, state=state)
    (root / "restore-x-abc123").mkdir()  # a restore in progress takes room too
    (root / "restore-x-abc123" / "pages-1.img").write_bytes(os.urandom(MiB))
    return hot


CASES = {
    # name: (capacity, images (id, state, size) oldest first, need)
    "within capacity after two": (
        7 * MiB,
        [("a", "durable", MiB), ("b", "durable", 2 * MiB), ("c", "durable", MiB), ("d", "staged", MiB)],
        3 * MiB,
    ),
    "a staged one is skipped": (
        7 * MiB,
        [("s", "staged", 2 * MiB), ("a", "durable", MiB), ("b", "durable", MiB), ("c", "durable", MiB)],
        2 * MiB,
    ),
    "the file system is short": (
        1 << 30,
        [("a", "durable", 3 * MiB), ("b", "durable", 3 * MiB), ("c", "durable", 2 * MiB)],
        5 * MiB,
    ),
    "it cannot fit": (4 * MiB, [("s", "staged", 3 * MiB), ("a", "durable", MiB)], 2 * MiB),
    "the destager's room for nothing": (
        3 * MiB,
        [("a", "durable", MiB), ("b", "durable", MiB), ("c", "durable", MiB)],
        0,
    ),
}


@pytest.mark.root("mounting a tmpfs")
@pytest.mark.parametrize("case", CASES)
def test_the_tier_drops_what_it_dropped_when_it_measured_after_each_removal(
    case: str, tmpfs_pair: tuple[Path, Path]
) -> None:
    capacity, images, need = CASES[case]
    policy_made: Callable[[HotTier, int], bool] = HotTier.make_room
    outcomes = []
    for mount, make_room_in in zip(tmpfs_pair, (policy_made, _remeasuring_make_room), strict=True):
        hot = _tier(mount / "hot", capacity, images)
        fits = make_room_in(hot, need)
        outcomes.append((fits, [r.id for r in hot.records()]))
    assert outcomes[0] == outcomes[1]
