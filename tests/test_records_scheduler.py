"""The scheduler's records: submissions and quotas survive in torpor.db, names stay unique across the queue
and the jobs, and a queued submission can be dropped while a started one goes only with its job."""

from __future__ import annotations

from pathlib import Path

import pytest

from torpor.core.records import Records
from torpor.core.recordtypes import JobName, Quota, Submission
from torpor.errors import UsageError


def submission(name: str, **fields: object) -> Submission:
    values: dict[str, object] = {
        "name": JobName(name),
        "command": ["sleep", "1"],
        "cwd": "/tmp",
        "env": {"PATH": "/usr/bin", "SECRET": "s3cr3t"},
        "umask": 0o027,
        "memory": 300 << 20,
        "cpus": 2.0,
        "priority": 3,
        "project": "vision",
        "submitted_at": 1000.0,
        **fields,
    }
    return Submission(**values)  # type: ignore[arg-type]


def test_a_submission_and_its_marks_read_back_as_written(tmp_path: Path) -> None:
    records = Records(tmp_path / "torpor.db")
    records.add_submission(submission("a"))
    assert records.submission("a") == submission("a")
    assert records.submission("a").queued  # type: ignore[union-attr]
    records.update_submission("a", started_at=1010.0, waited_s=10.0, room_for="b", mem_limit=400 << 20)
    again = Records(tmp_path / "torpor.db").submission("a")  # a new agent reads the same
    assert again is not None and not again.queued
    assert (again.waited_s, again.room_for, again.mem_limit) == (10.0, "b", 400 << 20)
    with pytest.raises(ValueError, match="not a scheduler mark"):
        records.update_submission("a", memory=1)
    assert (tmp_path / "torpor.db").stat().st_mode & 0o077 == 0  # it holds the submitter's environment


def test_names_are_unique_across_the_queue_and_the_jobs(tmp_path: Path) -> None:
    records = Records(tmp_path / "torpor.db")
    records.create_job(JobName("running"), ["true"], "/", str(tmp_path / "log"))
    with pytest.raises(UsageError, match="a job named 'running' already exists"):
        records.add_submission(submission("running"))
    records.add_submission(submission("queued"))
    with pytest.raises(UsageError, match="a job named 'queued' already exists"):
        records.add_submission(submission("queued"))
    with pytest.raises(UsageError, match="'queued' waits in the queue"):
        records.create_job(JobName("queued"), ["true"], "/", str(tmp_path / "log"))
    # the agent marks the start first: then the job may be created under the submission's name
    records.update_submission("queued", started_at=1.0)
    records.create_job(JobName("queued"), ["true"], "/", str(tmp_path / "log"))


def test_only_a_queued_submission_is_dropped_alone_a_started_one_goes_with_its_job(tmp_path: Path) -> None:
    records = Records(tmp_path / "torpor.db")
    records.add_submission(submission("q"))
    records.add_submission(submission("s", started_at=5.0))
    records.update_submission("s", started_at=5.0)
    assert records.delete_submission("q") and records.submission("q") is None
    assert not records.delete_submission("s") and records.submission("s") is not None
    records.create_job(JobName("s"), ["true"], "/", str(tmp_path / "log"))
    records.delete_job(JobName("s"))
    assert records.submissions() == {}


def test_quotas_are_set_replaced_and_removed(tmp_path: Path) -> None:
    records = Records(tmp_path / "torpor.db")
    records.set_quota(Quota("vision", 4 << 30, None))
    records.set_quota(Quota("nlp", 2 << 30, 1 << 30))
    records.set_quota(Quota("vision", 6 << 30, 0))
    assert records.quotas() == {"nlp": Quota("nlp", 2 << 30, 1 << 30), "vision": Quota("vision", 6 << 30, 0)}
    assert records.delete_quota("nlp") and not records.delete_quota("nlp")
    assert list(records.quotas()) == ["vision"]
