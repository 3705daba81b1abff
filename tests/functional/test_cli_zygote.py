"""The forked CLI of the functional tests (tests/cli_zygote.py) answers as a fresh process does.

Most functional tests run their commands forked from a zygote; these compare it with a fresh
``python -m weightsync.cli`` on what a test reads: exit status, stdout and stderr, the working
folder, a timeout, and commands asked for side by side."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
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


def test_commands_run_side_by_side_are_forked_side_by_side(zygote, cli_env, tmp_path):
    """Two daemons forked at once both run (each its own process), a command runs beside them, and
    each ends with the status of the signal that stopped it, as ``Popen`` reports it."""
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    daemons = [
        zygote.spawn(_subscriber(tmp_path / name), cli_env, stdout=log, stderr=subprocess.STDOUT)
        for name, log in zip("ab", logs, strict=True)
    ]
    try:
        assert all(d is not None for d in daemons) and daemons[0].pid != daemons[1].pid
        deadline = time.monotonic() + 60
        while not all("listening" in log.read_text() for log in logs if log.exists()) or not all(
            log.exists() for log in logs
        ):
            assert time.monotonic() < deadline and all(d.poll() is None for d in daemons)
            time.sleep(0.1)
        assert zygote.run(["--help"], cli_env, 60)[0] == 0
        with pytest.raises(subprocess.TimeoutExpired):
            daemons[0].wait(0.2)
    finally:
        for d in daemons:
            if d is not None:
                d.kill()
    assert [d.wait(30) for d in daemons] == [-signal.SIGKILL] * 2


def test_a_child_takes_the_environment_it_is_given_unless_a_start_reads_it(zygote, cli_env, tmp_path):
    """A variable read while the command runs reaches the child; one read at an interpreter's start
    (numba's) cannot: that command starts a fresh process."""
    assert zygote.run(["--help"], {**cli_env, "NUMBA_DISABLE_JIT": "1"}, 60) is None
    assert zygote.spawn(["--help"], {**cli_env, "PYTHONHASHSEED": "3"}) is None
    # the publish cache lives under XDG_CACHE_HOME, read by the command: a forked publish writes it there
    cache = tmp_path / "xdg"
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    env = {**cli_env, "XDG_CACHE_HOME": str(cache)}
    rc, _, err = zygote.run(["publish", ckpt, "--store", f"file://{tmp_path / 'store'}"], env, 120)
    assert rc == 0, err
    assert (cache / "weightsync").is_dir()
