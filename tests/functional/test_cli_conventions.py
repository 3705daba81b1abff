"""Command-line and package conventions, through the real CLI where a shell would see them.

- Progress: a tqdm bar (percent, bytes, rate, time left) on stderr when it is a terminal (a pty
  here), none with ``--no-progress``, with ``TQDM_DISABLE=1`` or when stderr is a pipe.
- Shell completion: the entry point answers argcomplete's protocol (``_ARGCOMPLETE``,
  ``COMP_LINE``/``COMP_POINT``, the candidates written to fd 8), as bash does with
  ``eval "$(register-python-argcomplete weightsync)"``.
- The documented entry points are attributes of the top-level package; ``import weightsync``
  imports no torch, and the torch ones say how to get it when it is missing.
"""

from __future__ import annotations

import fcntl
import io
import os
import pty
import struct
import subprocess
import sys
import termios
import threading
from pathlib import Path

import pytest

import weightsync
from weightsync.service.progress import Progress

ROOT = Path(__file__).resolve().parents[2]
IFS = "\013"  # argcomplete's default separator of candidates


# --- progress ---------------------------------------------------------------------------------------
def run_on_a_terminal(args, env: dict) -> tuple[int, str, str]:
    """``python -m weightsync.cli *args`` with stderr on a pseudo-terminal, wide enough (400 columns) that
    tqdm never shortens a bar labelled with a long temporary path: (rc, stdout, stderr)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 400, 0, 0))
    proc = subprocess.Popen(
        [sys.executable, "-m", "weightsync.cli", *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=slave,
        stdin=subprocess.DEVNULL,
        env=env,
    )
    os.close(slave)
    chunks: list[bytes] = []

    def read() -> None:
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the child closed its end
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        out = proc.stdout.read().decode()
        proc.wait(120)
    finally:
        reader.join(30)
        os.close(master)
    return proc.returncode, out, b"".join(chunks).decode(errors="replace")


def bars(stderr: str) -> list[str]:
    """The progress bar frames tqdm drew (it redraws each one after a carriage return)."""
    return [frame.strip() for frame in stderr.replace("\r\n", "\n").split("\r") if "|" in frame and "%" in frame]


def test_progress_bar_on_a_terminal_and_its_off_switches(trajectory, tmp_path, cli_env):
    store, out = tmp_path / "store", tmp_path / "out"
    env = {k: v for k, v in cli_env.items() if not k.startswith("TQDM_")}
    rc, stdout, err = run_on_a_terminal(["publish", trajectory[0], "--store", store, "--no-cache"], env)
    assert rc == 0 and stdout.strip() == "0", err
    frames = bars(err)
    assert frames and frames[-1].startswith(f"publish {trajectory[0]}: 100%"), err
    assert "<00:00" in frames[-1] and "B/s" in frames[-1], frames[-1]  # elapsed<remaining (the ETA), rate
    assert "published version 0" in err

    rc, _, err = run_on_a_terminal(["pull", "--store", store, out], env)
    assert rc == 0 and bars(err) and bars(err)[-1].startswith(f"pull {out}: 100%"), err

    rc, _, err = run_on_a_terminal(["publish", trajectory[1], "--store", store, "--no-cache", "--no-progress"], env)
    assert rc == 0 and not bars(err) and "published version 1" in err, err
    rc, _, err = run_on_a_terminal(["pull", "--store", store, out], {**env, "TQDM_DISABLE": "1"})
    assert rc == 0 and not bars(err) and "pulled version 1" in err, err

    proc = subprocess.run(
        [sys.executable, "-m", "weightsync.cli", "publish", str(trajectory[2]), "--store", str(store), "--no-cache"],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )  # stderr: a pipe
    assert proc.returncode == 0 and not bars(proc.stderr) and "%|" not in proc.stderr, proc.stderr


def test_progress_is_off_unless_stderr_is_a_terminal_and_draws_bytes_with_an_eta():
    quiet = io.StringIO()
    p = Progress("pull x", stream=quiet)
    assert not p.enabled
    p(10, 100)
    assert quiet.getvalue() == ""

    drawn = io.StringIO()
    with Progress("pull x", stream=drawn, enabled=True) as p:
        for done in (0, 10 << 20, 40 << 20, 40 << 20):
            p(done, 40 << 20)
    frames = bars(drawn.getvalue())
    assert frames[-1].startswith("pull x: 100%") and "40.0M/40.0M" in frames[-1], frames
    with Progress("never", stream=drawn, enabled=False) as p:
        p(1, 2)
    assert "never" not in drawn.getvalue()


def test_every_long_command_has_the_off_switch(run_cli):
    for command in ("publish", "publish-part", "pull"):
        rc, text, _ = run_cli(command, "--help")
        assert rc == 0 and "--no-progress" in text and "TQDM_DISABLE" in text, command


# --- shell completion -------------------------------------------------------------------------------
def complete(line: str, env: dict) -> list[str]:
    """The candidates the entry point offers for the cursor at the end of ``line`` (argcomplete's
    protocol: the shell's fd 8 receives them; here it is the pipe we read, stdout goes nowhere)."""
    env = {
        **env,
        "_ARGCOMPLETE": "1",
        "_ARGCOMPLETE_IFS": IFS,
        "COMP_LINE": line,
        "COMP_POINT": str(len(line)),
        "COMP_TYPE": "9",
    }
    proc = subprocess.run(
        ["sh", "-c", 'exec "$@" 8>&1 >/dev/null', "sh", sys.executable, "-m", "weightsync.cli"],
        check=False,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return sorted(c for c in proc.stdout.split(IFS) if c)


def test_shell_completion_offers_commands_options_and_paths(tmp_path, cli_env):
    assert complete("weightsync ver", cli_env) == ["verify", "versions"]
    assert "subscriber" in complete("weightsync ", cli_env)
    pull = complete("weightsync pull --", cli_env)
    assert {"--store", "--version", "--no-progress", "--concurrency"} <= set(pull), pull
    assert complete("weightsync verify --sto", cli_env) == ["--store "]  # the one candidate, and a space after it
    (tmp_path / "replica_a").mkdir()
    (tmp_path / "replica_b").mkdir()
    paths = complete(f"weightsync verify --store {tmp_path}/st {tmp_path}/repl", cli_env)
    assert paths == [f"{tmp_path}/replica_a/", f"{tmp_path}/replica_b/"], paths


def test_entry_point_carries_the_argcomplete_marker():
    """register-python-argcomplete's global mode completes only scripts marked in their first 1 KiB."""
    assert "PYTHON_ARGCOMPLETE_OK" in (ROOT / "weightsync" / "cli.py").read_bytes()[:1024].decode()


# --- the top-level package ----------------------------------------------------------------------------
def test_import_weightsync_imports_no_torch_and_exports_the_entry_points():
    code = """
import sys
import weightsync
assert "torch" not in sys.modules, "import weightsync imported torch"
from weightsync import StateDictPublisher, commit_parts, publish_part, publish_state_dict
import weightsync.parts, weightsync.publisher
assert publish_state_dict is weightsync.publisher.publish_state_dict
assert StateDictPublisher is weightsync.publisher.StateDictPublisher
assert publish_part is weightsync.parts.publish_part and commit_parts is weightsync.parts.commit_parts
assert "torch" not in sys.modules, "the torch-free entry points imported torch"
namespace = {}
exec("from weightsync import *", namespace)
assert "torch" not in sys.modules and "publish_state_dict" in namespace and "TorchSink" not in namespace
from weightsync import DeviceDiffPublisher, TorchSink
import weightsync.torch.device, weightsync.torch
assert TorchSink is weightsync.torch.TorchSink and DeviceDiffPublisher is weightsync.torch.device.DeviceDiffPublisher
assert weightsync.CoverageError is weightsync.torch.CoverageError
assert {"TorchSink", "publish_state_dict", "publish_part"} <= set(dir(weightsync))
"""
    proc = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_without_torch_the_package_works_and_the_torch_entry_points_say_what_to_install():
    code = """
import sys
sys.modules["torch"] = None  # as if torch were not installed
import weightsync
from weightsync import publish_state_dict  # needs no torch to import
for name in ("TorchSink", "DeviceDiffPublisher"):
    try:
        getattr(weightsync, name)
    except ImportError as exc:
        assert "pip install 'weightsync[torch]'" in str(exc), exc
    else:
        raise AssertionError(name + " without torch")
"""
    proc = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_unknown_attributes_still_raise_attribute_error():
    with pytest.raises(AttributeError):
        weightsync.no_such_entry_point  # noqa: B018
    assert not hasattr(weightsync, "no_such_entry_point")
