"""The pipelined mirror on file stores: lazy keyframe payloads, sharded copiers with one committer,
chunks of parts copied before their commit, and the attacks on it (killed mid-version, racing
mirrors, a dead shard, a source gc mid-copy, a destination gc alongside).

After every attack the region must be whole: each committed version's chunks are all there, with
their bytes, except those its lazy note lists (:func:`assert_region_whole`), and versions pulled from
it equal their source checkpoints byte for byte.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import xxhash

import weightsync
from weightsync.demo import make_trajectory
from weightsync.errors import NotFoundError, WeightsyncError
from weightsync.format.keys import LAZY_PREFIX, VERSIONS_PREFIX, chunk_key, lazy_key, version_key
from weightsync.format.manifest import part_from_json
from weightsync.store import FileStore
from weightsync.sync.gc import GcConfig, gc
from weightsync.sync.mirror import (
    MirrorConfig,
    MirrorObserver,
    MirrorStatus,
    lazy_candidates,
    mirror,
    shard_of,
)
from weightsync.sync.parts import commit_parts, publish_part
from weightsync.sync.publish import PublishConfig

SMALL = {"hidden": 64, "layers": 1, "experts": 2, "vocab": 256, "lr": 1e-6}  # deltas far smaller than keyframes
EVERY_2 = PublishConfig(keyframe_interval=2)
# chunks of 4 KiB: dozens a version, so each of a few shards holds some whatever the payloads' bytes
# (a chunk's shard follows its id, a hash of its bytes; with EVERY_2's few chunks a codec change
# could leave a shard empty, as 7f83200's did)
SMALL_CHUNKS = PublishConfig(keyframe_interval=2, chunk_bytes=4096)


def repo(path: Path, **kw) -> weightsync.Repo:
    return weightsync.open_repo(f"file://{path}", **kw)


def chunk_bytes(store: Path) -> int:
    return sum(p.stat().st_size for p in (store / "chunks").rglob("*") if p.is_file())


def assert_region_whole(dst: Path) -> int | None:
    """Every version at or below the head has each chunk present with its bytes, or listed in its
    lazy note (a note or manifest above the head is an interrupted commit: unseen). Returns the head."""
    r = repo(dst)
    head = r.head_version()
    if head is None:
        return None
    for v in r.versions():
        m = r.manifest(v)
        noted = r.lazy_chunks(v)
        for c in m.chunks:
            path = dst / chunk_key(c.id)
            if c.id in noted and not path.exists():
                continue
            assert path.exists(), f"version {v}: chunk {c.id} missing and not noted"
            data = path.read_bytes()
            assert len(data) == c.size and xxhash.xxh3_128_hexdigest(data) == c.id, f"version {v}: {c.id} damaged"
    return head


def publish_all(
    traj: list[Path], src: weightsync.Repo, upto: int | None = None, start: int = 0, config: PublishConfig = EVERY_2
) -> None:
    for i in range(start, len(traj) if upto is None else upto + 1):
        weightsync.publish(traj[i], src, config=config, base_dir=traj[i - 1] if i else None)


@pytest.fixture
def small(tmp_path) -> list[Path]:
    """Eight checkpoints (steps 0..7) of a small model trained at lr 1e-6."""
    return make_trajectory(tmp_path / "traj", steps=7, **SMALL)


class Heads(MirrorObserver):
    """Each poll's (source head, destination head), and the statuses reported."""

    def __init__(self):
        self.polls: list[tuple[int | None, int | None]] = []
        self.statuses: list[MirrorStatus] = []

    def on_heads(self, source, destination):
        self.polls.append((source, destination))

    def on_status(self, status):
        self.statuses.append(status)


def follow(src, dst, cfg: MirrorConfig, observer: MirrorObserver | None = None):
    """A following mirror in a thread: (thread, stop event, result holder)."""
    stop, out = threading.Event(), {}

    def run():
        try:
            out["result"] = mirror(src, dst, follow=True, config=cfg, stop=stop, observer=observer)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, stop, out


def wait_for(pred, what: str, timeout: float = 60.0, thread_out: dict | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if thread_out and "error" in thread_out:
            raise AssertionError(f"the mirror failed waiting for {what}") from thread_out["error"]
        if result := pred():
            return result
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


# --- pure parts ---------------------------------------------------------------------------------------
def test_lazy_candidates_are_the_chunks_only_full_payloads_with_a_delta_use(small, tmp_path):
    src = repo(tmp_path / "src")
    publish_all(small, src, upto=2)
    assert lazy_candidates(src.manifest(0)) == frozenset()  # a keyframe without a parent: whole
    assert lazy_candidates(src.manifest(1)) == frozenset()  # a delta
    k = src.manifest(2)
    lazy = lazy_candidates(k)
    needed = set()
    for f in k.files:
        for s in f.segments:
            if s.delta is not None and s.delta.payload is not None:
                needed.update(k.chunks[p.chunk].id for p in s.delta.payload.parts)
            if s.delta is None and s.payload is not None:  # a follower reads these in full
                needed.update(k.chunks[p.chunk].id for p in s.payload.parts)
    assert lazy and not lazy & needed and lazy | needed == {c.id for c in k.chunks}


def test_shards_split_chunk_ids_evenly_and_the_config_refuses_nonsense():
    ids = [xxhash.xxh3_128_hexdigest(str(i).encode()) for i in range(4000)]
    counts = [sum(shard_of(i, 4) == s for i in ids) for s in range(4)]
    assert sum(counts) == 4000 and min(counts) > 800
    for bad in ({"shard": 2, "shards": 2}, {"shards": 0}, {"keyframe_payloads": "sometimes"}, {"concurrency": 0}):
        with pytest.raises(weightsync.WeightsyncError):
            MirrorConfig(**bad)


# --- lazy keyframes -----------------------------------------------------------------------------------
def test_keyframe_every_2_mirrored_version_by_version_holds_at_most_half_and_serves(small, tmp_path, ws):
    """``never``: the region gets every version, but only the first keyframe's full payloads."""
    src, dst = repo(tmp_path / "src"), repo(tmp_path / "region")
    follower = tmp_path / "follower"
    for i in range(len(small)):
        publish_all(small, src, upto=i, start=i)
        res = mirror(src, dst, config=MirrorConfig(keyframe_payloads="never"))
        assert res.copied_versions == [i] and res.head == i
        assert res.lazy_versions == ([i] if i and i % 2 == 0 else [])
        weightsync.pull(dst, follower)  # a subscriber of the region, one version behind each time
        ws.assert_replica(follower, small[i])
        assert_region_whole(tmp_path / "region")
    region, source = chunk_bytes(tmp_path / "region"), chunk_bytes(tmp_path / "src")
    assert region <= source / 2, (region, source)
    assert sorted(int(k[5:25]) for k in dst.store.list(LAZY_PREFIX)) == [2, 4, 6]
    # a fresh pull of the last version: the reader rebuilds keyframe 6 from version 0 plus deltas
    # or reads the noted chunks elsewhere; until it does, it must fail with an error, never bytes
    fresh = tmp_path / "fresh"
    try:
        weightsync.pull(dst, fresh, 7)
    except WeightsyncError:
        pass
    else:
        ws.assert_replica(fresh, small[7])
    # then lazily: the full payloads arrive, every note goes, and a fresh pull works from the region
    res = mirror(src, dst, config=MirrorConfig(keyframe_payloads="lazy"))
    assert res.copied_versions == [] and sorted(res.completed_versions) == [2, 4, 6]
    assert list(dst.store.list(LAZY_PREFIX)) == []
    assert chunk_bytes(tmp_path / "region") == chunk_bytes(tmp_path / "src")
    weightsync.pull(dst, tmp_path / "fresh2", 7)
    ws.assert_replica(tmp_path / "fresh2", small[7])


class Holding(FileStore):
    """A source whose reads of ``held`` chunk ids wait until ``release`` is set."""

    def __init__(self, root, held: set[str], release: threading.Event):
        super().__init__(root)
        self.held, self.release = held, release

    def get(self, key):
        if key.startswith("chunks/") and key.rsplit("/", 1)[-1] in self.held:
            assert self.release.wait(120)
        return super().get(key)

    def get_at_most(self, key, limit):  # how chunks are read whole
        return self.get(key)[: limit + 1]


def test_the_region_head_follows_a_keyframe_within_one_poll_while_its_full_payloads_are_held(small, tmp_path, ws):
    src_dir, dst_dir = tmp_path / "src", tmp_path / "region"
    publish_all(small, repo(src_dir), upto=1)
    release = threading.Event()
    held: set[str] = set()
    source = weightsync.Repo(Holding(src_dir, held, release))
    heads = Heads()
    t, stop, out = follow(source, repo(dst_dir), MirrorConfig(interval=0.2), heads)
    try:
        wait_for(lambda: repo(dst_dir).head_version() == 1, "version 1", thread_out=out)
        publish_all(small, repo(src_dir), upto=2, start=2)  # keyframe 2, its full payloads held at the source
        held.update(lazy_candidates(repo(src_dir).manifest(2)))
        assert held
        wait_for(lambda: repo(dst_dir).head_version() == 2, "keyframe 2 in the region", thread_out=out)
        assert repo(dst_dir).lazy_chunks(2) == held
        first = next(i for i, (s, _) in enumerate(heads.polls) if s == 2)
        wait_for(lambda: len(heads.polls) > first + 1, "the next poll", thread_out=out)
        assert heads.polls[first + 1][1] == 2, heads.polls  # the head moved within one poll
        follower = tmp_path / "follower"
        weightsync.pull(repo(dst_dir), follower, 1)
        weightsync.pull(repo(dst_dir), follower)  # follows onto the keyframe by its delta payloads
        ws.assert_replica(follower, small[2])
        assert any(s.lazy_pending == len(held) for s in heads.statuses)
        release.set()  # the full payloads arrive afterwards, and the note goes
        wait_for(lambda: not (dst_dir / lazy_key(2)).exists(), "the note cleared", thread_out=out)
        assert all((dst_dir / chunk_key(i)).exists() for i in held)
        wait_for(lambda: heads.statuses[-1].lazy_pending == 0, "no lazy chunk pending", thread_out=out)
    finally:
        release.set()
        stop.set()
        t.join(60)
    assert "error" not in out, out.get("error")
    assert out["result"].completed_versions == [2]
    weightsync.pull(repo(dst_dir), tmp_path / "fresh", 2)
    ws.assert_replica(tmp_path / "fresh", small[2])
    assert_region_whole(dst_dir)


def test_eager_copies_keyframes_whole_and_a_far_behind_region_gets_its_first_keyframe_whole(small, tmp_path):
    src = repo(tmp_path / "src")
    publish_all(small, src, upto=4)
    res = mirror(src, repo(tmp_path / "eager"), config=MirrorConfig(keyframe_payloads="eager"))
    assert res.lazy_versions == [] and list(repo(tmp_path / "eager").store.list(LAZY_PREFIX)) == []
    # the source collected versions 0..3: the oldest left (keyframe 4) has no parent in the region
    age = time.time() - 10 * 86400
    for p in (tmp_path / "src").rglob("*"):
        os.utime(p, (age, age))
    gc(src, GcConfig(keep=1, grace_seconds=60))
    assert src.versions() == [4]
    res = mirror(src, repo(tmp_path / "late"), config=MirrorConfig(keyframe_payloads="never"))
    assert res.copied_versions == [4] and res.lazy_versions == []
    assert chunk_bytes(tmp_path / "late") == sum(c.size for c in {c.id: c for c in src.manifest(4).chunks}.values())


def test_a_restarted_mirror_copies_the_lazy_chunks_an_earlier_run_noted(small, tmp_path):
    src, dst = repo(tmp_path / "src"), repo(tmp_path / "region")
    publish_all(small, src, upto=4)
    res = mirror(src, dst, config=MirrorConfig(keyframe_payloads="never"))
    assert res.lazy_versions == [2, 4] and res.head == 4
    res = mirror(src, dst, config=MirrorConfig(keyframe_payloads="eager"))  # eager also fills old notes
    assert res.copied_versions == [] and sorted(res.completed_versions) == [2, 4]
    assert list(dst.store.list(LAZY_PREFIX)) == []
    assert assert_region_whole(tmp_path / "region") == 4


# --- parts of a multi-rank publish ----------------------------------------------------------------------
def test_chunks_of_parts_are_copied_before_the_commit(trajectory, tmp_path, ws):
    src_dir, dst_dir = tmp_path / "src", tmp_path / "region"
    weightsync.publish(trajectory[0], repo(src_dir))
    t, stop, out = follow(repo(src_dir), repo(dst_dir), MirrorConfig(interval=0.1))
    try:
        wait_for(lambda: repo(dst_dir).head_version() == 0, "version 0", thread_out=out)
        for rank in range(2):
            publish_part(trajectory[1], repo(src_dir), rank, 2, base_dir=trajectory[0])
        store = repo(src_dir).store
        named = {c.id for k in store.list("parts/") for c in part_from_json(store.get(k)).chunks}
        assert named
        wait_for(lambda: all((dst_dir / chunk_key(i)).exists() for i in named), "the parts' chunks", thread_out=out)
        assert repo(dst_dir).head_version() == 0 and not (dst_dir / version_key(1)).exists()
        commit_parts(repo(src_dir), 1, 2)
        wait_for(lambda: repo(dst_dir).head_version() == 1, "version 1", thread_out=out)
    finally:
        stop.set()
        t.join(60)
    assert "error" not in out, out.get("error")
    weightsync.pull(repo(dst_dir), tmp_path / "sub", 1)
    ws.assert_replica(tmp_path / "sub", trajectory[1])


@pytest.mark.parametrize("policy", ["never", "lazy"])
def test_a_keyframes_parts_send_only_what_followers_need_before_the_commit(small, tmp_path, ws, policy):
    """A multi-rank keyframe on a parent the region holds: of the chunks its parts name, the mirror
    copies before the commit only those a follower reads (the keyframe's deltas), and the region's
    head follows; the full payloads cross after the regional commit (``lazy``) or never."""
    src_dir, dst_dir = tmp_path / "src", tmp_path / "region"
    publish_all(small, repo(src_dir), upto=1)
    t, stop, out = follow(repo(src_dir), repo(dst_dir), MirrorConfig(interval=0.05, keyframe_payloads=policy))
    try:
        wait_for(lambda: repo(dst_dir).head_version() == 1, "version 1", thread_out=out)
        for rank in range(2):
            publish_part(small[2], repo(src_dir), rank, 2, config=EVERY_2, base_dir=small[1])
        store = repo(src_dir).store
        parts = [part_from_json(store.get(k)) for k in store.list("parts/")]
        assert len(parts) == 2 and all(p.keyframe for p in parts)
        lazy = set().union(*(lazy_candidates(p) for p in parts))
        needed = {c.id for p in parts for c in p.chunks} - lazy
        assert lazy and needed
        wait_for(lambda: all((dst_dir / chunk_key(i)).exists() for i in needed), "the deltas' chunks", thread_out=out)
        time.sleep(0.5)  # ten more polls: nothing of the full payloads crosses before the commit
        assert not any((dst_dir / chunk_key(i)).exists() for i in lazy)
        commit_parts(repo(src_dir), 2, 2)
        wait_for(lambda: repo(dst_dir).head_version() == 2, "version 2", thread_out=out)
        if policy == "lazy":
            wait_for(lambda: not repo(dst_dir).lazy_chunks(2), "the lazy chunks", thread_out=out)
        else:
            time.sleep(0.5)
    finally:
        stop.set()
        t.join(60)
    assert "error" not in out, out.get("error")
    if policy == "lazy":
        assert all((dst_dir / chunk_key(i)).exists() for i in lazy)
    else:
        assert not any((dst_dir / chunk_key(i)).exists() for i in lazy)
        assert repo(dst_dir).lazy_chunks(2) == lazy
    weightsync.pull(repo(dst_dir), tmp_path / "sub", 1)
    weightsync.pull(repo(dst_dir), tmp_path / "sub", 2)  # a follower crosses the keyframe on its deltas
    ws.assert_replica(tmp_path / "sub", small[2])


# --- sharding -----------------------------------------------------------------------------------------
def test_shards_copy_their_chunks_and_the_committer_waits_for_a_dead_shard(small, tmp_path, ws):
    src_dir, dst_dir = tmp_path / "src", tmp_path / "region"
    publish_all(small, repo(src_dir), upto=3, config=SMALL_CHUNKS)
    all_ids = {c.id for v in range(4) for c in repo(src_dir).manifest(v).chunks}
    lazy = lazy_candidates(repo(src_dir).manifest(2))  # keyframe 2's full payloads: after its head
    assert {shard_of(i, 3) for i in all_ids - lazy} == {0, 1, 2}, len(all_ids)  # every shard has work
    dead = shard_of(repo(src_dir).manifest(0).chunks[0].id, 3)  # it holds a chunk of the first version
    copier, committing = (dead + 1) % 3, (dead + 2) % 3
    cfg = lambda i, commit=False: MirrorConfig(interval=0.05, shard=i, shards=3, commit=commit)  # noqa: E731
    run = [follow(repo(src_dir), repo(dst_dir), cfg(copier))]  # a shard alone copies, never commits
    try:
        wait_for(
            lambda: all((dst_dir / chunk_key(i)).exists() for i in all_ids - lazy if shard_of(i, 3) == copier),
            "the shard's chunks",
            thread_out=run[0][2],
        )
        assert not list(repo(dst_dir).store.list(VERSIONS_PREFIX)) and repo(dst_dir).head_version() is None
        assert not any((dst_dir / chunk_key(i)).exists() for i in lazy)
        committer = Heads()
        run.append(follow(repo(src_dir), repo(dst_dir), cfg(committing, commit=True), committer))
        wait_for(lambda: len(committer.polls) >= 5, "five polls of the committer", thread_out=run[1][2])
        wait_for(
            lambda: all((dst_dir / chunk_key(i)).exists() for i in all_ids - lazy if shard_of(i, 3) == committing),
            "the committer's chunks",
            thread_out=run[1][2],
        )
        # version 0 lacks the dead shard's chunk: nothing is committed, whatever else is there
        assert repo(dst_dir).head_version() is None and not list(repo(dst_dir).store.list(VERSIONS_PREFIX))
        assert not any((dst_dir / chunk_key(i)).exists() for i in all_ids if shard_of(i, 3) == dead)
        run.append(follow(repo(src_dir), repo(dst_dir), cfg(dead)))  # the shard comes back
        wait_for(lambda: repo(dst_dir).head_version() == 3, "version 3", thread_out=run[1][2])
        wait_for(lambda: not list(repo(dst_dir).store.list(LAZY_PREFIX)), "the lazy chunks", thread_out=run[1][2])
    finally:
        for _, stop, _ in run:
            stop.set()
        for t, _, _ in run:
            t.join(60)
    for _, _, out in run:
        assert "error" not in out, out.get("error")
    assert_region_whole(dst_dir)
    res = [out["result"] for _, _, out in run]
    assert res[0].copied_versions == res[2].copied_versions == []  # only the committer commits
    assert res[1].copied_versions == [0, 1, 2, 3] and res[1].lazy_versions == [2]
    assert chunk_bytes(dst_dir) == chunk_bytes(src_dir)
    weightsync.pull(repo(dst_dir), tmp_path / "sub", 3)
    ws.assert_replica(tmp_path / "sub", small[3])


def test_two_mirrors_racing_on_one_destination_commit_each_version_once(small, tmp_path, ws):
    src_dir, dst_dir = tmp_path / "src", tmp_path / "region"
    publish_all(small, repo(src_dir), upto=5)
    results, errors = [], []

    def one(cfg):
        try:
            results.append(mirror(repo(src_dir), repo(dst_dir), config=cfg))
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [
        threading.Thread(target=one, args=(MirrorConfig(concurrency=c, keyframe_payloads=k),))
        for c, k in ((1, "lazy"), (8, "lazy"), (3, "eager"))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert all(r.head == 5 for r in results)
    copied = sorted(v for r in results for v in r.copied_versions)
    assert copied == list(range(6))  # each manifest written once; the others found it identical
    for v in range(6):
        assert (dst_dir / version_key(v)).read_bytes() == (src_dir / version_key(v)).read_bytes()
    assert assert_region_whole(dst_dir) == 5
    assert list(repo(dst_dir).store.list(LAZY_PREFIX)) == []  # every run ends with the lazy chunks copied
    weightsync.pull(repo(dst_dir), tmp_path / "sub")
    ws.assert_replica(tmp_path / "sub", small[5])


# --- attacks ------------------------------------------------------------------------------------------
def test_a_mirror_killed_at_any_moment_leaves_a_whole_region_and_resumes(small, tmp_path, cli_env, ws):
    src_dir, dst_dir = tmp_path / "src", tmp_path / "region"
    publish_all(small, repo(src_dir))
    argv = [
        sys.executable,
        "-m",
        "weightsync.cli",
        "mirror",
        "--from",
        f"file://{src_dir}",
        "--to",
        f"file://{dst_dir}",
    ]
    heads = []
    for delay in (0.4, 0.8, 1.2, 1.6, 2.0, 2.5):
        proc = subprocess.Popen(
            [*argv, "--concurrency", "2"], env=cli_env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        heads.append(assert_region_whole(dst_dir))  # whatever it had done: nothing torn
    r = subprocess.run(argv, env=cli_env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "7" and assert_region_whole(dst_dir) == 7
    assert list(repo(dst_dir).store.list(LAZY_PREFIX)) == []
    for v in (3, 6, 7):
        weightsync.pull(repo(dst_dir), tmp_path / f"sub{v}", v)
        ws.assert_replica(tmp_path / f"sub{v}", small[v])


class Collecting(FileStore):
    """A source whose gc collects version ``victim`` (manifest and chunks) at the first read of one of its chunks."""

    def __init__(self, root, victim_chunks: set[str], victim: int):
        super().__init__(root)
        self.victim_chunks, self.victim, self.done = victim_chunks, victim, False

    def get(self, key):
        if not self.done and key.startswith("chunks/") and key.rsplit("/", 1)[-1] in self.victim_chunks:
            self.done = True
            self.delete(version_key(self.victim))
            for c in self.victim_chunks:
                self.delete(chunk_key(c))
            raise NotFoundError(f"{key} collected", key=key)
        return super().get(key)

    def get_at_most(self, key, limit):  # how chunks are read whole
        return self.get(key)[: limit + 1]


def test_a_version_the_source_collects_mid_copy_is_skipped(small, tmp_path, ws):
    src_dir, dst_dir = tmp_path / "src", tmp_path / "region"
    publish_all(small, repo(src_dir), upto=3)
    older = {c.id for v in (0, 2, 3) for c in repo(src_dir).manifest(v).chunks}
    only1 = {c.id for c in repo(src_dir).manifest(1).chunks} - older
    assert only1
    res = mirror(weightsync.Repo(Collecting(src_dir, only1, 1)), repo(dst_dir))
    assert res.copied_versions == [0, 2, 3] and res.head == 3
    assert not (dst_dir / version_key(1)).exists()
    assert_region_whole(dst_dir)
    weightsync.pull(repo(dst_dir), tmp_path / "sub", 3)
    ws.assert_replica(tmp_path / "sub", small[3])


def test_a_destination_gc_running_alongside_never_tears_a_version(small, tmp_path, ws):
    src_dir, dst_dir = tmp_path / "src", tmp_path / "region"
    publish_all(small, repo(src_dir), upto=1)
    t, stop, out = follow(repo(src_dir), repo(dst_dir), MirrorConfig(interval=0.05, keyframe_payloads="never"))
    gc_stop, gcs = threading.Event(), []

    def collect():
        while not gc_stop.is_set():
            try:
                if repo(dst_dir).head_version() is not None:
                    gcs.append(gc(repo(dst_dir), GcConfig(keep=1, grace_seconds=30)))
            except WeightsyncError as exc:  # pragma: no cover - reported below
                gcs.append(exc)
            time.sleep(0.01)

    g = threading.Thread(target=collect, daemon=True)
    g.start()
    try:
        for v in range(2, len(small)):
            publish_all(small, repo(src_dir), upto=v, start=v)
            wait_for(lambda v=v: repo(dst_dir).head_version() == v, f"version {v}", thread_out=out)
            assert_region_whole(dst_dir)
    finally:
        gc_stop.set()
        g.join(60)
        stop.set()
        t.join(60)
    assert "error" not in out, out.get("error")
    assert gcs and not [r for r in gcs if isinstance(r, Exception)], gcs
    assert_region_whole(dst_dir)
    # keep=1, but version 7's keyframe (6) and the ones before it are held lazily: gc keeps the path
    # back to the newest whole keyframe (0), which a reader rebuilds them from
    assert repo(dst_dir).versions() == list(range(len(small)))
    sub = tmp_path / "sub"
    for v in range(len(small)):  # a subscriber that follows the region from its first version
        weightsync.pull(repo(dst_dir), sub, v)
        ws.assert_replica(sub, small[v])


# --- retention with lazy notes --------------------------------------------------------------------------
def age_all(store_dir: Path) -> None:
    old = time.time() - 10 * 86400
    for p in store_dir.rglob("*"):
        if p.is_file():
            os.utime(p, (old, old))


def test_gc_keeps_the_path_back_to_a_whole_keyframe_and_deletes_notes_with_their_versions(small, tmp_path, ws):
    src, dst_dir = repo(tmp_path / "src"), tmp_path / "region"
    dst = repo(dst_dir)
    publish_all(small, src, upto=5)  # keyframes 0, 2 and 4
    assert mirror(src, dst, config=MirrorConfig(keyframe_payloads="never")).lazy_versions == [2, 4]
    noted = dst.lazy_chunks(2) | dst.lazy_chunks(4)
    (dst_dir / lazy_key(99)).write_bytes((dst_dir / lazy_key(2)).read_bytes())  # a dead mirror's: no manifest
    age_all(dst_dir)
    (dst_dir / lazy_key(98)).write_bytes((dst_dir / lazy_key(2)).read_bytes())  # a young one: a mirror committing
    res = gc(dst, GcConfig(keep=1, grace_seconds=60))
    # 5 builds on keyframe 4, held lazily: back through 3 to keyframe 2, lazy too, through 1 to 0, whole
    assert res.kept_versions == [0, 1, 2, 3, 4, 5] and res.deleted_versions == [] and res.deleted_chunks == 0
    assert res.lazy_chunks == len(noted) > 0 and res.deleted_notes == 1
    assert not (dst_dir / lazy_key(99)).exists() and (dst_dir / lazy_key(98)).exists()
    assert dst.lazy_chunks(2) and dst.lazy_chunks(4)
    assert_region_whole(dst_dir)

    sizes = {r.id: r.size for r in src.manifest(4).chunks}
    for c in lazy_candidates(src.manifest(4)):  # keyframe 4's full payloads arrive (as a lazy mirror does)
        dst.store_chunk(c, sizes[c], src.get_chunk(c, sizes[c]))
    dst.clear_lazy_chunks(4)
    age_all(dst_dir)
    res = gc(dst, GcConfig(keep=1, grace_seconds=60))
    assert res.kept_versions == [4, 5] and res.deleted_versions == [0, 1, 2, 3]
    assert res.lazy_chunks == 0 and res.deleted_notes == 2  # version 2's, after its manifest; 98's, old now
    assert list(dst.store.list(LAZY_PREFIX)) == []
    assert_region_whole(dst_dir)
    weightsync.pull(dst, tmp_path / "fresh", 5)  # from the whole keyframe 4
    ws.assert_replica(tmp_path / "fresh", small[5])


# --- the command line -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "flags, word",
    [
        (["--shard", "2/2"], "--shard"),
        (["--shard", "one"], "--shard"),
        (["--shard", "0/0"], "--shard"),
        (["--keyframe-payloads", "sometimes"], "--keyframe-payloads"),
        (["--concurrency", "0"], "concurrency"),
        (["--interval", "0"], "interval"),
    ],
)
def test_bad_mirror_flags_are_one_line_and_touch_no_store(flags, word, published, tmp_path, run_cli):
    src, _ = published
    rc, out, err = run_cli("mirror", "--from", f"file://{src}", "--to", f"file://{tmp_path / 'region'}", *flags)
    assert rc == 2 and out == "" and word in err.strip().splitlines()[-1], err
    assert not (tmp_path / "region").exists()


def test_cli_shards_with_one_committer(published, tmp_path, ok_cli, ws):
    src, traj = published
    dst = f"file://{tmp_path / 'region'}"
    # the copier shard first: it creates the store's marker, copies its chunks, commits nothing
    out = ok_cli("mirror", "--from", f"file://{src}", "--to", dst, "--shard", "1/2", "--keyframe-payloads", "eager")
    assert out.strip() == "" and repo(tmp_path / "region").head_version() is None
    out = ok_cli("mirror", "--from", f"file://{src}", "--to", dst, "--shard", "0/2", "--commit")
    assert out.strip() == "5" and assert_region_whole(tmp_path / "region") == 5
    for v in (2, 5):
        weightsync.pull(repo(tmp_path / "region"), tmp_path / f"sub{v}", v)
        ws.assert_replica(tmp_path / f"sub{v}", traj[v])


def test_gc_keeps_the_path_behind_a_damaged_note(small, tmp_path, ws):
    src, dst_dir = repo(tmp_path / "src"), tmp_path / "region"
    publish_all(small, src, upto=3)
    mirror(src, repo(dst_dir), config=MirrorConfig(keyframe_payloads="never"))
    (dst_dir / lazy_key(2)).write_bytes(b"{not json")  # planted, or torn by a full disk
    age_all(dst_dir)
    res = gc(repo(dst_dir), GcConfig(keep=1, grace_seconds=60))
    assert res.kept_versions == [0, 1, 2, 3] and res.deleted_chunks == 0  # it may lack chunks: kept
    sub = tmp_path / "sub"
    for v in range(4):
        weightsync.pull(repo(dst_dir), sub, v)
        ws.assert_replica(sub, small[v])
