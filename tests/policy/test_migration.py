"""policy.migration: a move is refused before the freeze, each reason one line naming what is wrong."""

from __future__ import annotations

from torpor.policy.migration import Job, Peer, WrittenThere, may_create, refusals, to_carry

GIB = 2**30
HERE = {"arch": "x86_64", "criu": "4.2"}
NODE = {"arch": "x86_64", "criu": "4.2", "draining": False, "memory": {"free": 8 * GIB, "budget": 16 * GIB}}


def test_a_job_that_runs_there_as_it_runs_here_may_move() -> None:
    job = Job("web", 2 * GIB, read_files={"/srv/model.bin": (10, 5)}, listens=(8080,))
    peer = Peer("b", None, NODE, stamps={"/srv/model.bin": (10, 5)}, ports_taken=(22,))
    assert refusals(job, peer, HERE) == []


def test_an_unreachable_peer_is_the_one_reason() -> None:
    assert refusals(Job("j", 1), Peer("b", "cannot connect"), HERE) == [
        "peer b cannot be asked: cannot connect"
    ]


def test_every_reason_is_given_at_once_each_naming_what_is_wrong() -> None:
    job = Job(
        "j",
        12 * GIB,
        read_files={"/a": (1, 1), "/b": (2, 2), "/c": (3, 3)},
        listens=(80, 443),
        connections=("10.0.0.2:5432 -> 10.0.0.9:40000",),
        gpu=True,
    )
    node = {**NODE, "arch": "aarch64", "draining": True}
    peer = Peer("b", None, node, stamps={"/a": (1, 1), "/b": (2, 9), "/c": None}, ports_taken=(443, 80))
    assert refusals(job, peer, HERE) == [
        "the job uses a GPU: moving a GPU job to another machine is not supported yet",
        "peer b is draining",
        "peer b has 8G free of its budget, the job needs 12G",
        "the machines differ: arch aarch64, here x86_64",
        "not on peer b: /c",
        "not the same on peer b (size or modification time): /b",
        "ports 80, 443 taken on peer b",
        "established TCP connections cannot follow the job to another address: "
        "10.0.0.2:5432 -> 10.0.0.9:40000 (--drop-connections resets them)",
    ]


def test_connections_may_be_dropped_when_the_user_says_so() -> None:
    job = Job("j", 1, connections=("a -> b",))
    assert refusals(job, Peer("b", None, NODE), HERE, drop_connections=True) == []


def test_many_missing_files_are_named_three_and_counted() -> None:
    job = Job("j", 1, read_files={f"/f{i}": (1, 1) for i in range(5)})
    assert refusals(job, Peer("b", None, NODE), HERE) == ["not on peer b: /f0, /f1, /f2 and 2 more"]


def test_a_file_the_job_writes_needs_its_folder_on_the_peer_and_no_other_users_file_there() -> None:
    user = (1000, 1000)
    paths = ["/out/a.csv", "/out/b.db", "/gone/c", "/out/d", "/link/e", "/etc/f"]
    job = Job("j", 1, written_files=dict.fromkeys(paths, user))
    theirs = (1000, 1000, 0o755)
    there = {
        "/out/a.csv": WrittenThere(folder=True, folder_stat=theirs),  # not there yet: it is carried
        "/out/b.db": WrittenThere(folder=True, owner=1000, folder_stat=theirs),  # the job's own: replaced
        "/gone/c": WrittenThere(folder=False),
        "/out/d": WrittenThere(folder=True, owner=0, folder_stat=theirs),
        "/link/e": WrittenThere(folder=True, plain=False, folder_stat=theirs),  # /link -> /etc there
        "/etc/f": WrittenThere(folder=True, folder_stat=(0, 0, 0o755)),  # root's folder
    }
    assert refusals(job, Peer("b", None, NODE, written=there), HERE) == [
        "the folder of a file the job writes is not on peer b: /gone/c",
        "a file the job writes is reached through a symbolic link on peer b: /link/e",
        "a file the job writes is another user's on peer b (it would be replaced): /out/d",
        "the folder of a file the job writes is not its owner's to write in on peer b: /etc/f",
    ]
    # a peer that said nothing of a file: its folder is not known to be there
    assert refusals(job, Peer("b", None, NODE), HERE)[0].startswith("the folder of a file the job writes")


def test_the_files_carried_are_those_the_peer_has_not_the_same() -> None:
    here = {"/shared/log.csv": (10, 5), "/local/out": (7, 3), "/local/new": (1, 1)}
    there = {"/shared/log.csv": (10, 5), "/local/out": (7, 2), "/local/new": None}
    assert to_carry(here, there) == ["/local/new", "/local/out"]
    assert to_carry({}, there) == []


def test_a_carried_file_goes_only_where_its_owner_could_have_made_it() -> None:
    assert may_create(0, 0, (5, 5, 0o700))  # root: anywhere
    assert may_create(7, 7, (7, 0, 0o700)) and not may_create(7, 7, (7, 0, 0o500))  # its own folder
    assert may_create(7, 9, (0, 9, 0o770)) and not may_create(7, 9, (0, 9, 0o750))  # its group's
    assert may_create(7, 7, (0, 0, 0o1777)) and not may_create(7, 7, (0, 0, 0o755))  # /tmp, not /etc
