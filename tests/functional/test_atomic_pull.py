"""An interrupted pull never leaves a mix of versions: kill -9 at random moments and at every step
of the install, and errors mid-way.

The kills are real SIGKILLs of a ``weightsync pull`` subprocess. Random kills hit a ~64 MB update
while it runs; the deterministic ones come from a driver that runs the same CLI ``main`` with
``os.replace``/``os.fsync`` wrapped to SIGKILL the process right after the n-th call of a kind, so
every step of the install protocol (staging, journal, each rename, the state file) is covered.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from weightsync.demo import write_safetensors
from weightsync.local.install import recover
from weightsync.local.state import read_state

# Runs ``weightsync.cli.main(argv)`` and kills itself (or raises) right after the n-th event of a kind:
#   fsync N    the n-th fsync: a file written into staging (nothing installed yet)
#   journal N  the journal of renames is in place (before any rename)
#   rename N   the n-th file of the new version renamed into the folder
#   state N    the new state.json is in place (before the journal is removed)
#   enospc N   like fsync, but the n-th fsync fails with ENOSPC instead of killing
#   edit N     like fsync, but flips the last byte of same.json in the folder (another writer) and goes on
#   restage N  like edit, but flips the last byte of the staged model-0.safetensors (written and fsynced)
DRIVER = r"""
import errno, os, signal, sys
kind, n, out = sys.argv[1], int(sys.argv[2]), os.path.abspath(sys.argv[3])
seen = {"n": 0}
real_replace, real_fsync = os.replace, os.fsync

def hit():
    seen["n"] += 1
    return seen["n"] == n

def replace(src, dst, *a, **k):
    real_replace(src, dst, *a, **k)
    d = os.path.abspath(os.fspath(dst))
    inside = d.startswith(out + os.sep) and not d.startswith(os.path.join(out, ".weightsync") + os.sep)
    if (kind == "journal" and d == os.path.join(out, ".weightsync", "journal.json") and hit()) or \
       (kind == "state" and d == os.path.join(out, ".weightsync", "state.json") and hit()) or \
       (kind == "rename" and inside and hit()):
        os.kill(os.getpid(), signal.SIGKILL)

def fsync(fd):
    real_fsync(fd)
    if kind in ("fsync", "enospc", "edit", "restage") and hit():
        if kind in ("edit", "restage"):
            path = os.path.join(out, "same.json" if kind == "edit" else ".weightsync/staging/model-0.safetensors")
            data = bytearray(open(path, "rb").read())
            data[-1] ^= 1
            open(path, "wb").write(bytes(data))
            return
        if kind == "enospc":
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        os.kill(os.getpid(), signal.SIGKILL)

os.replace, os.fsync = replace, fsync
from weightsync.cli import main
sys.exit(main(sys.argv[4:]))
"""


def _journal(out: Path) -> bool:
    return (out / ".weightsync" / "journal.json").exists()


def _holds(ws, out: Path, ckpt: Path) -> bool:
    return ws.content(out) == ws.content(ckpt) and ws.entries(out) == ws.expected_entries(ckpt)


def _verifies(run_cli, store, version, out) -> bool:
    return run_cli("verify", "--store", store, "--version", version, out)[0] == 0


def _old_or_new(ws, run_cli, store, out, old: tuple[int, Path], new: tuple[int, Path]) -> int:
    """Which of the two versions ``out`` holds completely; fails the test if neither."""
    for v, ckpt in (old, new):
        if _verifies(run_cli, store, v, out):
            assert _holds(ws, out, ckpt)
            return v
    pytest.fail(f"{out} holds neither version {old[0]} nor version {new[0]}: {sorted(ws.content(out))}")


# --- deterministic kill points on a small checkpoint whose files change, appear and disappear -------
def _small_versions(root: Path) -> list[Path]:
    rng = np.random.default_rng(11)
    out = []
    for v in range(2):
        d = root / f"v{v}"
        (d / "sub").mkdir(parents=True)
        for k in range(3):
            w = rng.integers(0, 256, 4096 + 512 * k, dtype=np.uint8).tobytes()
            write_safetensors(d / f"model-{k}.safetensors", {f"w{k}": ("U8", (len(w),), w)})
        if v == 0:
            (d / "old_only.bin").write_bytes(b"gone in version 1")
            (d / "sub" / "old.txt").write_text("gone too")
        else:
            (d / "new_only.bin").write_bytes(b"new in version 1")
            (d / "sub" / "new.txt").write_text("new")
        (d / "same.json").write_text("{}")
        out.append(d)
    return out


@pytest.fixture(scope="module")
def small_store(tmp_path_factory, ok_cli):
    root = tmp_path_factory.mktemp("small")
    versions = _small_versions(root / "src")
    store = root / "store"
    for d in versions:
        ok_cli("publish", d, "--store", store, "--no-cache")
    ok_cli("pull", "--store", store, "--version", 0, root / "at_v0")
    return store, versions, root / "at_v0"


def _drive(cli_env, kind: str, n: int, out: Path, *args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", DRIVER, kind, str(n), str(out), *map(str, args)],
        check=False,
        capture_output=True,
        text=True,
        env=cli_env,
        timeout=120,
    )


# Staging kills must leave version 0 as it was; from the journal on, recovery rolls forward to 1.
# Version 1 installs 5 files (3 shards, new_only.bin, sub/new.txt) and removes 2.
KILL_POINTS = [("fsync", 1, 0), ("fsync", 5, 0), ("journal", 1, 1), ("rename", 1, 1), ("rename", 4, 1), ("state", 1, 1)]


@pytest.mark.parametrize("kind,n,expect", KILL_POINTS, ids=[f"{k}{n}" for k, n, _ in KILL_POINTS])
def test_kill_at_each_install_step(kind, n, expect, small_store, tmp_path, cli_env, run_cli, ws):
    store, versions, at_v0 = small_store
    out = tmp_path / "out"
    shutil.copytree(at_v0, out)
    proc = _drive(cli_env, kind, n, out, "pull", "--store", store, "--version", 1, out)
    assert proc.returncode == -signal.SIGKILL, f"the kill point was never reached:\n{proc.stderr}"

    if expect == 0:
        assert not _journal(out)
        assert _holds(ws, out, versions[0])  # untouched: not one file of version 1 is visible
        assert _verifies(run_cli, store, 0, out)
    else:
        assert _journal(out)
        # the renames are not finished: the folder is a mix until recovery rolls it forward, which
        # every weightsync command that touches the folder runs first
        recover(out)
        assert not _journal(out)
        assert _holds(ws, out, versions[1])
        assert _verifies(run_cli, store, 1, out)

    rc, _, stderr = run_cli("pull", "--store", store, "--version", 1, out)
    assert rc == 0, stderr
    assert f"from version {expect}:" in stderr
    if expect == 1:
        assert " 0 files written" in stderr  # recovery completed the install, nothing to redo
    ws.assert_replica(out, versions[1])
    assert not (out / ".weightsync" / "staging").exists()


def test_recovery_by_the_next_pull(small_store, tmp_path, cli_env, run_cli, ws):
    """A kill mid-rename, then straight away a pull of the *old* version: rolls forward, then back."""
    store, versions, at_v0 = small_store
    out = tmp_path / "out"
    shutil.copytree(at_v0, out)
    assert (
        _drive(cli_env, "rename", 2, out, "pull", "--store", store, "--version", 1, out).returncode == -signal.SIGKILL
    )
    rc, _, stderr = run_cli("pull", "--store", store, "--version", 0, out)
    assert rc == 0, stderr
    assert f"{out}: finished the install of version 1, which a process left unfinished" in stderr
    assert "from version 1:" in stderr
    ws.assert_replica(out, versions[0])


@pytest.mark.parametrize(
    "change", ["kept-after-kill", "staged-after-kill", "kept-while-staging", "staged-while-staging"]
)
def test_a_file_changed_during_an_install_is_not_recorded_as_the_version(
    change, small_store, tmp_path, cli_env, run_cli, ws
):
    """Each keeping its size: a file version 1 keeps (same.json) edited in the folder after a kill
    once the journal was in place, or a staged file changed then, or same.json edited while the
    pull stages version 1, or a staged file changed after it was written (another process in
    .weightsync). None of them is recorded as version 1 (the pull fails, the folder claims no
    version; before, each ended with wrong bytes and exit 0, and every later pull kept them); the
    next pull rebuilds it."""
    store, versions, at_v0 = small_store
    out = tmp_path / "out"
    shutil.copytree(at_v0, out)
    if change == "kept-while-staging":
        proc = _drive(cli_env, "edit", 1, out, "pull", "--store", store, "--version", 1, out)
        assert proc.returncode == 1 and "same.json, which version 1 keeps, changed while" in proc.stderr, proc.stderr
    elif change == "staged-while-staging":  # written, hashed, fsynced: then changed by another writer
        proc = _drive(cli_env, "restage", 2, out, "pull", "--store", store, "--version", 1, out)
        assert proc.returncode == 1 and "model-0.safetensors of version 1 changed before its install" in proc.stderr, (
            proc.stderr
        )
    else:
        assert _drive(cli_env, "journal", 1, out, "pull", "--store", store, "--version", 1, out).returncode == (
            -signal.SIGKILL
        )
        path = out / "same.json" if change == "kept-after-kill" else out / ".weightsync/staging/model-0.safetensors"
        data = bytearray(path.read_bytes())
        data[-1] ^= 1
        path.write_bytes(bytes(data))
        rc, _, stderr = run_cli("pull", "--store", store, "--version", 1, out)
        says = "changed while" if change == "kept-after-kill" else "changed before its install (while the install was"
        assert rc == 1 and says in stderr and len(stderr.splitlines()) == 1, stderr
    assert read_state(out) is None
    rc, _, stderr = run_cli("pull", "--store", store, "--version", 1, out)
    assert rc == 0, stderr
    ws.assert_replica(out, versions[1])
    assert _verifies(run_cli, store, 1, out)


def test_error_while_staging_leaves_old_version(small_store, tmp_path, cli_env, run_cli, ws):
    store, versions, at_v0 = small_store
    out = tmp_path / "out"
    shutil.copytree(at_v0, out)
    proc = _drive(cli_env, "enospc", 2, out, "pull", "--store", store, "--version", 1, out)
    assert proc.returncode not in (0, -signal.SIGKILL), proc.stderr
    assert "No space left on device" in proc.stderr
    assert not _journal(out)
    assert _holds(ws, out, versions[0])
    assert _verifies(run_cli, store, 0, out)
    rc, _, stderr = run_cli("pull", "--store", store, "--version", 1, out)
    assert rc == 0, stderr
    ws.assert_replica(out, versions[1])


# --- random kills while a ~64 MB folder is updated --------------------------------------------------
@pytest.fixture(scope="module")
def big_store(tmp_path_factory, ok_cli):
    """Versions 0..2 of a 64 MB checkpoint (4 shards of 4 x 4 MB F32 tensors) with about a third
    of the elements changing per version, so a pull from 0 to 2 decodes and rewrites everything."""
    root = tmp_path_factory.mktemp("big")
    rng = np.random.default_rng(5)
    shards = {
        f"model-{k:05d}-of-00004.safetensors": [rng.standard_normal(1 << 20, dtype=np.float32) for _ in range(4)]
        for k in range(4)
    }
    store, versions = root / "store", []
    for v in range(3):
        d = root / "src" / f"v{v}"
        d.mkdir(parents=True)
        for fname, tensors in shards.items():
            for t in tensors if v else ():
                t[rng.integers(0, t.size, t.size // 3)] += np.float32(1e-3)
            write_safetensors(
                d / fname, {f"{fname[:11]}.w{j}": ("F32", t.shape, t.tobytes()) for j, t in enumerate(tensors)}
            )
        (d / "config.json").write_text(json.dumps({"version": v}))
        base = ["--base", versions[-1]] if versions else []
        ok_cli("publish", d, "--store", store, "--no-cache", *base, timeout=300)
        versions.append(d)
    return store, versions


def _started(out: Path) -> bool:
    return (out / ".weightsync" / "spool").exists() or (out / ".weightsync" / "staging").exists()


def test_random_kills_during_pull(big_store, tmp_path, cli_env, run_cli, ok_cli, ws):
    store, versions = big_store
    out = tmp_path / "out"
    ok_cli("pull", "--store", store, "--version", 0, out)
    seed = int(os.environ.get("WEIGHTSYNC_TEST_SEED", time.time_ns() & 0xFFFF))
    rng = random.Random(seed)

    # how long the work of an update takes once the process has started it
    t0 = time.monotonic()
    ok_cli("pull", "--store", store, "--version", 2, out)
    whole = time.monotonic() - t0
    ok_cli("pull", "--store", store, "--version", 0, out)

    rounds = 4
    outcomes = []
    for i in range(rounds):
        old, new = (0, 2) if i % 2 == 0 else (2, 0)
        proc = subprocess.Popen(
            [sys.executable, "-m", "weightsync.cli", "pull", "--store", str(store), "--version", str(new), str(out)],
            env=cli_env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        deadline = time.monotonic() + 60
        while not _started(out) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.001)
        # one random moment in each quarter of the work, so early and late kills both happen
        time.sleep(rng.uniform(i / rounds, (i + 1) / rounds) * max(0.05, whole - 0.3))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        stderr = proc.stderr.read().decode()
        proc.stderr.close()
        killed = proc.returncode == -signal.SIGKILL
        assert killed or proc.returncode == 0, stderr

        staging = out / ".weightsync" / "staging"
        phase = "installing" if _journal(out) else "staging" if staging.exists() else "other" if killed else "exited"
        if _journal(out):
            recover(out)
        held = _old_or_new(ws, run_cli, store, out, (old, versions[old]), (new, versions[new]))
        outcomes.append((phase, "old" if held == old else "new"))

        ok_cli("pull", "--store", store, "--version", new, out)
        ws.assert_replica(out, versions[new])
        assert not (out / ".weightsync" / "staging").exists()
    print(f"seed {seed}: kill outcomes (phase, version held): {outcomes}")
    assert any(held == "old" for _, held in outcomes), "no kill landed while the pull was working"


def test_corrupt_late_chunk_leaves_old_version(big_store, tmp_path, run_cli, ok_cli, ws):
    """The payload of the last file of version 2 is corrupted in the store: nothing is installed."""
    store, versions = big_store
    manifest = json.loads((store / "versions" / f"{2:020d}.json").read_bytes())
    last = manifest["files"][-1] if manifest["files"][-1]["path"].endswith(".safetensors") else manifest["files"][-2]
    part = next(s for s in reversed(last["segments"]) if s["payload"])["payload"]["parts"][-1]
    chunk_id = manifest["chunks"][part[0]]["id"]
    chunk = store / "chunks" / chunk_id[:2] / chunk_id
    original = chunk.read_bytes()
    out = tmp_path / "out"
    ok_cli("pull", "--store", store, "--version", 0, out)
    try:
        ws.flip_byte(chunk, part[1] + part[2] - 1)
        rc, _, stderr = run_cli("pull", "--store", store, "--version", 2, out)
        assert rc != 0
        line = ws.error_line(stderr)
        assert "checksum" in line and chunk_id in line
        assert not _journal(out)
        ws.assert_replica(out, versions[0])
        assert _verifies(run_cli, store, 0, out)
    finally:
        chunk.write_bytes(original)
    ok_cli("pull", "--store", store, "--version", 2, out)
    ws.assert_replica(out, versions[2])
