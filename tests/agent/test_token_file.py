"""The agent's ``--token-file``: what it accepts, and the one line it says about what it does not."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from torpor.apps.agent.tokens import read_token
from torpor.errors import UnsafePath, UsageError

TOKEN = "a-token-long-enough-for-the-agent"


def private(path: Path, text: str = TOKEN + "\n") -> Path:
    path.write_text(text)
    path.chmod(0o600)
    return path


def test_a_private_regular_file_gives_its_stripped_content(tmp_path: Path) -> None:
    assert read_token(private(tmp_path / "token")) == TOKEN


def test_a_link_or_a_process_substitution_is_refused_saying_to_give_a_regular_file(tmp_path: Path) -> None:
    link = tmp_path / "link"
    link.symlink_to(private(tmp_path / "token"))
    with pytest.raises(UsageError, match=r"symbolic link: give a regular file .*process substitution"):
        read_token(link)
    read, write = os.pipe()  # what bash's <(...) hands over: /dev/fd/N, a link to a pipe
    try:
        os.write(write, TOKEN.encode())
        with pytest.raises(UsageError, match="not a link or a process substitution"):
            read_token(Path(f"/dev/fd/{read}"))
    finally:
        os.close(read)
        os.close(write)


def test_a_fifo_is_refused_at_once_instead_of_waiting_for_a_writer(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    with pytest.raises(UsageError, match="not a regular file"):
        read_token(fifo)


def test_a_file_others_can_read_or_a_short_token_is_refused(tmp_path: Path) -> None:
    readable = private(tmp_path / "token")
    readable.chmod(0o644)
    with pytest.raises(UnsafePath, match="only you can read"):
        read_token(readable)
    with pytest.raises(UsageError, match="too short"):
        read_token(private(tmp_path / "short", "abc"))
    with pytest.raises(UsageError, match="cannot read the token file"):
        read_token(tmp_path / "missing")
