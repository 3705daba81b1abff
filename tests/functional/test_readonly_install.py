"""A pull from a read-only install: the package directory and every cache directory read-only.

This is a subscriber container with ``readOnlyRootFilesystem`` and no writable home: numba's
``cache=True`` used to refuse to import the kernels there (``cannot cache function 'gap_width': no
locator available``), so every pull failed. Each pull here is a real subprocess in its own mount
namespace (``unshare``) in which the package directory (a copy of this tree's ``weightsync``), the
home directory, ``XDG_CACHE_HOME`` and ``NUMBA_CACHE_DIR`` are read-only bind mounts; the subprocess
first checks that it cannot write any of them.

Then the image's arrangement: ``NUMBA_CACHE_DIR`` filled once by ``python -m weightsync.codec.jit`` (the
Docker build step), read-only at run time, serves every kernel a pull needs without compiling.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]

# Read-only bind mounts of the directories before "--", then exec the command after it.
_MOUNT_RO = (
    'while [ "$1" != -- ]; do mount --bind "$1" "$1" && mount -o remount,bind,ro "$1" || exit 97; shift; '
    'done; shift; exec "$@"'
)

_PULL = r"""
import json, os, sys
from pathlib import Path

for d in os.environ["RO_DIRS"].split(os.pathsep):  # the test's premise: none of these can be written
    try:
        Path(d, ".write-probe").touch()
    except OSError:
        continue
    sys.exit(f"{d} is writable")
import weightsync
assert weightsync.__file__.startswith(os.environ["RO_SITE"]), weightsync.__file__
from weightsync.cli import main

store, out = sys.argv[1:3]
if main(["pull", "--store", store, out]) != 0 or main(["verify", "--store", store, out]) != 0:
    sys.exit("pull or verify failed")
import weightsync.codec.arith, weightsync.codec.kernels  # every kernel module imports
from weightsync.codec import jit

print(json.dumps(jit.stats()))
"""


def _unshare() -> list[str] | None:
    """The ``unshare`` command line that gives a mount namespace in which read-only bind mounts work
    here (an unprivileged user namespace, or root's own), or None."""
    if shutil.which("unshare") is None or shutil.which("mount") is None:
        return None
    for argv in (["unshare", "--user", "--map-root-user", "--mount"], ["unshare", "--mount"]):
        probe = Path(os.environ.get("TMPDIR", "/tmp")) / f"ws-ro-probe-{os.getpid()}"
        probe.mkdir(exist_ok=True)
        try:
            r = subprocess.run(
                [*argv, "sh", "-c", _MOUNT_RO, "sh", str(probe), "--", "sh", "-c", 'touch "$1"/x', "sh", str(probe)],
                capture_output=True,
                timeout=30,
                check=False,
            )
            if r.returncode not in (0, 97) and not (probe / "x").exists():
                return argv  # mounted, and the write failed
        finally:
            shutil.rmtree(probe, ignore_errors=True)
    return None


@pytest.fixture(scope="module")
def unshare() -> list[str]:
    argv = _unshare()
    if argv is None:
        pytest.skip("no mount namespace with read-only bind mounts here (unshare -rm / unshare -m)")
    return argv


@pytest.fixture
def install(tmp_path) -> dict[str, Path]:
    """A copy of the package (no __pycache__) and empty home, XDG cache and numba cache directories."""
    dirs = {name: tmp_path / name for name in ("site", "home", "xdg-cache", "numba-cache")}
    for d in dirs.values():
        d.mkdir()
    shutil.copytree(
        ROOT / "weightsync", dirs["site"] / "weightsync", ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
    )
    return dirs


def _env(install: dict[str, Path], read_only: list[Path] = ()) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NUMBA_", "XDG_", "PYTHON"))}
    env.update(
        HOME=str(install["home"]),
        XDG_CACHE_HOME=str(install["xdg-cache"]),
        PYTHONPATH=str(install["site"]),
        NUMBA_CACHE_DIR=str(install["numba-cache"]),
        PYTHONDONTWRITEBYTECODE="1",
        RO_SITE=str(install["site"]),
        RO_DIRS=os.pathsep.join(map(str, read_only)),
    )
    return env


def _pull_read_only(unshare, install, store: Path, out: Path, writable: tuple[str, ...] = ()) -> dict[str, int]:
    """Pull and verify the latest version into ``out`` with every directory of ``install`` but
    ``writable`` read-only; the kernels' stats (signatures loaded from a cache and compiled)."""
    read_only = [d for name, d in install.items() if name not in writable]
    r = subprocess.run(
        [
            *unshare,
            "sh",
            "-c",
            _MOUNT_RO,
            "sh",
            *map(str, read_only),
            "--",
            sys.executable,
            "-c",
            _PULL,
            f"file://{store}",
            str(out),
        ],
        env=_env(install, read_only),
        cwd=out.parent,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert r.returncode == 0, f"exit {r.returncode}\nstdout: {r.stdout}\nstderr: {r.stderr}"
    return json.loads(r.stdout.strip().splitlines()[-1])


def _no_writes(install: dict[str, Path], before: dict[str, list[str]]) -> None:
    for name, d in install.items():
        assert sorted(p.relative_to(d).as_posix() for p in d.rglob("*")) == before[name], f"{name} was written"


def _listing(install: dict[str, Path]) -> dict[str, list[str]]:
    return {name: sorted(p.relative_to(d).as_posix() for p in d.rglob("*")) for name, d in install.items()}


def test_pull_from_a_read_only_install_without_any_cache(unshare, install, published, tmp_path, ws):
    store, checkpoints = published
    before = _listing(install)
    stats = _pull_read_only(unshare, install, store, tmp_path / "out")
    ws.assert_replica(tmp_path / "out", checkpoints[-1])
    assert stats["compiled"] > 0 and stats["cached"] == 0, stats  # the deltas' kernels ran, compiled here
    _no_writes(install, before)


@pytest.mark.exclusive  # compiles every kernel with a process per core
def test_pull_from_a_read_only_install_loads_a_prefilled_numba_cache(unshare, install, published, tmp_path, ws):
    """NUMBA_CACHE_DIR filled at "build time" (writable then), read-only at run time: no compiling."""
    store, checkpoints = published
    fill = subprocess.run(
        [sys.executable, "-m", "weightsync.codec.jit", "--jobs", "2"],  # as the Dockerfile fills it
        env=_env(install),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert fill.returncode == 0, fill.stderr
    filled = json.loads(fill.stdout.strip().splitlines()[-1])
    assert (
        filled["compiled"] + filled["compiled_by_jobs"] > 0
        and filled["writable"]
        and filled["writable"][0].startswith(str(install["numba-cache"]))
    )
    assert any(install["numba-cache"].rglob("*.nbi")), "nothing was cached"
    before = _listing(install)
    stats = _pull_read_only(unshare, install, store, tmp_path / "out")
    ws.assert_replica(tmp_path / "out", checkpoints[-1])
    assert stats["compiled"] == 0 and stats["cached"] > 0, stats
    _no_writes(install, before)

    # The publisher's pod: a writable XDG_CACHE_HOME (an emptyDir) in front of the image's cache,
    # which still serves every kernel; nothing is compiled, so nothing is saved there.
    stats = _pull_read_only(unshare, install, store, tmp_path / "out-2", writable=("xdg-cache",))
    ws.assert_replica(tmp_path / "out-2", checkpoints[-1])
    assert stats["compiled"] == 0 and stats["cached"] > 0, stats
    assert not any(p.is_file() for p in install["xdg-cache"].rglob("*"))
