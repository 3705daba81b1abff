"""Running ``python -m weightsync.cli`` as a child process in tests."""

from __future__ import annotations

import subprocess
import sys


def spawn_cli(*args, env: dict | None = None) -> subprocess.Popen:
    """Start ``weightsync ARGS...`` (text pipes for stdout and stderr)."""
    return subprocess.Popen(
        [sys.executable, "-m", "weightsync.cli", *map(str, args)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(proc: subprocess.Popen, timeout: float = 120) -> tuple[int, str, str]:
    """Wait for ``proc`` (killing it after ``timeout``): its exit status, stdout and stderr."""
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, out, err
