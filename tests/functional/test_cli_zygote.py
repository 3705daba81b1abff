"""The forked CLI of the functional tests (tests/cli_zygote.py) answers as a fresh process does.

Most functional tests run their commands forked from a zygote; these compare it with a fresh
``python -m weightsync.cli`` on what a test reads: exit status, stdout and stderr, the working
folder, a timeout, and commands asked for side by side."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time

import pytest


def _fresh(args, env, cwd) -> tuple[int, str, str]:
    proc = subprocess.run(
        [sys.executable, "-m", "weightsync.cli", *map(str, args)], capture_output=True, text=True, env=env, cwd=cwd
    )
    return proc.returncode, proc.stdout, proc.stderr


def _timeless(result: tuple[int, str, str]) -> tuple[int, str, str]:
    rc, out, err = result
    return rc, *(re.sub(r"\d+\.\d+s\b", "<t>s", text) for text in (out, err))


def _subscriber(tmp_path) -> list:
    """A command that runs until it is stopped."""
    store = f"file://{tmp_path / 'store'}"
    return ["subscriber", "--store", store, "--target", tmp_path / "w", "--listen", "127.0.0.1:0"]


@pytest.fixture
def zygote(cli_zygote):
    if cli_zygote is None or not cli_zygote.usable:
        pytest.skip("the CLI is not forked in this run (TESTS_FRESH_CLI=1, or the zygote is unusable)")
    return cli_zygote


@pytest.mark.parametrize(
    "case",
    [
        "help",  # exit 0, stdout
        "usage",  # argparse's exit 2, its usage on stderr
        "missing-store",  # a WeightsyncError: one line, its exit status
        "versions",  # a table on stdout
        "pull-relative",  # a relative folder, resolved in the working folder given
        "verify-differs",  # exit 1 with a report
    ],
)
def test_a_forked_command_answers_as_a_fresh_process_does(case, zygote, cli_env, published, tmp_path, ws):
    store, _ = published
    url = f"file://{store}"
    work = tmp_path / "work"
    work.mkdir()
    args = {
        "help": ["--help"],
        "usage": ["pull", "--no-such-flag"],
        "missing-store": ["versions", "--store", f"file://{tmp_path / 'none'}"],
        "versions": ["versions", "--store", url],
        "pull-relative": ["pull", "--store", url, "--version", 2, "rep"],
        "verify-differs": ["verify", "--store", url, "replica"],
    }[case]
    if case == "verify-differs":  # a replica of version 5 with one file changed
        assert _fresh(["pull", "--store", url, "replica"], cli_env, work)[0] == 0
        victim = next(p for p in sorted((work / "replica").iterdir()) if p.suffix == ".safetensors")
        ws.flip_byte(victim, -1)
    forked = zygote.run(args, cli_env, 60, cwd=work)
    assert forked is not None
    if case == "pull-relative":  # the same pull again, fresh, into another folder of the same name
        (work / "rep").rename(work / "forked")
    fresh = _fresh(args, cli_env, work)
    assert _timeless(forked) == _timeless(fresh)
    assert forked[0] == {"help": 0, "usage": 2, "versions": 0, "pull-relative": 0, "verify-differs": 1}.get(case, 1)
    if case == "pull-relative":
        assert sorted(p.name for p in (work / "forked").iterdir()) == sorted(p.name for p in (work / "rep").iterdir())


def test_a_forked_command_past_its_timeout_is_killed_as_subprocess_kills_it(zygote, cli_env, tmp_path):
    """``subprocess.run``'s contract: TimeoutExpired, the process killed; the zygote then serves the next command."""
    args = _subscriber(tmp_path)
    t0 = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        zygote.run(args, cli_env, 3)
    assert time.monotonic() - t0 < 30
    assert zygote.run(["--help"], cli_env, 60)[0] == 0


def test_commands_asked_for_side_by_side_stay_side_by_side(zygote, cli_env, tmp_path):
    """While the zygote runs one command it answers None for another (the caller starts a process):
    commands that a test runs at once still run at once."""
    args = _subscriber(tmp_path)
    first = threading.Thread(target=lambda: pytest.raises(subprocess.TimeoutExpired, zygote.run, args, cli_env, 4))
    first.start()
    try:
        time.sleep(1)
        assert zygote.run(["--help"], cli_env, 60) is None
    finally:
        first.join()
    assert zygote.run(["--help"], cli_env, 60)[0] == 0


def test_a_command_in_another_environment_is_not_forked(zygote, cli_env):
    """The zygote imported everything with the tests' environment: another is read at a fresh start."""
    assert zygote.run(["--help"], {**cli_env, "NUMBA_DISABLE_JIT": "1"}, 60) is None
