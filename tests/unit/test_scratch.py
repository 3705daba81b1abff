"""Scratch folders a killed process does not leak (:mod:`weightsync.local.scratch`), with real
processes killed by SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import textwrap

import weightsync
from weightsync.demo import make_trajectory
from weightsync.local.scratch import ScratchDir, sweep

HOLD = textwrap.dedent(
    """
    import sys, time
    from weightsync.local.scratch import ScratchDir
    s = ScratchDir(sys.argv[1], "a test holder", sys.argv[2])
    (s.path / "payload").write_bytes(b"x" * 4096)
    print(s.path, flush=True)
    time.sleep(600)
    """
)


def _holder(prefix: str, parent) -> tuple[subprocess.Popen, str]:
    p = subprocess.Popen([sys.executable, "-c", HOLD, prefix, str(parent)], stdout=subprocess.PIPE, text=True)
    return p, p.stdout.readline().strip()


def test_a_scratch_folder_is_claimed_while_open_and_removed_on_close(tmp_path):
    with ScratchDir("ws-test-", "this test", tmp_path) as path:
        assert path.parent == tmp_path and path.name.startswith("ws-test-")
        assert (path / ".weightsync" / "lock").read_text().startswith("this test (pid ")
        (path / "f").write_bytes(b"1")
        assert sweep(tmp_path, "ws-test-") == []  # held by this process
    assert list(tmp_path.iterdir()) == []


def test_a_killed_processs_folder_is_removed_by_the_next_and_a_live_ones_kept(tmp_path):
    dead, dead_path = _holder("ws-test-", tmp_path)
    live, live_path = _holder("ws-test-", tmp_path)
    try:
        dead.send_signal(signal.SIGKILL)
        dead.wait(30)
        plain = tmp_path / "ws-test-plain"  # no claim at all: not ours to judge
        plain.mkdir()
        unwritten = tmp_path / "ws-test-unwritten" / ".weightsync"  # its process is between creating and locking
        unwritten.mkdir(parents=True)
        (unwritten / "lock").touch()
        other = tmp_path / "other-prefix"
        other.mkdir()
        (tmp_path / "ws-test-link").symlink_to(live_path)
        assert os.path.isdir(dead_path)
        with ScratchDir("ws-test-", "the next one", tmp_path) as mine:
            assert not os.path.exists(dead_path)
            left = {p.name for p in tmp_path.iterdir()}
            assert left == {
                os.path.basename(live_path),
                "ws-test-plain",
                "ws-test-unwritten",
                "other-prefix",
                "ws-test-link",
                mine.name,
            }
            assert (tmp_path / os.path.basename(live_path) / "payload").stat().st_size == 4096
    finally:
        live.kill()
        live.wait(30)
    assert sweep(tmp_path, "ws-test-") == [tmp_path / os.path.basename(live_path)]  # dead now too


def test_a_publish_without_cache_leaves_no_scratch_base_and_sweeps_a_dead_ones(tmp_path, monkeypatch):
    scratch_root = tmp_path / "tmp"
    scratch_root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch_root))
    traj = make_trajectory(tmp_path / "traj", steps=2, shards=1, hidden=16, layers=1, experts=2, vocab=64)
    store = f"file://{tmp_path / 'store'}"
    weightsync.publish(traj[0], store)
    dead, dead_path = _holder("weightsync-base-", scratch_root)  # a publisher killed while rebuilding its base
    dead.send_signal(signal.SIGKILL)
    dead.wait(30)
    weightsync.publish(traj[1], store)  # a delta with no cache: its base is rebuilt in a scratch folder
    assert not os.path.exists(dead_path)
    assert [p.name for p in scratch_root.iterdir()] == []
    weightsync.pull(store, tmp_path / "out")
    assert weightsync.verify(store, tmp_path / "out") == 1
