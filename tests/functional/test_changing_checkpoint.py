"""A checkpoint that changes while ``weightsync publish`` reads it: whatever exits 0 committed a
version whose bytes are a file as it was when scanned; anything else fails with one line and
commits nothing.

The publish runs as a subprocess (the real CLI); this process mutates its shard (replaced by
write-then-rename, appended, truncated, deleted, overwritten in place) at moments told from the
outside, so the mid-read path is always exercised: ``before-open`` when the publisher has scanned
the checkpoint and is pulling its delta base into ``$TMPDIR/weightsync-base-*`` (the shard not
yet open), ``at-open`` as soon as ``/proc/<pid>/fd`` shows the shard open for reading (a
thousand tensors take the publisher a good fraction of a second to read), and plain delays after
the start, which land anywhere.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from weightsync.demo import write_safetensors

pytestmark = pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc to see the publisher's files")

SHARD = "model.safetensors"
TENSORS, ELEMS = 1000, 2048


def _tensors(seed: int) -> dict:
    rng = np.random.default_rng(0)
    out = {}
    for i in range(TENSORS):
        a = (rng.standard_normal(ELEMS).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        if seed:  # about 2% of the elements change from step to step
            a[np.random.default_rng(seed * 100003 + i).integers(0, ELEMS, ELEMS // 50)] ^= 1
        out[f"layer.{i}.w"] = ("BF16", (ELEMS,), a.tobytes())
    return out


def _checkpoint(folder: Path, seed: int, metadata: dict | None = None) -> Path:
    folder.mkdir(parents=True)
    write_safetensors(folder / SHARD, _tensors(seed), metadata)
    (folder / "config.json").write_text('{"layers": 1000}')
    return folder


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    """Version 0 of a one-shard model in a store; checkpoint ``step1`` (its next step, to publish
    while it changes) and ``other`` (the trainer's replacement of the shard: the same tensors
    behind a longer header, so every offset moved)."""
    root = tmp_path_factory.mktemp("changing")
    _checkpoint(root / "step0", 0)
    _checkpoint(root / "step1", 1)
    _checkpoint(root / "other", 2, {"note": "x" * 200})
    rc = subprocess.run(
        [
            sys.executable,
            "-m",
            "weightsync.cli",
            "publish",
            root / "step0",
            "--store",
            f"file://{root / 'store'}",
            "--no-cache",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert rc.returncode == 0, rc.stderr
    return root


def _replace(shard: Path, other: Path) -> None:
    tmp = shard.with_name(shard.name + ".tmp")
    shutil.copyfile(other, tmp)
    os.replace(tmp, shard)


def _append(shard: Path, other: Path) -> None:
    with open(shard, "ab") as f:
        f.write(b"\x01" * 4096)


def _truncate(shard: Path, other: Path) -> None:
    os.truncate(shard, shard.stat().st_size // 2)


def _delete(shard: Path, other: Path) -> None:
    shard.unlink()


def _overwrite(shard: Path, other: Path) -> None:
    """Rewrite bytes in place, in the last tensors (the ones read last), the size unchanged."""
    with open(shard, "r+b") as f:
        f.seek(-8192, os.SEEK_END)
        f.write(b"\x7f" * 8192)


MUTATIONS = [_replace, _append, _truncate, _delete, _overwrite]
# at-open: every change fails the publish. A file replaced or deleted after the publisher opened it
# is still read whole through its descriptor, but the folder no longer holds it: committing it would
# make a version of files from two states of the folder (two training steps), so the check before
# the commit refuses it; one written, appended or truncated fails as it is read
AT_OPEN_SUCCEEDS: set = set()


def _open_by(pid: int, path: str) -> bool:
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") == path:
                return True
        except OSError:
            pass
    return False


def _wait(proc: subprocess.Popen, cond, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.0005)
    return False


def _run(template: Path, tmp_path: Path, cli_env: dict, mutate, when) -> tuple[int, str, bool | None, dict]:
    """Publish a copy of ``step1`` while ``mutate`` hits its shard at ``when``: returns the exit
    status, stderr, whether the shard was open by the publisher when it was mutated, and the shard
    before and after the mutation (None: deleted): the only files a version may hold."""
    store, ckpt, tmpdir = tmp_path / "store", tmp_path / "step1", tmp_path / "tmp"
    shutil.copytree(template / "store", store)
    shutil.copytree(template / "step1", ckpt)
    tmpdir.mkdir()
    shard = ckpt / SHARD
    before = shard.read_bytes()
    env = dict(cli_env, TMPDIR=str(tmpdir))
    proc = subprocess.Popen(
        [sys.executable, "-m", "weightsync.cli", "publish", ckpt, "--store", f"file://{store}", "--no-cache"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        pulling_base = lambda: any(n.startswith("weightsync-base-") for n in os.listdir(tmpdir))  # noqa: E731
        shard_open = lambda: _open_by(proc.pid, str(shard))  # noqa: E731
        if when == "before-open":
            assert _wait(proc, pulling_base), "the publisher never pulled its delta base"
        elif when == "at-open":
            assert _wait(proc, pulling_base) and _wait(proc, shard_open), (
                "the publisher never opened the shard to read it"
            )
        else:
            time.sleep(when)
        was_open = shard_open() if proc.poll() is None else None
        mutate(shard, template / "other" / SHARD)
        after = shard.read_bytes() if shard.exists() else None
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, err, was_open, {"before": before, "after": after}


def _check_outcome(rc: int, err: str, truth: dict, store: Path, out: Path, run_cli) -> str:
    """Exit 0: version 1 committed, and pulling it gives the shard whole as it was before the
    mutation (``"before"``) or after it (``"after"``, absent if deleted), never a mix; otherwise:
    one error line naming the shard, the store still at version 0."""
    rc_v, versions, _ = run_cli("versions", "--store", f"file://{store}", "--json")
    assert rc_v == 0
    committed = [v["version"] for v in json.loads(versions)]
    if rc != 0:
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("weightsync: error:") and SHARD in lines[0], err
        assert committed == [0], f"a failed publish committed {committed}"
        return "failed"
    assert committed == [0, 1], err
    rc_p, _, perr = run_cli("pull", "--store", f"file://{store}", "--version", 1, out)
    assert rc_p == 0, perr
    rc_v2, _, verr = run_cli("verify", "--store", f"file://{store}", "--version", 1, out)
    assert rc_v2 == 0, verr
    got = (out / SHARD).read_bytes() if (out / SHARD).exists() else None
    if got == truth["before"]:
        return "before"
    assert got == truth["after"], (
        f"version 1 holds a torn shard ({None if got is None else len(got)} bytes): "
        "neither the file before the change nor after it"
    )
    return "after"


@pytest.mark.parametrize("mutate", MUTATIONS, ids=lambda f: f.__name__.lstrip("_"))
def test_a_shard_changed_after_the_scan_fails_the_publish(mutate, template, tmp_path, cli_env, run_cli):
    """Scanned, then changed before the publisher opens it to read (the trainer's rename lands
    while the delta base is pulled): never committed with the scanned layout over other bytes."""
    rc, err, was_open, truth = _run(template, tmp_path, cli_env, mutate, "before-open")
    assert was_open is False, "the mutation did not land between the scan and the read"
    assert _check_outcome(rc, err, truth, tmp_path / "store", tmp_path / "out", run_cli) == "failed"


@pytest.mark.parametrize("mutate", MUTATIONS, ids=lambda f: f.__name__.lstrip("_"))
def test_a_shard_changed_while_it_is_read(mutate, template, tmp_path, cli_env, run_cli):
    """Changed while the publisher reads it: a replaced or deleted file is read whole through the
    descriptor already open (the version holds it as scanned); one written to fails the publish."""
    rc, err, was_open, truth = _run(template, tmp_path, cli_env, mutate, "at-open")
    assert was_open, "the mutation did not land while the shard was open for reading"
    outcome = _check_outcome(rc, err, truth, tmp_path / "store", tmp_path / "out", run_cli)
    assert outcome == ("before" if mutate in AT_OPEN_SUCCEEDS else "failed")


@pytest.mark.parametrize("delay", [0.5, 1.3])
@pytest.mark.parametrize("mutate", MUTATIONS, ids=lambda f: f.__name__.lstrip("_"))
def test_a_shard_changed_at_any_time_commits_only_a_consistent_file(
    mutate, delay, template, tmp_path, cli_env, run_cli
):
    """Changed at a delay after the start (anywhere: before the scan, during it, during the pull of
    the base, the read, the upload): exit 0 only with a whole file in the version."""
    rc, err, _, truth = _run(template, tmp_path, cli_env, mutate, delay)
    _check_outcome(rc, err, truth, tmp_path / "store", tmp_path / "out", run_cli)
