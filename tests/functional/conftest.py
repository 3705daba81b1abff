"""Fixtures for the functional tests: tiny synthetic checkpoints, the CLI as a subprocess, tree snapshots.

Every test runs the real ``weightsync`` command line (``python -m weightsync.cli``, forked from a
process that started once: tests/cli_zygote.py) against a file store in a temporary directory.
``XDG_CACHE_HOME`` points into the test's temporary directory, so the publish cache never touches
the user's home.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import types
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import cli_zygote as cli_zygote_module
import pytest
from cli_zygote import Zygote

from weightsync.demo import make_trajectory

TINY = {"hidden": 32, "layers": 1, "experts": 2, "vocab": 128}
STATE_DIR = ".weightsync"


@pytest.fixture(scope="session", autouse=True)
def _kernels(compiled_kernels, cli_zygote):
    """Every functional test may start processes: the kernels are in numba's cache first
    (tests/conftest.py), and the zygote that forks commands and daemons is started (tests/cli_zygote.py)."""


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while buf := f.read(1 << 20):
            h.update(buf)
    return h.hexdigest()


def snapshot(root: Path) -> dict[str, str] | None:
    """Every entry under ``root`` (hidden ones included): relpath -> sha256, ``<dir>`` or ``<link>``.

    None if ``root`` does not exist, so "absent before, absent after" compares equal too.
    """
    root = Path(root)
    if not root.exists():
        return None
    out: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            p = Path(dirpath, d)
            out[p.relative_to(root).as_posix()] = "<link>" if p.is_symlink() else "<dir>"
        for name in filenames:
            p = Path(dirpath, name)
            out[p.relative_to(root).as_posix()] = "<link>" if p.is_symlink() else sha256_file(p)
    return out


def content(root: Path) -> dict[str, str]:
    """The files of a checkpoint or replica folder (not ``.weightsync``): relpath -> sha256."""
    snap = snapshot(root) or {}
    return {p: h for p, h in snap.items() if h != "<dir>" and p.split("/")[0] != STATE_DIR}


def entries(root: Path) -> set[str]:
    """Every file and directory path under ``root`` outside ``.weightsync``."""
    snap = snapshot(root) or {}
    return {p for p in snap if p.split("/")[0] != STATE_DIR}


def expected_entries(checkpoint: Path) -> set[str]:
    """What a replica of ``checkpoint`` may hold outside ``.weightsync``: its files and their parents."""
    out = set()
    for p in content(checkpoint):
        parts = p.split("/")
        out.update("/".join(parts[: i + 1]) for i in range(len(parts)))
    return out


def assert_replica(out_dir: Path, checkpoint: Path) -> None:
    """``out_dir`` holds exactly ``checkpoint``'s files byte for byte, plus at most ``.weightsync``."""
    assert content(out_dir) == content(checkpoint)
    assert entries(out_dir) == expected_entries(checkpoint)
    top = {p.name for p in Path(out_dir).iterdir()}
    assert top <= {p.split("/")[0] for p in expected_entries(checkpoint)} | {STATE_DIR}, top


def flip_byte(path: Path, offset: int) -> None:
    """XOR one byte of a file in place (negative offsets count from the end)."""
    with open(path, "r+b") as f:
        size = f.seek(0, os.SEEK_END)
        pos = offset % size
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ 0x5A]))


def tensor_data_offset(path: Path) -> int:
    """First byte after a safetensors file's header (where tensor data starts)."""
    with open(path, "rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")


CliResult = tuple[int, str, str]


def _run(args, env, timeout, cwd=None) -> CliResult:
    proc = subprocess.run(
        [sys.executable, "-m", "weightsync.cli", *map(str, args)],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        cwd=cwd,
    )
    return proc.returncode, proc.stdout, proc.stderr


@pytest.fixture(scope="session")
def cli_env(tmp_path_factory) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WEIGHTSYNC_")}  # no stray flag defaults
    env["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("xdg-cache"))
    env.pop("AWS_ENDPOINT_URL", None)
    return env


@pytest.fixture(scope="session")
def cli_zygote(cli_env, tmp_path_factory, compiled_kernels) -> Iterator[Zygote | None]:
    """The CLI forked from a process that started once (tests/cli_zygote.py) and loaded the kernels
    from numba's cache; None with ``TESTS_FRESH_CLI=1`` in the tests' environment (every command a
    fresh process)."""
    if os.environ.get("TESTS_FRESH_CLI") == "1":
        yield None
        return
    zygote = Zygote(cli_env, tmp_path_factory.mktemp("zygote"))
    if not zygote.usable:
        warnings.warn(f"every CLI command starts a process: the zygote is not usable: {zygote.why}", stacklevel=1)
    cli_zygote_module.set_current(zygote)  # for the daemons tests start (test_daemons.Daemon)
    yield zygote
    cli_zygote_module.set_current(None)
    zygote.close()


@pytest.fixture(scope="session")
def run_cli(cli_env, cli_zygote) -> Callable[..., CliResult]:
    """``run_cli(*args, timeout=120, cwd=None)`` runs ``python -m weightsync.cli *args``, forked from
    the zygote where it can (see tests/cli_zygote.py); returns (rc, stdout, stderr)."""

    def run(*args, timeout: float = 120, cwd=None) -> CliResult:
        forked = cli_zygote.run(args, cli_env, timeout, cwd) if cli_zygote is not None else None
        return forked if forked is not None else _run(args, cli_env, timeout, cwd)

    return run


@pytest.fixture(scope="session")
def ok_cli(run_cli) -> Callable[..., str]:
    """Like ``run_cli`` but fails the test unless the command exits 0; returns stdout."""

    def run(*args, timeout: float = 120, cwd=None) -> str:
        rc, out, err = run_cli(*args, timeout=timeout, cwd=cwd)
        assert rc == 0, f"weightsync {' '.join(map(str, args))} exited {rc}\nstdout: {out}\nstderr: {err}"
        return out

    return run


@pytest.fixture
def trajectory(tmp_path) -> list[Path]:
    """Six checkpoints (steps 0..5) of a tiny MoE model in two shards with an index.json."""
    return make_trajectory(tmp_path / "traj", steps=5, shards=2, **TINY)


@pytest.fixture(scope="session")
def _published_template(tmp_path_factory, ok_cli) -> Path:
    root = tmp_path_factory.mktemp("published")
    traj = make_trajectory(root / "traj", steps=5, shards=2, **TINY)
    for i, ckpt in enumerate(traj):
        out = ok_cli("publish", ckpt, "--store", f"file://{root / 'store'}", "--keyframe-interval", 3, "--no-cache")
        assert out.strip().splitlines()[-1] == str(i)
    return root


@pytest.fixture
def published(_published_template, tmp_path) -> tuple[Path, list[Path]]:
    """A fresh copy of a store holding the tiny trajectory as versions 0..5 (keyframes at 0 and 3),
    and the six source checkpoints: (store_dir, [checkpoint_dir, ...])."""
    shutil.copytree(_published_template / "store", tmp_path / "store")
    shutil.copytree(_published_template / "traj", tmp_path / "traj")
    return tmp_path / "store", sorted((tmp_path / "traj").iterdir())


def error_line(stderr: str) -> str:
    """The single line a failing command printed on stderr; fails unless there is exactly one."""
    lines = stderr.splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}:\n{stderr}"
    assert lines[0].startswith("weightsync: error:"), lines[0]
    return lines[0]


@pytest.fixture(scope="session")
def ws():
    """The helpers above for test modules (they cannot import this conftest reliably by name)."""
    return types.SimpleNamespace(
        sha256_file=sha256_file,
        snapshot=snapshot,
        content=content,
        entries=entries,
        expected_entries=expected_entries,
        assert_replica=assert_replica,
        flip_byte=flip_byte,
        tensor_data_offset=tensor_data_offset,
        error_line=error_line,
        TINY=TINY,
    )
