"""What a version holds of a checkpoint folder, through the command line: symlinks to folders are
followed as symlinks to files are (a Hugging Face cache snapshot is symlinks), and what cannot be
published (a top-level ``.weightsync`` that is not weightsync's state folder, a symlink loop) fails
the publish with one line; nothing is ever left out without a word (docs/FORMAT.md, section 2).
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest

import weightsync


def _files(root: Path) -> dict[str, str]:
    """relpath -> sha256 of every file under ``root``, through symlinks, outside ``.weightsync``."""
    out = {}
    for dirpath, _, names in os.walk(root, followlinks=True):
        for n in names:
            p = Path(dirpath, n)
            rel = p.relative_to(root).as_posix()
            if rel.split("/")[0] != ".weightsync":
                out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def test_a_checkpoint_of_symlinked_folders_is_published_whole(trajectory, tmp_path, ok_cli):
    """A snapshot folder whose subfolder and files are symlinks into a blob store (as the Hugging
    Face cache lays them out): every file reaches the subscriber, as a plain file."""
    blobs, snap = tmp_path / "blobs", tmp_path / "snapshot"
    shutil.copytree(trajectory[0], blobs / "model")
    (blobs / "tokenizer").mkdir()
    (blobs / "tokenizer" / "vocab.json").write_text('{"a": 0}')
    snap.mkdir()
    for f in (blobs / "model").iterdir():
        (snap / f.name).symlink_to(f)
    (snap / "tokenizer").symlink_to(blobs / "tokenizer")
    store, out = tmp_path / "store", tmp_path / "out"
    ok_cli("publish", snap, "--store", store)
    ok_cli("pull", "--store", store, out)
    assert "tokenizer/vocab.json" in _files(snap)
    assert _files(out) == _files(snap)
    assert not any(p.is_symlink() for p in out.rglob("*"))
    ok_cli("verify", "--store", store, out)


@pytest.mark.parametrize("case", ["a file named .weightsync", "a .weightsync symlink", "a symlink loop"])
def test_what_a_version_cannot_hold_fails_the_publish_with_one_line(case, trajectory, tmp_path, run_cli, ws):
    ckpt, store = tmp_path / "ckpt", tmp_path / "store"
    shutil.copytree(trajectory[0], ckpt)
    if case == "a file named .weightsync":
        (ckpt / ".weightsync").write_text("the trainer's own notes")
    elif case == "a .weightsync symlink":
        (ckpt / ".weightsync").symlink_to(trajectory[1])
    else:
        (ckpt / "extra").mkdir()
        (ckpt / "extra" / "up").symlink_to("..")
    before = ws.snapshot(store)
    rc, _, err = run_cli("publish", ckpt, "--store", store)
    assert rc != 0
    line = ws.error_line(err)
    assert ("loop" if case == "a symlink loop" else ".weightsync") in line
    assert ws.snapshot(store) == before is None
    if case != "a symlink loop":  # left out on purpose: --ignore says so
        assert run_cli("publish", ckpt, "--store", store, "--ignore", ".weightsync")[0] == 0
        assert ".weightsync" not in {f.path for f in weightsync.open_repo(store).manifest(0).files}


def _publish_under_limit(ckpt: Path, store: Path, env: dict, limit: tuple[int, int], *extra: str):
    import resource
    import subprocess
    import sys

    return subprocess.run(
        [
            sys.executable,
            "-m",
            "weightsync.cli",
            "publish",
            str(ckpt),
            "--store",
            f"file://{store}",
            "--no-progress",
            *extra,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, limit),
    )


def test_a_checkpoint_of_more_files_than_the_open_file_limit(tmp_path, cli_env, ws):
    """A publish holds every file open, and a delta as many of its base's. Past the soft limit (1024 by
    default) it said a file "changed while being published", which a publisher daemon retries for ever;
    a delta's base that could not be opened was taken for a stale cache (cleared, pulled whole again,
    failed again). It now raises the soft limit to what it needs; past the hard limit it says which
    limit, and nothing is stored."""
    import numpy as np
    from safetensors.numpy import save_file

    ckpts = [tmp_path / "ck0", tmp_path / "ck1"]
    for v, ck in enumerate(ckpts):
        ck.mkdir()
        for i in range(300):  # every file changes: a delta reads each one's base
            save_file({"w": np.full(16, i + v, np.uint16)}, str(ck / f"m{i:03d}.safetensors"))
    ok, capped = tmp_path / "raised", tmp_path / "capped"
    for v, ck in enumerate(ckpts):
        proc = _publish_under_limit(ck, ok, cli_env, (200, 4096), "--cache-dir", str(tmp_path / "cache"))
        assert proc.returncode == 0, proc.stderr
        out = tmp_path / f"out{v}"
        weightsync.pull(weightsync.open_repo(f"file://{ok}"), out, v)
        ws.assert_replica(out, ck)
    proc = _publish_under_limit(ckpts[0], capped, cli_env, (200, 200))
    line = ws.error_line(proc.stderr)
    assert proc.returncode == 1 and "Too many open files" in line and "ulimit -n" in line, proc.stderr
    assert "changed while" not in line and weightsync.open_repo(f"file://{capped}").versions() == []
