"""The layers of DESIGN.md, as the tests keep them: import-linter's contracts (pyproject.toml) hold, and
CRIU, which import-linter cannot see (it is a binary run through subprocess), is run only by its adapter.

The CRIU check reads the source: outside ``torpor.adapters``, a call that starts a process must not
name CRIU in its arguments, nor in what the function assigned to the names it passes (``settings.criu``,
a ``"criu"`` string, a variable called ``criu_…``). An argument vector built in another function escapes
it; the adapter's :class:`~torpor.adapters.criu.Criu` is the way in.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

SRC = Path(__file__).parents[1] / "src" / "torpor"
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"

_EXEC = ("execl", "execle", "execlp", "execlpe", "execv", "execve", "execvp", "execvpe")
_SPAWN = ("spawnl", "spawnle", "spawnlp", "spawnlpe", "spawnv", "spawnve", "spawnvp", "spawnvpe")
STARTS_A_PROCESS = {
    *(("subprocess", f) for f in ("run", "Popen", "call", "check_call", "check_output")),
    *(("subprocess", f) for f in ("getoutput", "getstatusoutput")),
    *(("os", f) for f in ("system", "popen", "posix_spawn", "posix_spawnp", *_EXEC, *_SPAWN)),
}
NAMES_CRIU = re.compile(r"criu", re.IGNORECASE)
CRIU_BINARY = re.compile(r"(^|/)criu$")


def _starts_a_process(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and isinstance(node.func.value, ast.Name)
        and (node.func.value.id, node.func.attr) in STARTS_A_PROCESS
    )


def _names_criu(node: ast.AST) -> bool:
    for part in ast.walk(node):
        if isinstance(part, ast.Name) and NAMES_CRIU.search(part.id):
            return True
        if isinstance(part, ast.Attribute) and NAMES_CRIU.search(part.attr):
            return True
        if isinstance(part, ast.Constant) and isinstance(part.value, str) and CRIU_BINARY.search(part.value):
            return True
    return False


def criu_runs(source: str) -> Iterator[int]:
    """The lines of ``source`` that start a process whose arguments name CRIU."""
    tree = ast.parse(source)
    for function in ast.walk(tree):
        if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        assigned: dict[str, list[ast.AST]] = {}
        for node in ast.walk(function):
            if isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign) and node.value is not None:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    for name in ast.walk(target):
                        if isinstance(name, ast.Name):
                            assigned.setdefault(name.id, []).append(node.value)
        for call in ast.walk(function):
            if not _starts_a_process(call):
                continue
            assert isinstance(call, ast.Call)
            arguments = [*call.args, *(keyword.value for keyword in call.keywords)]
            passed = {n.id for a in arguments for n in ast.walk(a) if isinstance(n, ast.Name)}
            values = [value for name in passed for value in assigned.get(name, [])]
            if any(_names_criu(node) for node in [*arguments, *values]):
                yield call.lineno


def test_only_the_criu_adapter_runs_criu() -> None:
    found = [
        f"{path.relative_to(SRC.parent)}:{line}"
        for path in sorted(SRC.rglob("*.py"))
        if "adapters" not in path.relative_to(SRC).parts
        for line in criu_runs(path.read_text())
    ]
    assert found == [], f"CRIU run outside torpor.adapters.criu (use its Criu class): {found}"


@pytest.mark.parametrize(
    ("source", "line"),
    [
        ("def f(settings):\n    subprocess.run([str(settings.criu), 'check'])\n", 2),
        ("def f(ctx):\n    argv = [ctx.criu_path, 'dump']\n    return subprocess.Popen(argv)\n", 3),
        ("def f():\n    os.execvp('criu', ['criu', 'restore'])\n", 2),
        ("def f(root):\n    subprocess.check_output([f'{root}/bin/criu'])\n", 2),
    ],
)
def test_the_check_sees_criu_run_directly(source: str, line: int) -> None:
    assert list(criu_runs(source)) == [line]


def test_the_check_lets_other_processes_and_criu_in_messages_be() -> None:
    source = (
        "def f(command, engine):\n"
        "    subprocess.run(command)\n"
        "    print('CRIU is', engine.ctx.criu)\n"
        "    subprocess.Popen([sys.executable, '-m', 'torpor.core.launcher'])\n"
    )
    assert list(criu_runs(source)) == []


@pytest.mark.skipif(not LINT_IMPORTS.exists(), reason="import-linter is not installed")
def test_the_import_contracts_are_kept() -> None:
    result = subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"],
        cwd=SRC.parents[1],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
