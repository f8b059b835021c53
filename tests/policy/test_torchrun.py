"""Which commands start torchrun, and how torpor rewrites them to run its TCPStore without libuv."""

from __future__ import annotations

import pytest

from torpor.policy.torchrun import NOTE, SHIM_MARK, is_adapted, is_torchrun_script, shim, without_libuv

VENV_PYTHON = ["/venv/bin/python3.11"]


def test_the_torchrun_script_runs_the_shim_with_its_own_interpreter_and_arguments() -> None:
    command = ["torchrun", "--nproc-per-node", "2", "--standalone", "train.py", "--lr", "1"]
    assert is_torchrun_script(command)
    assert without_libuv(command, VENV_PYTHON) == [
        *VENV_PYTHON,
        "-c",
        shim("torch.distributed.run"),
        *command[1:],
    ]
    assert without_libuv(["/opt/bin/torchrun"], ["/usr/bin/env", "python3"]) == [
        "/usr/bin/env",
        "python3",
        "-c",
        shim(),
    ]


def test_a_torchrun_script_whose_interpreter_is_unknown_or_not_python_is_left_alone() -> None:
    assert without_libuv(["torchrun", "x.py"], None) is None
    assert without_libuv(["torchrun", "x.py"], ["/bin/bash"]) is None


@pytest.mark.parametrize(
    ("command", "expected"),
    [
        (
            ["python", "-m", "torch.distributed.run", "a.py"],
            ["python", "-c", "torch.distributed.run", "a.py"],
        ),
        (["python3", "-mtorch.distributed.run", "a.py"], ["python3", "-c", "torch.distributed.run", "a.py"]),
        (["python", "-um", "torch.distributed.launch"], ["python", "-u", "-c", "torch.distributed.launch"]),
        (
            ["/usr/bin/python3.11", "-W", "ignore", "-X", "dev", "-m", "torch.distributed.run", "a.py"],
            ["/usr/bin/python3.11", "-W", "ignore", "-X", "dev", "-c", "torch.distributed.run", "a.py"],
        ),
        (
            ["python", "-u", "/venv/bin/torchrun", "a.py"],
            ["python", "-u", "-c", "torch.distributed.run", "a.py"],
        ),
    ],
)
def test_python_running_torchrun_gets_the_shim_in_place_of_the_module(
    command: list[str], expected: list[str]
) -> None:
    rewritten = without_libuv(command)
    assert rewritten is not None
    # the shim imports the module the command named; every other word stays where it was
    shown = [word.split("from ")[-1].split()[0] if word.startswith(SHIM_MARK) else word for word in rewritten]
    assert shown == expected
    assert is_adapted(rewritten)


@pytest.mark.parametrize(
    "command",
    [
        ["python", "train.py"],
        ["python", "-c", "import torch.distributed.run"],
        ["python", "-uc", "print()"],
        ["python", "-m", "http.server"],
        ["python", "-m"],
        ["python", "-", "torch.distributed.run"],
        ["python", "-W", "-m", "torch.distributed.run"],  # -m is -W's value here
        ["sleep", "10"],
        [],
    ],
)
def test_other_commands_are_not_rewritten(command: list[str]) -> None:
    assert without_libuv(command, VENV_PYTHON) is None
    assert not is_adapted(command)


def test_the_shim_compiles_and_calls_torchruns_main_after_setting_use_libuv() -> None:
    source = shim("torch.distributed.run")
    compile(source, "<shim>", "exec")
    assert source.startswith(SHIM_MARK)
    assert source.index('setdefault("USE_LIBUV", "0")') < source.index(
        "from torch.distributed.run import main"
    )
    assert "io_uring" in NOTE and "docs/architecture.md" in NOTE
