"""policy.warmstart: the warm-start template's name and whether a template is stale (pure, milliseconds)."""

from __future__ import annotations

from torpor.policy.warmstart import (
    WARM_PREFIX,
    FileStamp,
    stale_reasons,
    stale_summary,
    warm_key,
    warm_template_name,
)

SCRIPT = FileStamp("/srv/serve.py", 2210, 1_000, 42)
LIB = FileStamp("/usr/lib/libtorch.so", 9_000_000, 2_000, 43)


def test_the_key_is_the_same_for_the_same_command_and_differs_for_any_change() -> None:
    argv, env, cwd = ["python", "serve.py"], {"A": "1", "B": "2"}, "/srv"
    key = warm_key(argv, env, cwd)
    assert key == warm_key(list(argv), {"B": "2", "A": "1"}, cwd)  # the environment's order does not count
    assert len(key) == 16 and int(key, 16) >= 0
    assert warm_key(["python", "serve.py", "--port", "1"], env, cwd) != key
    assert warm_key(argv, {**env, "A": "3"}, cwd) != key
    assert warm_key(argv, env, "/tmp") != key
    # an argument that holds a separator is not confused with two
    assert warm_key(["a b"], {}, "/") != warm_key(["a", "b"], {}, "/")
    assert warm_template_name(argv, env, cwd) == WARM_PREFIX + key


def test_a_template_whose_files_are_as_they_were_is_not_stale() -> None:
    assert stale_reasons([SCRIPT, LIB], {SCRIPT.path: SCRIPT, LIB.path: LIB}) == []
    assert stale_summary([]) == ""


def test_each_change_is_a_reason() -> None:
    now = {
        SCRIPT.path: FileStamp(SCRIPT.path, 2236, 1_500, 42),
        LIB.path: None,
    }
    reasons = stale_reasons([SCRIPT, LIB], now)
    assert reasons == [f"{SCRIPT.path} changed size (2210 → 2236 bytes)", f"{LIB.path} is gone"]
    assert stale_summary(reasons) == f"{SCRIPT.path} changed size (2210 → 2236 bytes) (and 1 more file(s))"
    assert stale_reasons([SCRIPT], {SCRIPT.path: FileStamp(SCRIPT.path, 2210, 1_000, 99)}) == [
        f"{SCRIPT.path} was replaced"
    ]
    assert stale_reasons([SCRIPT], {SCRIPT.path: FileStamp(SCRIPT.path, 2210, 1_001, 42)}) == [
        f"{SCRIPT.path} was modified"
    ]
    assert stale_reasons([SCRIPT], {}) == [f"{SCRIPT.path} is gone"]


def test_a_stamp_round_trips_through_its_stored_form() -> None:
    assert FileStamp.from_list(SCRIPT.to_list()) == SCRIPT
