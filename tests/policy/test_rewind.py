"""What a restore does with the files the job writes (torpor.policy.rewind): the job's own later writes
are cut back without asking; a file someone else changed since the job stopped is refused unless
``--rewind``; a file gone since the job stopped, or one CRIU checks that shrank, is refused always."""

from __future__ import annotations

from torpor.policy.rewind import FileState, WrittenFile, changed_inside, changes, plan

STOPPED = 1_000_000_000_000


def state(size: int, mtime_ns: int = STOPPED - 5, ino: int = 7) -> FileState:
    return FileState(size=size, mtime_ns=mtime_ns, ino=ino)


def file(
    now: FileState | None, size: int = 100, checked: bool = True, at_stop: FileState | None = None
) -> WrittenFile:
    return WrittenFile("/data/db", size, checked, now, at_stop)


def test_the_jobs_own_later_writes_are_cut_without_asking() -> None:
    result = plan([file(state(150))], STOPPED, rewind=False)
    assert result.proceed and [(c.path, c.size, c.foreign) for c in result.cuts] == [("/data/db", 100, False)]


def test_an_unchanged_file_is_left_alone() -> None:
    result = plan([file(state(100))], STOPPED, rewind=False)
    assert result.proceed and not result.cuts


def test_after_a_hibernation_any_difference_from_the_recorded_state_is_someone_elses() -> None:
    recorded = state(100, mtime_ns=50)
    for now, what in [
        (state(150, mtime_ns=60), "size 100 → 150 bytes"),
        (state(100, mtime_ns=60), "modified (mtime)"),
        (state(100, mtime_ns=50, ino=8), "replaced (another inode)"),
    ]:
        result = plan([file(now, at_stop=recorded)], STOPPED, rewind=False)
        assert not result.proceed and not result.cuts
        (refusal,) = result.refusals
        assert what in refusal.reason and refusal.rewindable and refusal.foreign


def test_after_a_hibernation_the_recorded_state_unchanged_proceeds() -> None:
    recorded = state(100, mtime_ns=50)
    assert plan([file(recorded, at_stop=recorded)], STOPPED, rewind=False).proceed


def test_without_a_recorded_state_a_file_modified_after_the_job_stopped_is_someone_elses() -> None:
    result = plan([file(state(150, mtime_ns=STOPPED + 1))], STOPPED, rewind=False)
    assert not result.proceed and "after the job stopped" in result.refusals[0].reason


def test_rewind_cuts_a_file_someone_else_grew_and_says_so() -> None:
    result = plan([file(state(150), at_stop=state(120))], STOPPED, rewind=True)
    assert result.proceed and result.cuts[0].foreign and result.changed_elsewhere == ("/data/db",)


def test_rewind_proceeds_on_an_in_place_change_with_nothing_to_cut() -> None:
    result = plan([file(state(100, mtime_ns=60), at_stop=state(100, mtime_ns=50))], STOPPED, rewind=True)
    assert result.proceed and not result.cuts and result.changed_elsewhere == ("/data/db",)


def test_a_file_deleted_since_the_job_stopped_is_refused_even_with_rewind() -> None:
    result = plan([file(None, at_stop=state(100))], STOPPED, rewind=True)
    assert not result.proceed and not result.refusals[0].rewindable
    assert "deleted" in result.refusals[0].reason


def test_a_missing_file_with_nothing_recorded_is_left_to_criu() -> None:
    # e.g. a file the job deleted itself while it had it open: the image holds it, CRIU recreates it
    result = plan([file(None)], STOPPED, rewind=False)
    assert result.proceed and not result.cuts


def test_a_checked_file_that_shrank_cannot_be_restored() -> None:
    result = plan([file(state(80))], STOPPED, rewind=False)
    assert not result.proceed and not result.refusals[0].rewindable and not result.refusals[0].foreign


def test_an_appended_file_that_shrank_is_left_to_the_job() -> None:
    # after a log rotation the job appends at the end wherever it is
    assert plan([file(state(80), checked=False)], STOPPED, rewind=False).proceed


def test_when_nothing_is_known_of_the_stop_the_file_is_the_jobs() -> None:
    result = plan([file(state(150, mtime_ns=STOPPED + 10))], None, rewind=False)
    assert result.proceed and len(result.cuts) == 1


def test_one_refused_file_stops_all_cuts() -> None:
    files = [
        WrittenFile("/a", 10, True, state(20), None),
        WrittenFile("/b", 10, True, state(10, mtime_ns=STOPPED + 1), None),
    ]
    result = plan(files, STOPPED, rewind=False)
    assert not result.proceed and [r.path for r in result.refusals] == ["/b"]


def test_changes_lists_each_difference() -> None:
    assert changes(state(1, 1, 1), state(2, 2, 2)) == [
        "replaced (another inode)",
        "size 1 → 2 bytes",
        "modified (mtime)",
    ]


def test_changed_inside_names_read_write_files_modified_after_the_checkpoint() -> None:
    def written(path: str, mtime_ns: int, read_write: bool) -> WrittenFile:
        return WrittenFile(path, 8, True, FileState(8, mtime_ns, 1), read_write=read_write)

    files = [
        written("/db/rewritten", 2_000, True),
        written("/db/untouched", 500, True),
        written("/log/written-at-its-end", 2_000, False),
        WrittenFile("/db/gone", 8, True, None, read_write=True),
    ]
    assert changed_inside(files, checkpoint_ns=1_000) == ["/db/rewritten"]
