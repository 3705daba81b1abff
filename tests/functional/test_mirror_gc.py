"""Regional mirrors and retention on file stores: ``weightsync mirror`` and ``weightsync gc``.

Every mirrored or retained version is pulled and compared with its source checkpoint byte for
byte. The concurrent test runs a real publisher process while gc collects the same store.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import weightsync
from weightsync.demo import make_trajectory
from weightsync.errors import ChecksumError, FormatError, NotAStoreError, StoreError
from weightsync.format.keys import HEAD_KEY, chunk_key, version_key
from weightsync.format.manifest import head_to_json
from weightsync.store import FileStore, MemoryStore
from weightsync.sync.gc import GcConfig, gc, list_chunks_with_age
from weightsync.sync.mirror import MirrorConfig, MirrorError, MirrorObserver, mirror

OLD = time.time() - 10 * 24 * 3600  # an mtime far outside any grace period


class Record(MirrorObserver):
    """Collects what a mirror reports: (copied, nbytes) per chunk, (version, chunks, bytes) per version."""

    def __init__(self, chunks: list | None = None, versions: list | None = None):
        self.chunks, self.versions = [] if chunks is None else chunks, [] if versions is None else versions

    def on_chunk(self, copied: bool, nbytes: int) -> None:
        self.chunks.append((copied, nbytes))

    def on_version(self, version: int, chunks: int, nbytes: int, seconds: float = 0.0) -> None:
        self.versions.append((version, chunks, nbytes))


def repo(path: Path) -> weightsync.Repo:
    return weightsync.open_repo(f"file://{path}")


def age_all(store_dir: Path) -> None:
    """Make every object look ten days old."""
    for p in store_dir.rglob("*"):
        if p.is_file():
            os.utime(p, (OLD, OLD))


def assert_versions_pull(r: weightsync.Repo, checkpoints: list[Path], tmp: Path, ws) -> None:
    for v in r.versions():
        out = tmp / f"pull-{r.url.rsplit('/', 1)[-1]}-{v}"
        weightsync.pull(r, out, v)
        ws.assert_replica(out, checkpoints[v])


# --- mirror -----------------------------------------------------------------------------------------
def test_mirror_cli_copies_every_version_and_is_idempotent(published, tmp_path, ok_cli, ws):
    store, traj = published
    dst = tmp_path / "regional"
    out = ok_cli("mirror", "--from", f"file://{store}", "--to", f"file://{dst}")
    assert out.strip() == "5"
    r = repo(dst)
    assert r.versions() == [0, 1, 2, 3, 4, 5]
    for key in ["weightsync.json", HEAD_KEY, *(version_key(v) for v in range(6))]:
        assert (dst / key).read_bytes() == (store / key).read_bytes()
    assert_versions_pull(r, traj, tmp_path, ws)

    before = ws.snapshot(dst)
    src_before = ws.snapshot(store)
    res = mirror(repo(store), repo(dst))
    assert (res.copied_versions, res.copied_chunks, res.head) == ([], 0, 5)
    assert ws.snapshot(dst) == before
    assert ws.snapshot(store) == src_before  # the source is only read


def test_mirror_resumes_after_failure_without_copying_again(published, tmp_path, ws):
    store, traj = published
    dst = tmp_path / "regional"

    class Failing(FileStore):
        puts = 0

        def put(self, key, data, *, mode="overwrite"):
            if key.startswith("chunks/"):
                Failing.puts += 1
                if Failing.puts > 3:
                    raise StoreError(f"injected failure on {key}", key=key)
            super().put(key, data, mode=mode)

    chunks = []  # (copied, nbytes) as each chunk is done: the failed run's copies count too
    with pytest.raises(StoreError, match="injected"):
        mirror(
            repo(store),
            weightsync.Repo(Failing(dst)),
            config=MirrorConfig(concurrency=1),
            observer=Record(chunks=chunks),
        )
    r = repo(dst)
    partial_head = r.head_version()
    assert partial_head is not None and partial_head < 5
    on_disk = [p.stat().st_size for p in (dst / "chunks").rglob("*") if p.is_file()]
    assert sorted(n for copied, n in chunks if copied) == sorted(on_disk) and len(on_disk) == 3
    total_chunks = len({c.id for v in range(6) for c in repo(store).manifest(v).chunks})
    res = mirror(repo(store), r)
    assert res.copied_versions == [v for v in range(6) if v > partial_head]
    assert res.copied_chunks == total_chunks - 3
    assert r.versions() == list(range(6))
    assert_versions_pull(r, traj, tmp_path, ws)


def test_mirror_recognises_interrupted_manifest_copy(published, tmp_path):
    store, _ = published
    dst = tmp_path / "regional"
    mirror(repo(store), repo(dst))
    repo(dst).set_head(3)  # as if the pass died after copying manifests 4 and 5, before the head
    lost = chunk_key(repo(store).manifest(5).chunks[0].id)
    (dst / lost).unlink()  # and a chunk under an existing manifest went missing
    chunks, versions = [], []
    res = mirror(
        repo(store),
        repo(dst),
        observer=Record(chunks=chunks, versions=versions),
    )
    assert res.skipped_versions == [4, 5] and res.copied_versions == [] and res.head == 5
    assert res.copied_chunks == 1 and (dst / lost).read_bytes() == (store / lost).read_bytes()
    assert [c for c in chunks if c[0]] == [
        (True, (dst / lost).stat().st_size)
    ] and versions == []  # counted all the same
    assert (
        len(chunks)
        == res.copied_chunks + res.skipped_chunks
        == sum(len(repo(store).manifest(v).chunks) for v in (4, 5))
    )


def test_mirror_refuses_non_weightsync_destination(published, tmp_path, run_cli, ws):
    store, _ = published
    dst = tmp_path / "other"
    dst.mkdir()
    (dst / "data.bin").write_bytes(b"not ours")
    before = ws.snapshot(dst)
    rc, _, err = run_cli("mirror", "--from", f"file://{store}", "--to", f"file://{dst}")
    assert rc != 0 and "not a weightsync store" in ws.error_line(err)
    with pytest.raises(NotAStoreError):
        mirror(repo(store), repo(dst))
    assert ws.snapshot(dst) == before


def test_mirror_refuses_a_different_store(published, trajectory, tmp_path):
    store, _ = published
    other = tmp_path / "other"
    weightsync.publish(trajectory[5], repo(other))  # version 0 with other bytes
    with pytest.raises(MirrorError, match="version 0 differs"):
        mirror(repo(store), repo(other))
    assert repo(other).versions() == [0]

    ahead = tmp_path / "ahead"
    mirror(repo(store), repo(ahead))
    small = tmp_path / "small"
    weightsync.publish(trajectory[0], repo(small))
    with pytest.raises(MirrorError, match="ahead"):
        mirror(repo(small), repo(ahead))
    empty = repo(tmp_path / "empty")
    empty.init()
    with pytest.raises(MirrorError, match="ahead"):
        mirror(empty, repo(ahead))
    with pytest.raises(weightsync.WeightsyncError, match="same store"):
        mirror(repo(store), repo(store))


def test_mirror_rejects_corrupt_chunk_and_bad_manifest(published, tmp_path, ws):
    store, _ = published
    m3 = repo(store).manifest(3)
    ws.flip_byte(store / chunk_key(m3.chunks[0].id), 100)
    dst = tmp_path / "regional"
    with pytest.raises(ChecksumError):
        mirror(repo(store), repo(dst), config=MirrorConfig(keyframe_payloads="eager"))
    r = repo(dst)
    assert r.head_version() == 2 and not (dst / version_key(3)).exists()
    assert not (dst / chunk_key(m3.chunks[0].id)).exists()

    # lazily: keyframe 3's full payloads are not on the path, so the head moves past it; the corrupt
    # chunk is found when they are copied afterwards, refused, and stays noted as missing
    lazy = tmp_path / "regional-lazy"
    with pytest.raises(ChecksumError):
        mirror(repo(store), repo(lazy))
    assert repo(lazy).head_version() == 5 and m3.chunks[0].id in repo(lazy).lazy_chunks(3)
    assert not (lazy / chunk_key(m3.chunks[0].id)).exists()

    (store / version_key(3)).write_bytes(b'{"format": "weightsync.manifest"}')
    with pytest.raises(FormatError):
        mirror(repo(store), repo(tmp_path / "regional2"))


def test_mirror_does_not_resurrect_versions_collected_at_the_destination(published, trajectory, tmp_path, ws):
    store, traj = published
    dst = tmp_path / "regional"
    mirror(repo(store), repo(dst))
    age_all(dst)
    gc(repo(dst), GcConfig(keep=1, grace_seconds=60))
    assert repo(dst).versions() == [3, 4, 5]
    res = mirror(repo(store), repo(dst))
    assert res.copied_versions == [] and repo(dst).versions() == [3, 4, 5]

    nxt = make_trajectory(tmp_path / "more", steps=6, shards=2, **ws.TINY)[6]  # step 6 of the same run
    weightsync.publish(nxt, repo(store), base_dir=traj[5])
    res = mirror(repo(store), repo(dst))
    assert res.copied_versions == [6] and repo(dst).versions() == [3, 4, 5, 6]
    weightsync.pull(repo(dst), tmp_path / "sub", 6)
    ws.assert_replica(tmp_path / "sub", nxt)


def test_mirror_follow_until_sigterm(trajectory, tmp_path, cli_env, ws):
    src, dst = tmp_path / "src", tmp_path / "regional"
    weightsync.publish(trajectory[0], repo(src))
    cmd = [
        sys.executable,
        "-m",
        "weightsync.cli",
        "mirror",
        "--from",
        f"file://{src}",
        "--to",
        f"file://{dst}",
        "--follow",
        "--interval",
        "0.1",
    ]
    log = tmp_path / "mirror.log"  # a file, not a pipe: the stack dumps below overflow a pipe's buffer
    with log.open("w") as stderr:
        proc = subprocess.Popen(cmd, env=cli_env, stdout=subprocess.PIPE, stderr=stderr, text=True)
    try:
        sub = tmp_path / "subscriber"
        for v in range(1, 4):
            weightsync.publish(trajectory[v], repo(src), base_dir=trajectory[v - 1])
            deadline = time.monotonic() + 20
            while repo(dst).head_version() != v:
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.05)
            weightsync.pull(repo(dst), sub)  # a subscriber in the region follows its regional store
            ws.assert_replica(sub, trajectory[v])
        # what a mirror that does not stop is doing, as the daemons tell it: SIGUSR1 logs every thread's
        # stack, SIGUSR2 has faulthandler write them; it follows on
        proc.send_signal(signal.SIGUSR1)
        time.sleep(0.5)
        proc.send_signal(signal.SIGUSR2)
        time.sleep(0.5)
        weightsync.publish(trajectory[4], repo(src), base_dir=trajectory[3])
        deadline = time.monotonic() + 20
        while repo(dst).head_version() != 4:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = log.read_text()
    assert proc.returncode == 0, err
    assert out.strip() == "4"
    assert "mirrored version 4" in err
    dump = re.search(r"stacks of 0 tasks and \d+ threads \(SIGUSR1\):\n.*?(?=\n\d{4}-|\Z)", err, re.S)
    assert dump and "thread MainThread:" in dump[0] and "in cmd_mirror" in dump[0] and "in dump_stacks" in dump[0], err
    assert re.search(r"Current thread 0x[0-9a-f]+ \(most recent call first\)", err), err


# --- gc ---------------------------------------------------------------------------------------------
def test_gc_keeps_kept_versions_and_their_chains(published, tmp_path, ok_cli, run_cli, ws):
    store, traj = published  # keyframes at 0 and 3
    age_all(store)
    r = repo(store)
    chunks_before = set(r.store.list("chunks/"))
    dry = json.loads(ok_cli("gc", "--store", f"file://{store}", "--keep", "2", "--dry-run"))
    assert dry["deleted"] == [0, 1, 2] and dry["dry_run"]
    assert set(r.store.list("chunks/")) == chunks_before and r.versions() == list(range(6))

    rc, stdout, err = run_cli("gc", "--store", f"file://{store}", "--keep", "2")
    out = json.loads(stdout)
    assert out["kept"] == [3, 4, 5] and out["deleted"] == [0, 1, 2]  # 4 needs the keyframe 3
    assert rc == 0 and "kept versions [3-5], deleted 3 versions" in err  # runs: a short line for any count
    assert out["touched_during_gc"] == out["referenced_during_gc"] == 0  # no writer ran meanwhile
    assert r.versions() == [3, 4, 5]
    needed = {chunk_key(c.id) for v in (3, 4, 5) for c in r.manifest(v).chunks}
    assert set(r.store.list("chunks/")) == needed
    assert out["deleted_chunks"] == len(chunks_before - needed) > 0
    assert_versions_pull(r, traj, tmp_path, ws)

    again = gc(r, GcConfig(keep=2, grace_seconds=0))
    assert again.deleted_versions == [] and again.deleted_chunks == 0
    assert gc(r, GcConfig(keep=100)).deleted_versions == []
    last = gc(r, GcConfig(keep=1, grace_seconds=0))
    assert last.kept_versions == [3, 4, 5]  # the head's chain back to its keyframe


def test_gc_grace_period_protects_young_unreferenced_chunks(published, tmp_path):
    store, _ = published
    r = repo(store)
    age_all(store)
    orphan = b"a chunk uploaded by a publisher whose manifest does not exist yet"
    from weightsync.format.chunking import chunk_id

    r.put_chunk(chunk_id(orphan), orphan)
    res = gc(r, GcConfig(keep=6, grace_seconds=3600))
    assert res.deleted_chunks == 0 and res.young_chunks == 1
    assert r.store.head(chunk_key(chunk_id(orphan))) == len(orphan)
    os.utime(store / chunk_key(chunk_id(orphan)), (time.time() - 7200,) * 2)
    res = gc(r, GcConfig(keep=6, grace_seconds=3600))
    assert res.deleted_chunks == 1 and r.store.head(chunk_key(chunk_id(orphan))) is None

    (store / "chunks" / "00").mkdir(exist_ok=True)
    stale = store / "chunks" / "00" / ".tmp-killedwriter"
    stale.write_bytes(b"half a chunk")
    os.utime(stale, (OLD, OLD))
    assert gc(r, GcConfig(keep=6)).partial_writes == 1 and not stale.exists()


def test_gc_deletes_only_chunk_keys_under_chunks(published, tmp_path, ok_cli, ws):
    """gc took every old object under ``chunks/`` for a chunk: a README put there and a whole store
    made at ``chunks/eu`` (its marker, head, manifest and chunks) went, exit 0. Keys that name no
    chunk are left and counted."""
    store, traj = published
    inner = store / "chunks" / "eu"
    weightsync.publish(traj[0], repo(inner))
    (store / "chunks" / "README.txt").write_text("not a chunk")
    planted = store / "chunks" / "ab" / ("cd" + "0" * 30)  # a chunk id whose fan-out folder is not its own
    planted.parent.mkdir(exist_ok=True)
    planted.write_bytes(b"x")
    age_all(store)
    before = ws.snapshot(inner)
    out = json.loads(ok_cli("gc", "--store", f"file://{store}", "--keep", 1, "--grace-seconds", 0))
    inner_objects = sum(1 for p in inner.rglob("*") if p.is_file() and not p.name.startswith("."))  # .lock: unlisted
    assert out["deleted_chunks"] > 0 and out["foreign_objects"] == inner_objects + 2
    assert ws.snapshot(inner) == before and repo(inner).versions() == [0]
    assert (store / "chunks" / "README.txt").exists() and planted.exists()
    assert_versions_pull(repo(store), traj, tmp_path, ws)


def test_gc_says_a_short_grace_is_unsafe_and_counts_the_killed_writers_leftovers(published, run_cli, ws):
    """A grace below publishers' ``refresh_after`` was taken silently (docs require more; a publish in
    flight may lose its chunks): a warning says so. The leftovers of killed writers gc removes were
    counted nowhere the operator sees: the JSON and a line give them."""
    store, traj = published
    from weightsync.store.file import _TEMP_PREFIX

    (store / "chunks" / f"{_TEMP_PREFIX}killed").write_bytes(b"half a chunk")
    age_all(store)
    rc, stdout, err = run_cli("gc", "--store", f"file://{store}", "--keep", 1, "--grace-seconds", 10)
    assert rc == 0, err
    assert "warning: a grace of 10s is below publishers' refresh_after (900s)" in err
    assert json.loads(stdout)["partial_writes"] == 1 and "deleted 1 unfinished uploads of killed writers" in err
    assert not (store / "chunks" / f"{_TEMP_PREFIX}killed").exists()
    rc, stdout, err = run_cli("gc", "--store", f"file://{store}", "--keep", 1)  # the default: no warning
    assert rc == 0 and "warning" not in err and json.loads(stdout)["partial_writes"] == 0
    assert_versions_pull(repo(store), traj, store.parent / "pulled", ws)


def test_gc_keeps_manifests_above_the_head_until_abandoned(published, tmp_path, ws):
    """A publish that stored its manifest but has not moved the head yet keeps its chunks; once
    older than the grace period it is abandoned (it blocks its version number) and removed."""
    store, traj = published
    more = make_trajectory(tmp_path / "more", steps=6, shards=2, **ws.TINY)
    nxt, other = more[6], more[4]

    class NoHead(FileStore):
        def put_if_match(self, key, data, etag):  # lost as a timeout is (it may have landed: the manifest stays)
            err = StoreError("injected: head update lost", key=key)
            err.retryable = True
            raise err

    with pytest.raises(StoreError, match="injected"):
        weightsync.publish(nxt, weightsync.Repo(NoHead(store)), base_dir=traj[5])
    pending = store / version_key(6)
    assert pending.exists() and repo(store).head_version() == 5
    age_all(store)
    os.utime(pending)  # the manifest is fresh, its chunks are old
    res = gc(repo(store), GcConfig(keep=1, grace_seconds=60))
    assert res.kept_versions == [3, 4, 5] and res.abandoned_versions == [] and pending.exists()
    chunks6 = [store / chunk_key(c.id) for c in repo(store).manifest(6).chunks]
    assert all(p.exists() for p in chunks6)
    with pytest.raises(
        weightsync.WeightsyncError, match=r"version 6 already exists .* above its head \(5\).*--version"
    ):
        weightsync.publish(other, repo(store), base_dir=traj[5])  # the dead publish blocks version 6

    os.utime(pending, (OLD, OLD))
    res = gc(repo(store), GcConfig(keep=1, grace_seconds=60))
    assert res.abandoned_versions == [6] and not pending.exists()
    assert not any(p.exists() for p in chunks6)
    assert weightsync.publish(nxt, repo(store), base_dir=traj[5]).version == 6
    weightsync.pull(repo(store), tmp_path / "v6", 6)
    ws.assert_replica(tmp_path / "v6", nxt)


def _dead_publish(store: Path, traj: list[Path], tmp_path: Path, ws) -> Path:
    """Publish the next checkpoint as version 6 up to its manifest, losing the head update (a
    publisher that died, or stalls, right there); returns the checkpoint."""
    nxt = make_trajectory(tmp_path / "more", steps=6, shards=2, **ws.TINY)[6]

    class NoHead(FileStore):
        def put_if_match(self, key, data, etag):  # lost as a timeout is (it may have landed: the manifest stays)
            err = StoreError("injected: head update lost", key=key)
            err.retryable = True
            raise err

    with pytest.raises(StoreError, match="injected"):
        weightsync.publish(nxt, weightsync.Repo(NoHead(store)), base_dir=traj[5])
    return nxt


def test_republishing_the_checkpoint_of_a_dead_publish_completes_it(published, tmp_path, ws):
    store, traj = published
    nxt = _dead_publish(store, traj, tmp_path, ws)
    assert weightsync.publish(nxt, repo(store), base_dir=traj[5]).version == 6
    assert repo(store).head_version() == 6
    weightsync.pull(repo(store), tmp_path / "v6", 6)
    ws.assert_replica(tmp_path / "v6", nxt)


def test_gc_between_a_skipped_upload_and_its_commit(trajectory, tmp_path, monkeypatch):
    store = tmp_path / "store"
    cfg = weightsync.PublishConfig(keyframe_interval=1)  # every version a keyframe
    weightsync.publish(trajectory[0], repo(store), config=cfg)
    weightsync.publish(trajectory[1], repo(store), config=cfg)
    age_all(store)
    commit = weightsync.Repo.commit

    def gc_then_commit(self, manifest, etag, *signing):  # gc runs after the uploads, before the commit:
        gc(repo(store), GcConfig(keep=1, grace_seconds=60))  # version 0 and its old chunks go
        return commit(self, manifest, etag, *signing)

    monkeypatch.setattr(weightsync.Repo, "commit", gc_then_commit)
    weightsync.publish(trajectory[0], repo(store), config=cfg)  # same bytes as version 0: same chunks
    monkeypatch.undo()
    weightsync.pull(repo(store), tmp_path / "out", 2)


def test_gc_on_a_store_without_ages_deletes_no_chunk_inside_the_grace(published):
    store, _ = published
    mem = weightsync.Repo(MemoryStore())
    mirror(repo(store), mem)
    assert all(age is None for _, _, age in list_chunks_with_age(mem.store))
    res = gc(mem, GcConfig(keep=1))
    assert res.deleted_versions == [0, 1, 2] and res.deleted_chunks == 0 and res.young_chunks > 0
    assert gc(mem, GcConfig(keep=1, grace_seconds=0)).deleted_chunks == res.young_chunks


PUBLISHER = """
import sys, time, weightsync
store, pause, *dirs = sys.argv[1:]
prev = None
for d in dirs:
    time.sleep(float(pause))  # a training step between checkpoints
    r = weightsync.publish(d, store, config=weightsync.PublishConfig(keyframe_interval=3), base_dir=prev)
    print(r.version, d, flush=True)
    prev = d
"""


def time_scale(checkpoints: list[Path], tmp: Path, budget: float) -> float:
    """How much slower than ``budget`` seconds a delta publish of ``checkpoints[1]`` runs here and
    now (at least 1): a run against gc stretches its grace and its pauses by it, so that no publish
    outlasts the grace on a loaded machine and the run still lasts several graces."""
    scratch = f"file://{tmp / 'calibration-store'}"
    weightsync.publish(checkpoints[0], scratch)
    t0 = time.monotonic()
    weightsync.publish(checkpoints[1], scratch, base_dir=checkpoints[0])
    return max(1.0, (time.monotonic() - t0) / budget)


def run_publisher_against_gc(
    store_url: str, r: weightsync.Repo, checkpoints: list[Path], tmp: Path, grace: float, pause: float, ws
) -> tuple[int, int]:
    """A publisher process publishes ``checkpoints`` while ``gc --keep 2`` runs in a loop here;
    then every kept version pulls byte-identical. Returns (gc runs, chunks deleted while the publisher ran).
    ``grace`` and ``pause`` are stretched on a slow machine (:func:`time_scale`); the chunks are
    aged explicitly (mtime) for the last gc, instead of waiting out the grace."""
    scale = time_scale(checkpoints, tmp, grace / 4)
    grace, pause = grace * scale, pause * scale
    script = tmp / "publisher.py"
    script.write_text(PUBLISHER)
    env = dict(os.environ)
    proc = subprocess.Popen(
        [sys.executable, str(script), store_url, str(pause), *map(str, checkpoints)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    runs = deleted = 0
    t0 = time.monotonic()
    try:
        while proc.poll() is None:
            if r.check():
                res = gc(r, GcConfig(keep=2, grace_seconds=grace))
                runs, deleted = runs + 1, deleted + res.deleted_chunks
            time.sleep(0.02)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    took = time.monotonic() - t0
    print(f"publisher ran {took:.2f}s (grace {grace:.2f}s); {runs} gc runs deleted {deleted} chunks meanwhile")
    during = deleted
    published = {int(v): Path(d) for v, d in (line.split(" ", 1) for line in out.splitlines())}
    assert sorted(published) == list(range(len(checkpoints)))
    for p in Path(store_url.removeprefix("file://"), "chunks").rglob("*"):  # every orphan past the grace
        if p.is_file():
            os.utime(p, (OLD, OLD))
    res = gc(r, GcConfig(keep=2, grace_seconds=grace))
    runs, deleted = runs + 1, deleted + res.deleted_chunks
    kept = r.versions()
    assert kept[-2:] == sorted(published)[-2:]
    for v in kept:
        out_dir = tmp / f"kept-{v}"
        weightsync.pull(r, out_dir, v)
        ws.assert_replica(out_dir, published[v])
    needed = {chunk_key(c.id) for v in kept for c in r.manifest(v).chunks}
    assert set(r.store.list("chunks/")) == needed
    return runs, during


def test_gc_while_a_publisher_runs(tmp_path, ws):
    checkpoints = make_trajectory(tmp_path / "traj", steps=14, shards=1, **ws.TINY)
    store = tmp_path / "store"
    runs, deleted = run_publisher_against_gc(f"file://{store}", repo(store), checkpoints, tmp_path, 1.5, 0.2, ws)
    assert runs > 3 and deleted > 0


def test_a_publish_that_stalled_past_gc_s_grace_moves_the_head_back(published, tmp_path, ws):
    """A publisher stopped between its manifest and its head for longer than gc's grace: gc takes
    the manifest for one a dead publisher left and deletes it. Before, the publisher then moved the
    head onto nothing and exited 0: no pull, publish or gc got past that head again. Now it finds
    its manifest gone, moves the head back and fails; the next publish works."""
    store, traj = published
    nxt = make_trajectory(tmp_path / "more", steps=6, shards=2, **ws.TINY)[6]

    class Stalled(FileStore):
        def put_if_match(self, key, data, etag):
            if key == HEAD_KEY and json.loads(data)["version"] == 6:  # the publisher wakes up after gc ran
                age_all(store)
                assert gc(repo(store), GcConfig(keep=5, grace_seconds=60)).abandoned_versions == [6]
            super().put_if_match(key, data, etag)

    with pytest.raises(weightsync.WeightsyncError, match="version 6 .* was collected by gc before the head moved"):
        weightsync.publish(nxt, weightsync.Repo(Stalled(store)), base_dir=traj[5])
    assert repo(store).head_version() == 5
    assert weightsync.publish(nxt, repo(store), base_dir=traj[5]).version == 6
    weightsync.pull(repo(store), tmp_path / "v6", 6)
    ws.assert_replica(tmp_path / "v6", nxt)


@pytest.mark.parametrize("moment", ["after-plan", "at-delete"])
def test_gc_keeps_an_abandoned_looking_version_whose_head_moved_while_it_ran(
    moment, published, tmp_path, ws, monkeypatch
):
    """The other side of that race: the head moves onto the old manifest after gc listed it as
    abandoned, before it deleted it, or while it deleted it (the writer's own check after its head
    move found the manifest still there). gc reads the head before and after each such delete and
    puts a manifest the head reached back: the version and its chunks stay."""
    import weightsync.sync.gc as gcmod

    store, traj = published
    nxt = _dead_publish(store, traj, tmp_path, ws)
    age_all(store)

    def head_moves():  # the stalled publisher wakes up, moves the head and finds its manifest
        _, etag = repo(store).head()
        repo(store).store.put_if_match(HEAD_KEY, head_to_json(6), etag)
        assert repo(store).head_on_collected(6, 5) is False

    class Racing(FileStore):
        def delete(self, key):
            if key == version_key(6):
                head_moves()
            super().delete(key)

    real = gcmod.plan_parts
    if moment == "after-plan":
        monkeypatch.setattr(gcmod, "plan_parts", lambda *a: (head_moves(), real(*a))[1])
    res = gc(
        weightsync.Repo(Racing(store) if moment == "at-delete" else FileStore(store)),
        GcConfig(keep=5, grace_seconds=60),
    )
    monkeypatch.undo()
    assert res.abandoned_versions == [] and repo(store).head_version() == 6
    weightsync.pull(repo(store), tmp_path / "v6", 6)
    ws.assert_replica(tmp_path / "v6", nxt)


def test_a_mirror_that_stalled_past_the_regional_gc_s_grace_moves_the_head_back(published, tmp_path, ws):
    """The same race at a mirror's destination: its manifest collected before its head moved. It
    moves the head back and fails; the next run copies the version again."""
    store, traj = published
    dst = tmp_path / "regional"
    mirror(repo(store), repo(dst))
    nxt = make_trajectory(tmp_path / "more", steps=6, shards=2, **ws.TINY)[6]
    weightsync.publish(nxt, repo(store), base_dir=traj[5])

    class Stalled(FileStore):
        def put_if_match(self, key, data, etag):
            if key == HEAD_KEY and json.loads(data)["version"] == 6:
                age_all(dst)
                assert gc(repo(dst), GcConfig(keep=6, grace_seconds=60)).abandoned_versions == [6]
            super().put_if_match(key, data, etag)

    with pytest.raises(weightsync.WeightsyncError, match="version 6 .* was collected by gc before the head moved"):
        mirror(repo(store), weightsync.Repo(Stalled(dst)))
    assert repo(dst).head_version() == 5
    mirror(repo(store), repo(dst))
    assert repo(dst).head_version() == 6
    assert_versions_pull(repo(dst), [*traj, nxt], tmp_path, ws)


def test_a_mirror_copies_no_delta_whose_parent_the_source_collected_while_it_copied(published, tmp_path, ws):
    """The source's gc collects version 4 while the mirror copies it (its chunk is gone, then its
    manifest): the mirror drops 4, as before, and now also 5, a delta from 4 (before, it committed
    5: a head no pull could build, with exit 0)."""
    from weightsync.errors import NotFoundError

    store, traj = published
    src = repo(store)
    only4 = {c.id for c in src.manifest(4).chunks} - {c.id for v in (0, 1, 2, 3, 5) for c in src.manifest(v).chunks}
    assert only4 and not src.manifest(5).keyframe and src.manifest(5).parent == 4

    class Collecting(FileStore):
        def get(self, key):
            if key.startswith("chunks/") and key.rsplit("/", 1)[-1] in only4:
                (store / version_key(4)).unlink(missing_ok=True)
                raise NotFoundError(f"{key} collected", key=key)
            return super().get(key)

        def get_at_most(self, key, limit):  # how chunks are read whole
            return self.get(key)[: limit + 1]

    dst = tmp_path / "regional"
    mirror(weightsync.Repo(Collecting(store)), repo(dst), config=MirrorConfig(keyframe_payloads="eager"))
    assert repo(dst).head_version() == 3 and repo(dst).versions() == [0, 1, 2, 3]
    assert_versions_pull(repo(dst), traj, tmp_path, ws)


def test_a_lazy_chunk_collected_after_it_was_copied_is_copied_again_before_its_note_goes(published, tmp_path, ws):
    """A keyframe's full payload, copied after its manifest (lazily), vanishes right after its copy
    (a regional gc with a short grace took it while no manifest referenced it). Before, the mirror
    trusted its copy and cleared the note: a head whose chunk was missing and no note said so."""
    from weightsync.format.manifest import lazy_candidates

    store, traj = published
    lazy = lazy_candidates(repo(store).manifest(3))
    assert lazy
    victim, dropped = sorted(lazy)[0], []

    class Collected(FileStore):
        def put(self, key, data, *, mode="overwrite"):
            super().put(key, data, mode=mode)
            if key == chunk_key(victim) and not dropped:
                dropped.append(key)
                self.delete(key)

    dst = tmp_path / "regional"
    res = mirror(repo(store), weightsync.Repo(Collected(dst)))
    assert dropped and 3 in res.completed_versions and (dst / chunk_key(victim)).exists()
    assert not repo(dst).lazy_chunks(3)
    assert_versions_pull(repo(dst), traj, tmp_path, ws)


def test_a_commit_whose_last_look_fails_is_still_a_commit(published, tmp_path, ws, caplog):
    """The head moved, then the look at the manifest fails (the store's error outlasted the
    retries): the version is committed, so the publish says so (before the check it was; failing
    it would send a retry into "version 6 already exists")."""
    store, traj = published
    nxt = make_trajectory(tmp_path / "more", steps=6, shards=2, **ws.TINY)[6]

    class Blind(FileStore):
        def head(self, key):
            if key == version_key(6) and repo(store).head_version() == 6:
                raise StoreError("injected: HEAD failed", key=key)
            return super().head(key)

    assert weightsync.publish(nxt, weightsync.Repo(Blind(store)), base_dir=traj[5]).version == 6
    assert repo(store).head_version() == 6 and "could not check it is still stored" in caplog.text
