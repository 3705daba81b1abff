"""kill -9 of the daemons in the middle of their work, then a restart.

Publisher: killed right after a chosen store write (a chunk, the manifest, the head pointer), after
a write drawn at random, and by an outside SIGKILL at a random moment. After each kill no torn
version is visible (every version up to the head has its manifest and every chunk it references,
and pulls back byte for byte), and a restarted publisher finishes the run, re-using the chunks
already uploaded.

Subscriber: killed while reading chunks, while building the standby slot, at each step of its
install journal, and at both steps of the ``current`` flip, and at random moments. After each kill
``current`` is a complete, verified version; a restart converges. On S3, a subscriber killed while
downloading re-uses the chunks it had spooled.

Kills at chosen points come from a driver that runs the real CLI ``main`` with one function
wrapped to SIGKILL the process right after its n-th call of a kind.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_daemons import Daemon, wait_for

import weightsync
from weightsync.demo import make_trajectory
from weightsync.format.keys import chunk_key
from weightsync.local.state import read_state

MODEL = dict(hidden=256, layers=1, experts=2, vocab=1024)  # ~3 MB: keyframes span 3-4 chunks of 1 MiB
PUBLISH = weightsync.PublishConfig(chunk_bytes=1 << 20, keyframe_interval=3)

# Runs ``weightsync.cli.main(argv)`` and SIGKILLs itself right after the n-th event of a kind:
#   chunk | manifest | head | any   a store write (a chunk, a manifest, the head pointer, any of these)
#   fetch      a chunk located for reading (subscriber, file store: chunks are read in place)
#   fsync      a file fsynced inside a slot's staging area (the standby slot being built)
#   slotfsync  a file fsynced in place in a slot (the standby slot being refilled in place)
#   refill     a slot's refill marker in place (before the first byte is overwritten)
#   journal    the install journal in place, before any rename
#   rename     the n-th file of the new version renamed into the slot
#   state      the slot's new state.json in place
#   symlink    the new ``current`` link created under its temporary name
#   flip       ``current`` replaced (before the directory fsync)
DRIVER = r"""
import os, signal, sys
kind, n, argv = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
seen = {"n": 0}

def hit():
    seen["n"] += 1
    if seen["n"] == n:
        os.kill(os.getpid(), signal.SIGKILL)

from weightsync.store.file import FileStore
real_put, real_local = FileStore.put, FileStore.local_path

def put(self, key, data, *, mode="overwrite"):
    real_put(self, key, data, mode=mode)
    kinds = {"chunks/": "chunk", "versions/": "manifest"}
    what = "head" if key == "HEAD" else next((w for p, w in kinds.items() if key.startswith(p)), None)
    if what and kind in (what, "any"):
        hit()

def local_path(self, key):
    path = real_local(self, key)
    if kind == "fetch" and key.startswith("chunks/"):
        hit()
    return path

real_replace, real_fsync, real_symlink = os.replace, os.fsync, os.symlink

def replace(src, dst, *a, **k):
    real_replace(src, dst, *a, **k)
    d = os.fspath(dst)
    if ((kind == "journal" and d.endswith("/.weightsync/journal.json"))
            or (kind == "state" and d.endswith("/.weightsync/state.json"))
            or (kind == "refill" and d.endswith("/.weightsync/refill.json"))
            or (kind == "rename" and "/slots/" in d and "/.weightsync/" not in d)
            or (kind == "flip" and d.endswith("/current"))):
        hit()

def fsync(fd):
    real_fsync(fd)
    path = os.readlink(f"/proc/self/fd/{fd}")
    if ((kind == "fsync" and "/.weightsync/staging/" in path)
            or (kind == "slotfsync" and "/slots/" in path and "/.weightsync" not in path)):
        hit()

def symlink(src, dst, *a, **k):
    real_symlink(src, dst, *a, **k)
    if kind == "symlink" and os.path.basename(os.fspath(dst)).startswith(".current-"):
        hit()

FileStore.put, FileStore.local_path = put, local_path
os.replace, os.fsync, os.symlink = replace, fsync, symlink
from weightsync.cli import main
sys.exit(main(argv))
"""


def run_driver(kind: str, n: int, argv: list, log: Path, env: dict | None = None, timeout: float = 60) -> int:
    """Run the CLI under the killing driver; returns its exit status (-9 when the point was hit)."""
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", DRIVER, kind, str(n), *map(str, argv)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError(f"the driver never reached {kind} #{n}:\n{log.read_text(errors='replace')}") from None


def content(folder: Path) -> dict[str, bytes]:
    """The files of a checkpoint or replica, without ``.weightsync`` and the ``COMPLETE`` marker
    (which the publisher daemon does not publish)."""
    return {
        rel: p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
        and ".weightsync" not in (rel := p.relative_to(folder).as_posix()).split("/")
        and rel != "COMPLETE"
    }


# --- publisher --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> list[Path]:
    """Steps 0..4 of a ~3 MB two-shard model, each with its COMPLETE marker."""
    traj = make_trajectory(tmp_path_factory.mktemp("kill") / "watch", steps=4, shards=2, **MODEL)
    for d in traj:
        (d / "COMPLETE").write_text("")
    return traj


def check_store(store: Path, checkpoints: list[Path], pulled: Path) -> int | None:
    """No torn version: versions 0..head are all there with every chunk; the head pulls back byte
    for byte (the pull verifies every checksum). Returns the head."""
    repo = weightsync.open_repo(store)
    head = repo.head_version()
    if head is None:
        assert not repo.versions()
        return None
    assert repo.versions() == list(range(head + 1))
    for v in range(head + 1):
        for c in repo.manifest(v).chunks:
            assert repo.store.head(chunk_key(c.id)) == c.size, f"version {v} is torn: chunk {c.id} missing"
    weightsync.pull(repo, pulled, head, config=weightsync.PullConfig(fsync=False))
    assert content(pulled) == content(checkpoints[head])
    return head


def publisher_args(store: Path, checkpoints: list[Path], state: Path) -> list:
    return [
        "--store",
        store,
        "--watch",
        checkpoints[0].parent,
        "--state-dir",
        state,
        "--chunk-mib",
        1,
        "--keyframe-interval",
        3,
        "--poll-interval",
        0.05,
    ]


def chunk_inodes(store: Path) -> dict[str, int]:
    return {
        p.name: p.stat().st_ino for p in (store / "chunks").rglob("*") if p.is_file() and not p.name.startswith(".")
    }


@pytest.mark.parametrize(
    "kind, n",
    [("chunk", 2), ("chunk", 6), ("manifest", 2), ("head", 2)],
    ids=["mid-keyframe-upload", "mid-second-keyframe", "manifest-before-head", "head-before-cache"],
)
def test_publisher_killed_after_a_store_write_restarts_and_finishes(kind, n, checkpoints, tmp_path):
    store, state = tmp_path / "store", tmp_path / "state"
    rc = run_driver(kind, n, ["publisher", *publisher_args(store, checkpoints, state)], tmp_path / "driver.log")
    assert rc == -signal.SIGKILL
    head = check_store(store, checkpoints, tmp_path / "pulled")
    before = chunk_inodes(store)
    pub = Daemon("publisher", publisher_args(store, checkpoints, state), tmp_path).start()
    try:
        wait_for(
            lambda: (
                (s := pub.status())["head_version"] == 4 or (s["last_error"] and "already exists" in s["last_error"])
            ),
            30,
            f"the restarted publisher to finish\n{pub.log()}",
        )
        status = pub.status()
        assert status["head_version"] == 4, f"the restarted publisher is stuck at {head}: {status['last_error']}"
    finally:
        assert pub.stop() == 0
    assert check_store(store, checkpoints, tmp_path / "pulled") == 4
    after = chunk_inodes(store)
    assert {c: after.get(c) for c in before} == before, "chunks stored before the kill were uploaded again"
    repo = weightsync.open_repo(store)
    used = {c.id for v in repo.versions() for c in repo.manifest(v).chunks}
    assert set(before) <= used, "the re-publish did not re-use the chunks of the killed one"


def test_publisher_killed_at_random_points_never_tears_a_version(checkpoints, tmp_path):
    """Kills after a store write drawn at random, and outside SIGKILLs at random moments, one after
    the other on one store; a last run finishes."""
    rng = random.Random(7)
    store, state = tmp_path / "store", tmp_path / "state"
    args = publisher_args(store, checkpoints, state)
    for i in range(4):
        rc = run_driver("any", rng.randint(1, 4), ["publisher", *args], tmp_path / "driver.log")
        assert rc in (-signal.SIGKILL,), rc
        check_store(store, checkpoints, tmp_path / f"pulled-{i}")
    pub = Daemon("publisher", args, tmp_path).start()
    time.sleep(rng.uniform(0.0, 0.2))
    pub.stop(signal.SIGKILL)
    check_store(store, checkpoints, tmp_path / "pulled-x")
    pub = Daemon("publisher", args, tmp_path).start()
    try:
        wait_for(
            lambda: (
                (s := pub.status())["head_version"] == 4 or (s["last_error"] and "already exists" in s["last_error"])
            ),
            30,
            "the last run to finish",
        )
        status = pub.status()
        assert status["head_version"] == 4, f"the publisher is stuck: {status['last_error']}\n{pub.log()}"
    finally:
        assert pub.stop() == 0
    assert check_store(store, checkpoints, tmp_path / "pulled-end") == 4


# --- subscriber ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def published(checkpoints, tmp_path_factory) -> Path:
    store = tmp_path_factory.mktemp("kill-store") / "store"
    for ckpt in checkpoints:
        weightsync.publish(ckpt, store, config=PUBLISH)
    return store


def check_current(store: Path, target: Path, allowed: set[int], checkpoints: list[Path]) -> int:
    """``current`` is a complete, verified version among ``allowed``; returns it."""
    assert os.readlink(target / "current") in ("slots/a", "slots/b")
    state = read_state(target / "current")
    assert state is not None and state.version in allowed, state
    assert weightsync.verify(store, target / "current", state.version) == state.version
    assert content(target / "current") == content(checkpoints[state.version])
    return state.version


SUB_POINTS = [("fetch", 2), ("fsync", 1), ("journal", 1), ("rename", 1), ("state", 1), ("symlink", 1), ("flip", 1)]


def test_subscriber_killed_at_each_step_of_download_apply_and_swap(published, checkpoints, tmp_path):
    target = tmp_path / "sub"
    common = ["--store", published, "--target", target, "--id", "killed", "--poll-interval", 0.05]
    sub = Daemon("subscriber", [*common, "--version", 1], tmp_path).start()
    sub.wait_version(1)
    assert sub.stop() == 0
    current = 1
    # each target differs from the versions both slots hold, so that every sync builds a slot
    for (kind, n), want in zip(SUB_POINTS, [4, 2, 0, 3, 1, 4, 2]):
        rc = run_driver(kind, n, ["subscriber", *common, "--version", want], tmp_path / f"driver-{kind}.log")
        assert rc == -signal.SIGKILL, f"{kind}: exited {rc}"
        got = check_current(published, target, {current, want}, checkpoints)
        assert got == (want if kind == "flip" else current), f"{kind}: current is version {got}"
        sub = Daemon("subscriber", [*common, "--version", want], tmp_path).start()
        sub.wait_version(want)
        assert sub.stop() == 0
        current = check_current(published, target, {want}, checkpoints)
        assert len(os.listdir(target / "slots")) == 2
    # last, so that it hides nothing above: a restart cleans up what a killed flip left behind
    assert sorted(os.listdir(target)) == ["current", "slots"], "litter in the target folder"


REFILL_POINTS = [("refill", 1), ("slotfsync", 1), ("slotfsync", 2), ("state", 1)]


def test_subscriber_killed_while_refilling_its_standby_in_place(published, checkpoints, tmp_path):
    """With ``--standby-hold 0`` each forward sync overwrites the standby slot in place: killed
    after its marker, after each file, after its state; ``current`` stays whole, a restart finishes."""
    target = tmp_path / "sub"
    common = ["--store", published, "--target", target, "--id", "refill", "--poll-interval", 0.05, "--standby-hold", 0]
    sub = Daemon("subscriber", [*common, "--version", 0], tmp_path).start()
    sub.wait_version(0)
    assert sub.stop() == 0
    for want, (kind, n) in enumerate(REFILL_POINTS, start=1):
        rc = run_driver(kind, n, ["subscriber", *common, "--version", want], tmp_path / f"driver-{kind}-{n}.log")
        assert rc == -signal.SIGKILL, f"{kind} #{n}: exited {rc}"
        assert check_current(published, target, {want - 1}, checkpoints) == want - 1
        sub = Daemon("subscriber", [*common, "--version", want], tmp_path).start()
        last = sub.wait_version(want)["last_sync"]
        assert sub.stop() == 0
        assert last["in_place"] is True, last
        check_current(published, target, {want}, checkpoints)
    standby = target / "slots" / ("a" if os.readlink(target / "current") == "slots/b" else "b")
    assert read_state(standby).version == 3 and not (standby / ".weightsync" / "refill.json").exists()


@pytest.mark.parametrize("hold", ["30", "0"], ids=["rename", "in-place"])
def test_subscriber_killed_at_random_moments_always_serves_a_whole_version(hold, published, checkpoints, tmp_path):
    rng = random.Random(11)
    target = tmp_path / "sub"
    common = ["--store", published, "--target", target, "--id", "random-kills", "--no-fsync", "--standby-hold", hold]
    sub = Daemon("subscriber", [*common, "--version", 0], tmp_path).start()
    sub.wait_version(0)
    for want in (4, 2, 3, 0, 4):
        sub.put_target(want)
        time.sleep(rng.uniform(0.0, 0.08))
        sub.stop(signal.SIGKILL)
        check_current(published, target, set(range(5)), checkpoints)
        sub = Daemon("subscriber", [*common, "--version", want], tmp_path).start()
        sub.wait_version(want)
    assert sub.stop() == 0
    assert check_current(published, target, {4}, checkpoints) == 4


@pytest.mark.integration
def test_subscriber_killed_mid_download_from_s3_resumes_from_its_spool(s3_url, seaweed, checkpoints, tmp_path):
    """Chunks are downloaded one at a time, each GET slowed by the proxy; the subscriber is killed
    after two have landed. The restarted one downloads only the rest."""
    from faultproxy import FaultProxy, Rule

    repo = weightsync.open_repo(s3_url)
    weightsync.publish(checkpoints[0], repo, config=PUBLISH)
    total = len(repo.manifest(0).chunks)
    assert total >= 3
    proxy = FaultProxy(seaweed.endpoint).start()
    try:
        env = {**seaweed.env(), "AWS_ENDPOINT_URL": proxy.endpoint}
        proxy.add(Rule("delay", method="GET", key=r"/chunks/", delay=0.4))
        target = tmp_path / "sub"
        args = ["--store", s3_url, "--target", target, "--no-fsync", "--concurrency", 1]
        sub = Daemon("subscriber", args, tmp_path, env=env).start()
        wait_for(lambda: proxy.seen("GET", r"/chunks/") >= 3, 30, f"two chunks downloaded\n{sub.log()}")
        sub.stop(signal.SIGKILL)
        assert not (target / "current").exists()
        proxy.clear()
        t0 = time.monotonic()
        sub = Daemon("subscriber", args, tmp_path, env=env).start()
        sub.wait_version(0, timeout=60)
        assert sub.stop() == 0
        fetched = proxy.seen("GET", r"/chunks/", since=t0)
        assert fetched <= total - 2, f"the restart fetched {fetched} of {total} chunks again"
        check_current(s3_url, target, {0}, checkpoints)
    finally:
        proxy.stop()
