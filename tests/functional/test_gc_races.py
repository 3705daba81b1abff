"""gc racing writers that re-use old chunks: a publisher that touches a chunk it finds already
stored, a mirror that finds one already at the destination.

gc lists chunk ages once and deletes later; each test runs the writer in exactly that gap (the
listing is wrapped so that the writer runs after it and before the first delete), then pulls the
writer's version byte for byte. A gc without its re-checks deletes the re-used chunk and the pull
fails.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

import weightsync
import weightsync.sync.gc as gc_module
from weightsync.format.chunking import chunk_id
from weightsync.format.keys import chunk_key, version_key
from weightsync.store import FileStore
from weightsync.sync.gc import GcConfig, gc, object_age
from weightsync.sync.mirror import mirror

OLD = time.time() - 10 * 24 * 3600
KEYFRAMES = weightsync.PublishConfig(keyframe_interval=1)  # every version a keyframe: no chain to keep


def age_all(store_dir: Path) -> None:
    for p in store_dir.rglob("*"):
        if p.is_file():
            os.utime(p, (OLD, OLD))


def chunks(r: weightsync.Repo, v: int) -> set[str]:
    return {chunk_key(c.id) for c in r.manifest(v).chunks}


def writer_after_listing(monkeypatch, writer) -> None:
    """Make gc's chunk listing run ``writer()`` after it has listed (and before gc deletes)."""
    real = gc_module.list_chunks_with_age

    def listing_then_writer(store):
        listed = list(real(store))
        writer()
        return iter(listed)

    monkeypatch.setattr(gc_module, "list_chunks_with_age", listing_then_writer)


def publish_until_commit(r: weightsync.Repo, checkpoint: Path, monkeypatch):
    """Start publishing ``checkpoint`` in a thread that stops right before its commit (its chunks
    uploaded or touched). Returns (start, finish): ``start()`` returns once the publisher waits at
    its commit; ``finish()`` lets it commit and returns its result."""
    at_commit, go, out = threading.Event(), threading.Event(), {}
    commit = weightsync.Repo.commit

    def paused_commit(self, manifest, etag, *signing):
        at_commit.set()
        assert go.wait(60)
        return commit(self, manifest, etag, *signing)

    monkeypatch.setattr(weightsync.Repo, "commit", paused_commit)

    def run():
        try:
            out["result"] = weightsync.publish(checkpoint, r, config=KEYFRAMES)
        except BaseException as exc:  # noqa: BLE001 - re-raised by finish()
            out["error"] = exc
            at_commit.set()

    thread = threading.Thread(target=run, daemon=True)

    def start():
        thread.start()
        assert at_commit.wait(60)
        if "error" in out:
            raise out["error"]

    def finish():
        go.set()
        thread.join(60)
        if "error" in out:
            raise out["error"]
        return out["result"]

    return start, finish


def test_a_chunk_touched_by_a_publisher_between_listing_and_delete_survives(trajectory, tmp_path, monkeypatch, ws):
    store = tmp_path / "store"
    r = weightsync.open_repo(f"file://{store}")
    weightsync.publish(trajectory[0], r, config=KEYFRAMES)
    weightsync.publish(trajectory[1], r, config=KEYFRAMES)
    orphan = b"an old chunk nobody re-uses"
    r.put_chunk(chunk_id(orphan), orphan)
    age_all(store)
    reused = chunks(r, 0) - chunks(r, 1)  # only version 0 needs them: doomed by gc --keep 1
    assert reused

    # version 2 has version 0's bytes: its publisher finds those chunks stored and touches them,
    # after gc listed them as ten days old
    with monkeypatch.context() as mp:
        start, finish = publish_until_commit(weightsync.open_repo(f"file://{store}"), trajectory[0], mp)
        writer_after_listing(mp, start)
        res = gc(r, GcConfig(keep=1, grace_seconds=60))
        assert finish().version == 2

    assert all((store / k).exists() for k in reused)
    weightsync.pull(weightsync.open_repo(f"file://{store}"), tmp_path / "v2", 2)
    ws.assert_replica(tmp_path / "v2", trajectory[0])
    assert res.deleted_versions == [0]
    assert res.touched_during_gc == len(reused) and res.young_chunks == len(reused)
    assert res.deleted_chunks == 1 and not (store / chunk_key(chunk_id(orphan))).exists()  # the rest still goes


def test_a_chunk_referenced_by_a_version_mirrored_while_gc_runs_survives(trajectory, tmp_path, monkeypatch, ws):
    """The mirror touches chunks it finds at the destination (as a publisher does), and gc re-reads
    ``versions/`` before deleting and keeps what a manifest stored since its plan references: either
    protection keeps the re-used chunks."""
    src, dst = tmp_path / "src", tmp_path / "regional"
    rs, rd = (weightsync.open_repo(f"file://{p}") for p in (src, dst))
    weightsync.publish(trajectory[0], rs, config=KEYFRAMES)
    weightsync.publish(trajectory[1], rs, config=KEYFRAMES)
    mirror(rs, rd)
    age_all(dst)
    weightsync.publish(trajectory[0], rs, config=KEYFRAMES)  # version 2: version 0's bytes again
    reused = chunks(rd, 0) - chunks(rd, 1)
    assert reused and reused <= chunks(rs, 2)

    with monkeypatch.context() as mp:
        writer_after_listing(mp, lambda: mirror(rs, weightsync.open_repo(f"file://{dst}")))
        res = gc(rd, GcConfig(keep=1, grace_seconds=60))

    assert all((dst / k).exists() for k in reused)
    assert all(object_age(rd.store, k) < 60 for k in reused)  # touched by the mirror
    weightsync.pull(weightsync.open_repo(f"file://{dst}"), tmp_path / "v2", 2)
    ws.assert_replica(tmp_path / "v2", trajectory[0])
    assert res.referenced_during_gc == len(reused) and res.touched_during_gc == 0
    assert res.deleted_versions == [0] and res.deleted_chunks == 0


def test_a_chunk_collected_between_a_publishers_check_and_its_touch_is_uploaded_again(trajectory, tmp_path, ws):
    """The other order: gc deletes a re-used chunk after the publisher saw it (HEAD) and before its
    touch. The touch finds nothing; the publisher uploads the chunk again instead of failing."""
    store = tmp_path / "store"
    weightsync.publish(trajectory[0], f"file://{store}", config=KEYFRAMES)
    reused = chunks(weightsync.open_repo(f"file://{store}"), 0)
    collected = []

    class GcInTheGap(FileStore):
        def touch(self, key):
            if key in reused and key not in collected:
                collected.append(key)
                super().delete(key)  # gc wins the race
            super().touch(key)

    r = weightsync.Repo(GcInTheGap(store))
    assert weightsync.publish(trajectory[0], r, config=KEYFRAMES).version == 1  # the same bytes again
    assert collected and all((store / k).exists() for k in reused)
    weightsync.pull(weightsync.open_repo(f"file://{store}"), tmp_path / "v1", 1)
    ws.assert_replica(tmp_path / "v1", trajectory[0])


def test_object_age_reads_one_object(tmp_path):
    r = weightsync.open_repo(f"file://{tmp_path / 'store'}")
    data = b"x" * 10
    r.put_chunk(chunk_id(data), data)
    key = chunk_key(chunk_id(data))
    os.utime(tmp_path / "store" / key, (OLD, OLD))
    assert object_age(r.store, key) > 9 * 24 * 3600
    r.put_chunk(chunk_id(data), data)  # found stored: touched
    assert object_age(r.store, key) < 60
    with pytest.raises(weightsync.errors.NotFoundError):
        object_age(r.store, chunk_key("0" * 32))
    mem = weightsync.open_repo(weightsync.store.MemoryStore())
    mem.put_chunk(chunk_id(data), data)
    assert object_age(mem.store, key) is None  # no ages kept
    with pytest.raises(weightsync.errors.NotFoundError):
        object_age(mem.store, chunk_key("0" * 32))


@pytest.mark.integration
def test_a_chunk_touched_between_listing_and_delete_survives_on_s3(trajectory, s3_url, tmp_path, monkeypatch, ws):
    """The same race on S3: ages come from LastModified and the server's Date (one-second steps),
    the touch is a copy onto itself, the re-check a HEAD. S3 ages cannot be set, so the grace is
    long against a publish measured here (the touch must still look young at the re-check, a
    publish later), and the chunks are waited for until they are older than it, no longer."""
    r = weightsync.open_repo(s3_url)
    t0 = time.monotonic()
    weightsync.publish(trajectory[0], r, config=KEYFRAMES)
    weightsync.publish(trajectory[1], r, config=KEYFRAMES)
    grace = max(2.0, 2 * (time.monotonic() - t0))  # four times one publish, on average
    reused = chunks(r, 0) - chunks(r, 1)
    deadline = time.monotonic() + grace + 30
    while not all(object_age(r.store, k) >= grace for k in reused):  # everything older than the grace
        assert time.monotonic() < deadline, "chunks never aged past the grace period"
        time.sleep(0.1)

    with monkeypatch.context() as mp:  # not monkeypatch.undo(): that would drop the S3 environment too
        start, finish = publish_until_commit(weightsync.open_repo(s3_url), trajectory[0], mp)
        writer_after_listing(mp, start)
        res = gc(r, GcConfig(keep=1, grace_seconds=grace))
        assert finish().version == 2

    assert all(r.store.head(k) is not None for k in reused)
    weightsync.pull(weightsync.open_repo(s3_url), tmp_path / "v2", 2)
    ws.assert_replica(tmp_path / "v2", trajectory[0])
    assert res.deleted_versions == [0] and res.touched_during_gc == len(reused)


def test_a_publish_whose_chunks_gc_took_before_its_commit_commits_nothing(trajectory, tmp_path, monkeypatch, ws):
    """A publish longer than gc's grace: chunks stored earlier than ``refresh_after`` are touched
    again right before the commit, and one already collected stops the commit (no torn version)."""
    from weightsync.errors import VersionError
    from weightsync.sync.transfer import Uploader

    store = tmp_path / "store"
    r = weightsync.open_repo(store)
    weightsync.publish(trajectory[0], r, config=KEYFRAMES)
    real_join = Uploader.join

    def join_then_collected(self):  # what a gc with too short a grace does during a long publish
        real_join(self)
        for cid in list(self.stored_at):
            r.store.delete(chunk_key(cid))

    monkeypatch.setattr(Uploader, "join", join_then_collected)
    from weightsync.errors import UsageError

    with pytest.raises(UsageError, match="refresh_after"):
        weightsync.PublishConfig(refresh_after=-1)
    cfg = weightsync.PublishConfig(keyframe_interval=1, refresh_after=0)  # every chunk counts as stored long ago
    with pytest.raises(VersionError, match="deleted before its commit"):
        weightsync.publish(trajectory[1], r, config=cfg)
    assert r.head_version() == 0 and r.versions() == [0]
    weightsync.pull(r, tmp_path / "out", 0, config=weightsync.PullConfig(fsync=False))
    ws.assert_replica(tmp_path / "out", trajectory[0])


@pytest.mark.parametrize("multi_rank", [False, True], ids=["publish", "ranks"])
def test_a_fresh_chunk_gc_took_while_the_manifest_was_written_is_not_left_committed(
    trajectory, tmp_path, monkeypatch, ws, multi_rank
):
    """A gc that took a chunk younger than ``refresh_after`` for an abandoned upload's (a grace
    shorter than the publish, or a store clock ahead of its writer's), while the manifest was being
    written (after the touch before the commit): the commit exited 0 on a version no pull could
    build. Now the fresh chunks are checked before the head moves (no reader sees a version taken
    back): the manifest goes, the publish fails saying why, and the next publish is whole."""
    from weightsync.errors import VersionError
    from weightsync.format.keys import parse_version_key

    store = tmp_path / "store"
    r = weightsync.open_repo(store)
    weightsync.publish(trajectory[0], r)
    real_put, taken = FileStore.put, []

    def put_while_gc_runs(self, key, data, *, mode="overwrite"):
        out = real_put(self, key, data, mode=mode)
        if parse_version_key(key) == 1 and not taken:  # gc deletes one of version 1's new chunks
            fresh = sorted({c.id for c in r.manifest(1).chunks} - {c.id for c in r.manifest(0).chunks})
            taken.append(fresh[0])
            self.delete(chunk_key(fresh[0]))
        return out

    monkeypatch.setattr(FileStore, "put", put_while_gc_runs)
    if multi_rank:
        from weightsync.sync.parts import commit_parts, publish_part

        publish_part(trajectory[1], r, rank=0, world=1)
        with pytest.raises(VersionError, match="was deleted before its commit .* nothing was committed"):
            commit_parts(r, 1, world=1)
    else:
        with pytest.raises(VersionError, match="was deleted before its commit .* nothing was committed"):
            weightsync.publish(trajectory[1], r)
    assert taken and r.head_version() == 0 and r.versions() == [0]
    assert not (store / version_key(1)).exists()
    monkeypatch.setattr(FileStore, "put", real_put)
    assert weightsync.publish(trajectory[1], r).version == 1
    for v in (0, 1):
        weightsync.pull(r, tmp_path / f"out{v}", v, config=weightsync.PullConfig(fsync=False))
        ws.assert_replica(tmp_path / f"out{v}", trajectory[v])


def test_only_chunks_stored_before_refresh_after_are_touched_again_at_the_commit(trajectory, tmp_path, monkeypatch):
    touched = []
    real_touch = FileStore.touch
    monkeypatch.setattr(FileStore, "touch", lambda self, key: (touched.append(key), real_touch(self, key))[1])
    r = weightsync.open_repo(tmp_path / "store")
    weightsync.publish(trajectory[0], r, config=KEYFRAMES)  # default refresh_after: a short publish touches nothing
    assert touched == []
    from weightsync.sync.transfer import Uploader

    real_join = Uploader.join

    def join_then_age(self):
        real_join(self)
        age_all(tmp_path / "store" / "chunks")

    monkeypatch.setattr(Uploader, "join", join_then_age)
    weightsync.publish(trajectory[1], r, config=weightsync.PublishConfig(keyframe_interval=1, refresh_after=0))
    assert sorted(touched) == sorted(chunks(r, 1))
    assert all(object_age(r.store, key) < 60 for key in chunks(r, 1))  # young again: gc's grace counts from here


def test_a_gc_cut_short_after_any_manifest_delete_leaves_every_listed_version_buildable(tmp_path, monkeypatch):
    """gc deletes the manifests newest first: cut short after each delete (a kill, three gc runs in a
    row), every version still listed pulls byte for byte (deleting oldest first left versions listed
    whose delta parent was gone, and a pull of them named a version nobody asked for)."""
    from weightsync.demo import make_trajectory
    from weightsync.format.keys import VERSIONS_PREFIX, parse_version_key

    traj = make_trajectory(tmp_path / "traj", steps=5, hidden=32, layers=1, experts=2, vocab=128)
    store_dir = tmp_path / "store"
    for ckpt in traj:  # keyframes 0 and 3: keep=2 keeps 3, 4, 5 and collects the chain 0, 1, 2
        weightsync.publish(ckpt, store_dir, config=weightsync.PublishConfig(keyframe_interval=3))
    age_all(store_dir)
    r = weightsync.Repo(FileStore(store_dir))
    real = FileStore.delete

    def delete_then_die(self, key):
        real(self, key)
        if parse_version_key(key) is not None:
            raise KeyboardInterrupt("killed")  # (not an error gc could catch)

    for left in ([0, 1, 3, 4, 5], [0, 3, 4, 5], [3, 4, 5]):
        monkeypatch.setattr(FileStore, "delete", delete_then_die)
        with pytest.raises(KeyboardInterrupt):
            gc(r, GcConfig(keep=2, grace_seconds=0))
        monkeypatch.setattr(FileStore, "delete", real)
        listed = sorted(v for v in (parse_version_key(k) for k in r.store.list(VERSIONS_PREFIX)) if v is not None)
        assert listed == left
        for v in listed:
            out = tmp_path / f"{len(listed)}-v{v}"
            weightsync.pull(r, out, v)
            for f in traj[v].iterdir():
                assert (out / f.name).read_bytes() == f.read_bytes(), (listed, v, f.name)
    r.store.delete(version_key(3))  # by hand: a chain with a hole names the version asked for, then the hole
    with pytest.raises(weightsync.VersionError, match=r"^version 4 of .* cannot be built: the version 3 it is a delta"):
        weightsync.pull(weightsync.Repo(FileStore(store_dir)), tmp_path / "hole", 4)  # (r holds it in its cache)
