"""Multi-rank publishing on file stores: ``weightsync publish-part`` and ``weightsync commit-parts``.

Ranks publish their parts as real processes (or in-process where a failure must be injected);
every committed version is pulled and compared with its checkpoint folder byte for byte.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import threading
import time
from pathlib import Path

import pytest
from procs import finish, spawn_cli
from test_daemons import daemons, http, wait_for  # noqa: F401  (daemons is a fixture)

import weightsync
from weightsync.demo import make_trajectory
from weightsync.errors import StoreError, VersionError
from weightsync.format.keys import HEAD_KEY, PARTS_PREFIX, chunk_key, part_key, parts_prefix, refused_key, version_key
from weightsync.format.manifest import PartManifest, part_from_json, part_to_json
from weightsync.store import FileStore
from weightsync.sync.gc import GcConfig, gc
from weightsync.sync.observer import Callbacks
from weightsync.sync.parts import assign_files, commit_parts, publish_part, read_refusal
from weightsync.sync.publish import PublishConfig

TINY = {"hidden": 32, "layers": 1, "experts": 2, "vocab": 128}
OLD = time.time() - 10 * 24 * 3600


@pytest.fixture
def sharded(tmp_path) -> list[Path]:
    """Five checkpoints (steps 0..4) in four safetensors shards, an index and a config."""
    return make_trajectory(tmp_path / "traj", steps=4, shards=4, **TINY)


def repo(store: Path) -> weightsync.Repo:
    return weightsync.open_repo(f"file://{store}")


def folder_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in Path(root).rglob("*") if p.is_file())


def chunk_bytes(store: Path) -> int:
    return folder_bytes(store / "chunks") if (store / "chunks").exists() else 0


def publish_ranks(ckpt: Path, store: Path, world: int, **kwargs) -> list:
    return [publish_part(ckpt, repo(store), r, world, **kwargs) for r in range(world)]


def age(store: Path, prefix: str) -> None:
    for p in (store / prefix).rglob("*"):
        if p.is_file():
            os.utime(p, (OLD, OLD))


def stored_part(store: Path, version: int, rank: int, world: int) -> PartManifest:
    key = part_key(version, rank, world)
    return part_from_json((store / key).read_bytes(), key)


def step_as_processes(env, ckpt: Path, store: Path, world: int) -> int:
    """``world`` publish-part processes and one commit-parts process, all started at once."""
    url = f"file://{store}"
    head = repo(store).head_version() if (store / HEAD_KEY).exists() else None
    version = 0 if head is None else head + 1
    committer = spawn_cli(
        "commit-parts", "--store", url, "--version", version, "--world", world, "--timeout", 60, env=env
    )
    ranks = [
        spawn_cli("publish-part", ckpt, "--store", url, "--rank", r, "--world", world, env=env) for r in range(world)
    ]
    for r, proc in enumerate(ranks):
        rc, out, err = finish(proc)
        assert rc == 0, f"rank {r} exited {rc}: {err}"
        assert out.strip().splitlines()[-1] == str(version)
    rc, out, err = finish(committer)
    assert rc == 0, f"commit-parts exited {rc}: {err}"
    assert out.strip().splitlines()[-1] == str(version)
    return version


# --- the main path ------------------------------------------------------------------------------------
def test_four_rank_processes_then_a_delta_then_a_single_publisher(sharded, tmp_path, cli_env, ok_cli, ws):
    store, out = tmp_path / "store", tmp_path / "replica"
    assert step_as_processes(cli_env, sharded[0], store, 4) == 0
    r = repo(store)
    m0 = r.manifest(0)
    assert m0.keyframe and [f.path for f in m0.files] == sorted(ws.content(sharded[0]))
    ok_cli("pull", "--store", f"file://{store}", out)
    ws.assert_replica(out, sharded[0])

    before = chunk_bytes(store)
    assert step_as_processes(cli_env, sharded[1], store, 4) == 1
    m1 = r.manifest(1)
    assert (m1.parent, m1.keyframe, m1.chain_length) == (0, False, 1)
    uploaded = chunk_bytes(store) - before
    assert 0 < uploaded < folder_bytes(sharded[1]) / 10, (uploaded, folder_bytes(sharded[1]))
    assert m1.stats["uploaded_bytes"] == uploaded
    ok_cli("pull", "--store", f"file://{store}", out)  # an incremental pull of a merged delta
    ws.assert_replica(out, sharded[1])

    # a single publisher continues the chain (its base: a pull of the merged version)
    assert ok_cli("publish", sharded[2], "--store", f"file://{store}", "--no-cache").split()[-1] == "2"
    assert repo(store).manifest(2).parent == 1 and not repo(store).manifest(2).keyframe
    # and ranks again on top of it, their bases brought forward from their caches
    res = publish_ranks(sharded[3], store, 4, cache_dir=None)
    assert {p for x in res for p in x.files} == set(ws.content(sharded[3]))
    assert commit_parts(repo(store), 3, 4, timeout=5).parent == 2
    for v in (2, 3):
        ok_cli("pull", "--store", f"file://{store}", "--version", v, out)
        ws.assert_replica(out, sharded[v])
    ok_cli("verify", "--store", f"file://{store}", out)


def test_a_merged_version_encodes_every_segment_as_the_single_publisher_does(sharded, tmp_path):
    """Same parent bytes, same codec choices: the merged manifest's files equal a single
    publisher's but for where the payloads lie (chunk index, offset)."""
    single, multi = tmp_path / "single", tmp_path / "multi"
    for v in (0, 1):
        weightsync.publish(sharded[v], repo(single))
        publish_ranks(sharded[v], multi, 3, cache_dir=tmp_path / "cache" / str(v))
        commit_parts(repo(multi), v, 3, timeout=5)

    def shape(m):
        return [
            (
                f.path,
                f.size,
                f.xxh3,
                [
                    (s.key, s.codec, s.xxh3, s.changed, s.payload and (s.payload.size, s.payload.xxh3))
                    for s in f.segments
                ],
            )
            for f in m.files
        ]

    for v in (0, 1):
        a, b = repo(single).manifest(v), repo(multi).manifest(v)
        assert shape(a) == shape(b)
        assert (a.parent, a.keyframe, a.chain_length) == (b.parent, b.keyframe, b.chain_length)
        assert a.stats["changed"] == b.stats["changed"] and a.stats["elements"] == b.stats["elements"]
        assert sorted(json.loads((multi / version_key(v)).read_bytes())) == sorted(
            json.loads((single / version_key(v)).read_bytes())
        )


def test_ranks_with_their_own_folders_and_explicit_files(sharded, tmp_path, ws):
    """Rank 1 holds only its two shards, rank 0 the rest; keyframes alternate with deltas."""
    store = tmp_path / "store"
    cfg = PublishConfig(keyframe_interval=2)
    for v, ckpt in enumerate(sharded[:3]):
        names = sorted(ws.content(ckpt))
        mine = [n for n in names if n.endswith(("3-of-00004.safetensors", "4-of-00004.safetensors"))]
        folders = {0: tmp_path / f"r0-{v}", 1: tmp_path / f"r1-{v}"}
        for rank, wanted in ((0, sorted(set(names) - set(mine))), (1, mine)):
            folders[rank].mkdir()
            for n in wanted:
                shutil.copy(ckpt / n, folders[rank] / n)
            res = publish_part(
                folders[rank], repo(store), rank, 2, files=wanted, config=cfg, cache_dir=tmp_path / f"cache{rank}"
            )
            assert res.files == wanted and res.keyframe == (v % 2 == 0)
        assert commit_parts(repo(store), v, 2, timeout=5).version == v
        weightsync.pull(repo(store), tmp_path / "out", v)
        ws.assert_replica(tmp_path / "out", ckpt)
    assert [repo(store).manifest(v).keyframe for v in range(3)] == [True, False, True]


# --- failures ------------------------------------------------------------------------------------------
def test_a_version_missing_a_part_is_never_committed(sharded, tmp_path, run_cli, ws):
    store = tmp_path / "store"
    publish_ranks(sharded[0], store, 2)
    commit_parts(repo(store), 0, 2, timeout=5)
    for r in (0, 1, 3):
        publish_part(sharded[1], repo(store), r, 4)
    head = (store / HEAD_KEY).read_bytes()
    with pytest.raises(VersionError, match=r"3 of 4 parts stored after 0.2s \(missing rank 2\); nothing committed"):
        commit_parts(repo(store), 1, 4, timeout=0.2)
    assert not list((store / parts_prefix(1)).glob("refused*"))  # rank 2 run again may still bring its part
    rc, out, err = run_cli("commit-parts", "--store", f"file://{store}", "--version", 1, "--world", 4, "--timeout", 0.1)
    assert rc == 1 and out == "" and "missing rank 2" in ws.error_line(err)
    assert (store / HEAD_KEY).read_bytes() == head and not (store / version_key(1)).exists()
    assert repo(store).versions() == [0]


def test_a_version_without_a_file_of_the_head_is_committed_only_when_allowed(sharded, tmp_path, run_cli, ws):
    """Rank 1's explicit --files list forgets a shard: the committer refuses (the parts stay, the
    head does not move); --allow-removed-files commits the smaller checkpoint on purpose."""
    store = tmp_path / "store"
    publish_ranks(sharded[0], store, 2)
    commit_parts(repo(store), 0, 2, timeout=5)
    names = sorted(ws.content(sharded[1]))
    shards = [n for n in names if n.endswith(".safetensors")]
    publish_part(sharded[1], repo(store), 0, 2, files=sorted(set(names) - set(shards)))
    publish_part(sharded[1], repo(store), 1, 2, files=shards[:-1])
    head = (store / HEAD_KEY).read_bytes()
    url = f"file://{store}"
    rc, out, err = run_cli("commit-parts", "--store", url, "--version", 1, "--world", 2, "--timeout", 5)
    assert rc == 1 and out == "" and f"no rank published {shards[-1]} of version 0" in ws.error_line(err)
    assert (store / HEAD_KEY).read_bytes() == head and repo(store).versions() == [0]
    rc, out, err = run_cli(
        "commit-parts", "--store", url, "--version", 1, "--world", 2, "--timeout", 5, "--allow-removed-files"
    )
    assert rc == 0 and out.strip() == "1"
    assert shards[-1] not in {f.path for f in repo(store).manifest(1).files}
    # a second committer (a re-run, or one that lost the race) finds it committed, with or without the flag
    for extra in ([], ["--allow-removed-files"]):
        rc, out, err = run_cli("commit-parts", "--store", url, "--version", 1, "--world", 2, "--timeout", 5, *extra)
        assert rc == 0 and out.strip() == "1" and "was already committed" in err, err


def test_files_repeated_on_the_command_line_add_up(sharded, tmp_path, run_cli, ws):
    """``--files A --files B`` kept only B (the last flag replaced the list): the first version
    committed without A and every command said 0. Each flag adds its paths."""
    store, names = tmp_path / "store", sorted(ws.content(sharded[0]))
    url = f"file://{store}"
    rank0 = ["--files", *names[:1], "--files", *names[1:3]]  # two flags: three paths
    for rank, files in ((0, rank0), (1, ["--files", *names[3:]])):
        rc, _, err = run_cli("publish-part", sharded[0], "--store", url, "--rank", rank, "--world", 2, *files)
        assert rc == 0, err
    assert sorted(f.path for f in stored_part(store, 0, 0, 2).files) == names[:3]
    rc, out, err = run_cli("commit-parts", "--store", url, "--version", 0, "--world", 2, "--timeout", 5)
    assert rc == 0 and sorted(f.path for f in repo(store).manifest(0).files) == names, err


def test_a_part_built_on_a_stale_parent_is_refused(sharded, tmp_path):
    store = tmp_path / "store"
    publish_ranks(sharded[0], store, 2)
    commit_parts(repo(store), 0, 2, timeout=5)
    publish_ranks(sharded[1], store, 2, version=5)  # parts of version 5 on parent 0
    weightsync.publish(sharded[2], repo(store))  # the head moves to 1 meanwhile
    with pytest.raises(VersionError, match="built on version 0 but the head is 1: a stale parent"):
        commit_parts(repo(store), 5, 2, timeout=5)
    assert repo(store).head_version() == 1 and not (store / version_key(5)).exists()
    # stored for the ranks that wait on the commit, naming their parts: they stop with its reason
    p0, p1 = stored_part(store, 5, 0, 2), stored_part(store, 5, 1, 2)
    assert "built on version 0 but the head is 1" in read_refusal(repo(store), p0)
    doc = json.loads((store / refused_key(5, 2)).read_bytes())
    assert (doc["format"], doc["version"], doc["world"], sorted(doc["parts"])) == (
        "weightsync.refused",
        5,
        2,
        ["0", "1"],
    )
    assert read_refusal(repo(store), p1) == read_refusal(repo(store), p0)
    assert read_refusal(repo(store), dataclasses.replace(p1, files=p0.files)) is None  # a part it did not refuse
    # a committer told the wrong world reads no part of its own: it refuses and stores nothing
    with pytest.raises(VersionError, match="a part for a world of 2, not 3"):
        commit_parts(repo(store), 5, 3, timeout=5)
    assert sorted(p.name for p in (store / parts_prefix(5)).iterdir()) == [
        "00000-of-00002.json",
        "00001-of-00002.json",
        "refused-of-00002.json",
    ]
    (store / refused_key(5, 2)).write_bytes(b"{torn")
    assert read_refusal(repo(store), p0) is None  # names no part

    # parts of version 2 on parent 1, but a single publisher takes version 2 first
    publish_ranks(sharded[3], store, 2)
    weightsync.publish(sharded[4], repo(store))
    with pytest.raises(VersionError, match="already exists .* not merged from its parts|differs from its parts"):
        commit_parts(repo(store), 2, 2, timeout=5)
    assert not (store / refused_key(2, 2)).exists()  # committed meanwhile: nothing to refuse

    # parts of version 3, and a manifest of 3 left above the head (a publisher that died before HEAD):
    # the store refuses the commit, not the parts (gc removes that manifest; the same parts commit then)
    publish_ranks(sharded[4], store, 2)
    shutil.copy(store / version_key(2), store / version_key(3))
    with pytest.raises(VersionError, match="already exists"):
        commit_parts(repo(store), 3, 2, timeout=5)
    assert not (store / refused_key(3, 2)).exists()


def test_a_rank_whose_part_came_after_the_refusal_stops_waiting_too(sharded, tmp_path):
    """A one-shot committer refused version 5 from ranks 0 and 1 (a stale parent) before rank 2's
    part arrived: rank 2's part cannot be committed with theirs either, so the refusal holds for it
    while the part it names is still stored as named."""
    store = tmp_path / "store"
    publish_ranks(sharded[0], store, 3)
    commit_parts(repo(store), 0, 3, timeout=5)
    for r in (0, 1):
        publish_part(sharded[1], repo(store), r, 3, version=5)
    weightsync.publish(sharded[2], repo(store))  # the head moves to 1
    with pytest.raises(VersionError, match="a stale parent"):
        commit_parts(repo(store), 5, 3, timeout=5)
    publish_part(sharded[1], repo(store), 2, 3, version=5)  # built on the head, 1
    late = stored_part(store, 5, 2, 3)
    reason = read_refusal(repo(store), late)
    assert "a stale parent" in reason and "which rank 2's cannot be committed without" in reason
    assert "rank 1's cannot" not in read_refusal(repo(store), stored_part(store, 5, 1, 3))
    key, p0 = store / refused_key(5, 3), store / part_key(5, 0, 3)
    doc = json.loads(key.read_bytes())
    for changed in ({"unnamed_ranks": False}, {"unnamed_ranks": None}, {"parts": {"99999999": "x", "x": "y"}}):
        key.write_text(json.dumps({**doc, **changed}))  # about a key beside the parts, from before, no rank
        assert read_refusal(repo(store), late) is None, changed
    key.write_text(json.dumps({**doc, "parts": {"1" * 5000: "x", **doc["parts"]}}))  # a rank int() refuses
    assert read_refusal(repo(store), late) == reason
    key.write_text(json.dumps(doc))
    # the lowest part it names stored otherwise (gone, then written again), or gone: nothing about rank 2
    good = p0.read_bytes()
    p0.write_bytes(part_to_json(dataclasses.replace(part_from_json(good, "p0"), parent=1)))
    assert read_refusal(repo(store), late) is None
    p0.write_bytes(good)
    assert read_refusal(repo(store), late) == reason
    p0.unlink()
    assert read_refusal(repo(store), late) is None


def test_a_refusal_of_a_key_beside_the_parts_holds_only_for_the_ranks_it_names(sharded, tmp_path):
    """A part for another world in version 0's folder: the committer refuses, naming rank 0's part.
    Rank 1's part comes after; once the stray key is deleted the version commits, so the refusal
    said nothing about rank 1."""
    store = tmp_path / "store"
    publish_part(sharded[0], repo(store), 0, 2)
    publish_part(sharded[0], repo(store), 0, 3)
    with pytest.raises(VersionError, match="a part for a world of 3, not 2"):
        commit_parts(repo(store), 0, 2, timeout=5)
    assert json.loads((store / refused_key(0, 2)).read_bytes())["unnamed_ranks"] is False
    publish_part(sharded[0], repo(store), 1, 2)
    assert read_refusal(repo(store), stored_part(store, 0, 1, 2)) is None
    assert "a part for a world of 3" in read_refusal(repo(store), stored_part(store, 0, 0, 2))
    (store / part_key(0, 0, 3)).unlink()
    assert commit_parts(repo(store), 0, 2, timeout=5).version == 0


def test_a_stale_part_and_a_stray_key_in_one_look_are_refused_for_the_stale_part(sharded, tmp_path):
    store = tmp_path / "store"
    publish_ranks(sharded[0], store, 2)
    commit_parts(repo(store), 0, 2, timeout=5)
    publish_part(sharded[1], repo(store), 0, 2, version=5)  # on parent 0
    weightsync.publish(sharded[2], repo(store))  # the head moves to 1
    publish_part(sharded[1], repo(store), 0, 3, version=5)  # a key of another world beside it
    with pytest.raises(VersionError, match="a stale parent"):
        commit_parts(repo(store), 5, 2, timeout=5)
    doc = json.loads((store / refused_key(5, 2)).read_bytes())
    assert doc["unnamed_ranks"] is True and "a stale parent" in doc["reason"]


class _Racing(FileStore):
    """A file store that runs ``hook(key)`` once, before the first call of ``op`` on a key that
    ``match`` accepts: another process acting between two steps of gc or of a committer."""

    def __init__(self, root, op, match, hook):
        super().__init__(root)
        self._op, self._match, self._hook = op, match, hook

    def _maybe(self, op, key):
        if op == self._op and self._hook is not None and self._match(key):
            hook, self._hook = self._hook, None
            hook(key)

    def put(self, key, data, **kw):
        self._maybe("put", key)
        return super().put(key, data, **kw)

    def delete(self, key):
        self._maybe("delete", key)
        return super().delete(key)


def test_a_refusal_stored_while_gc_deletes_its_parts_goes_too(sharded, tmp_path):
    """gc listed version 1's old parts; a committer stores its refusal of them before gc deletes
    them. Left behind, it would name the parts a job writes again with the same digests, and stop
    all their ranks: gc deletes the version's refusal again after the parts."""
    store = tmp_path / "store"
    publish_ranks(sharded[0], store, 2)
    commit_parts(repo(store), 0, 2, timeout=5)
    for r in (0, 1):
        publish_part(sharded[1], repo(store), r, 2, version=1, files=[])
    with pytest.raises(VersionError, match="no rank published"):
        commit_parts(repo(store), 1, 2, timeout=5)
    refusal = (store / refused_key(1, 2)).read_bytes()
    (store / refused_key(1, 2)).unlink()  # not there when gc lists the keys
    age(store, "parts")

    def committer(_key):  # the committer's put, between gc's listing and its deletes
        (store / refused_key(1, 2)).write_bytes(refusal)

    racing = _Racing(store, "delete", lambda k: k == part_key(1, 0, 2), committer)
    res = gc(weightsync.Repo(racing), GcConfig(keep=1, grace_seconds=60))
    assert res.deleted_parts == 4 and not (store / PARTS_PREFIX).exists()


def test_a_committer_that_finds_the_parts_it_refused_collected_deletes_its_refusal(sharded, tmp_path):
    store = tmp_path / "store"
    publish_ranks(sharded[0], store, 2)
    commit_parts(repo(store), 0, 2, timeout=5)
    for r in (0, 1):
        publish_part(sharded[1], repo(store), r, 2, version=1, files=[])

    def gc_meanwhile(_key):
        for r in (0, 1):
            (store / part_key(1, r, 2)).unlink()

    racing = _Racing(store, "put", lambda k: k == refused_key(1, 2), gc_meanwhile)
    with pytest.raises(VersionError, match="no rank published"):
        commit_parts(weightsync.Repo(racing), 1, 2, timeout=5)
    assert not (store / refused_key(1, 2)).exists()


def test_a_committer_that_read_the_head_before_it_moved_looks_again_rather_than_refuse(sharded, tmp_path):
    """Version 2's parts are built on version 1, committed after this committer first read the head
    (0): they are newer than what it saw, not stale; it reads the head again and commits them."""
    store = tmp_path / "store"
    publish_ranks(sharded[0], store, 2)
    commit_parts(repo(store), 0, 2, timeout=5)
    r = repo(store)
    before = r.head()
    weightsync.publish(sharded[1], repo(store))  # version 1, after the committer's first look
    publish_ranks(sharded[2], store, 2, version=2)
    real, seen = r.head, []
    r.head = lambda: seen.append(1) or (before if len(seen) == 1 else real())
    assert commit_parts(r, 2, 2, timeout=5).version == 2 and len(seen) > 1
    assert not (store / refused_key(2, 2)).exists()


def test_a_rank_refuses_to_write_its_part_when_the_head_moves_while_it_encodes(sharded, tmp_path):
    store = tmp_path / "store"
    weightsync.publish(sharded[0], repo(store))
    moved = []

    def progress(done, total):
        if not moved:
            moved.append(weightsync.publish(sharded[1], repo(store)).version)

    with pytest.raises(
        VersionError, match="moved from 0 to 1 while rank 0 encoded version 1; its part was not written"
    ):
        publish_part(sharded[2], repo(store), 0, 2, observer=Callbacks(progress))
    assert moved == [1] and not (store / PARTS_PREFIX).exists()


class _NoParts(FileStore):
    """A rank that dies after uploading its chunks, before its part."""

    def put(self, key, data, *, mode="overwrite"):
        if key.startswith(PARTS_PREFIX):
            raise StoreError(f"injected crash before {key}", key=key)
        super().put(key, data, mode=mode)


def test_a_rank_that_died_before_its_part_completes_the_version_when_run_again(sharded, tmp_path, ws):
    store = tmp_path / "store"
    publish_ranks(sharded[0], store, 3)
    commit_parts(repo(store), 0, 3, timeout=5)
    publish_part(sharded[1], repo(store), 0, 3)
    publish_part(sharded[1], repo(store), 2, 3)
    before = chunk_bytes(store)
    with pytest.raises(StoreError, match="injected crash"):
        publish_part(sharded[1], weightsync.Repo(_NoParts(store)), 1, 3)
    assert chunk_bytes(store) > before  # its chunks are up, its part is not
    with pytest.raises(VersionError, match="missing rank 1"):
        commit_parts(repo(store), 1, 3, timeout=0.1)

    again = publish_part(sharded[1], repo(store), 1, 3)
    assert (again.version, again.uploaded_bytes, again.existed) == (1, 0, False)  # every chunk already there
    assert commit_parts(repo(store), 1, 3, timeout=5).version == 1
    weightsync.pull(repo(store), tmp_path / "out", 1)
    ws.assert_replica(tmp_path / "out", sharded[1])


def test_a_part_written_twice_is_done_and_a_different_one_is_refused(sharded, tmp_path):
    store = tmp_path / "store"
    first = publish_part(sharded[0], repo(store), 1, 2)
    key = store / part_key(0, 1, 2)
    stored = key.read_bytes()
    again = publish_part(sharded[0], repo(store), 1, 2)  # a retry, or the rank run again
    assert again.existed and not first.existed and key.read_bytes() == stored
    with pytest.raises(VersionError, match="already holds a different part .* not committed yet, or was abandoned"):
        publish_part(sharded[1], repo(store), 1, 2)
    assert key.read_bytes() == stored
    assert publish_part(sharded[1], repo(store), 1, 2, version=7).version == 7  # the way out


def test_racing_committers_commit_once(sharded, tmp_path, ws):
    store = tmp_path / "store"
    publish_ranks(sharded[0], store, 4)
    results, errors = [], []
    go = threading.Barrier(3)

    def committer():
        go.wait()
        try:
            results.append(commit_parts(repo(store), 0, 4, timeout=10))
        except VersionError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=committer) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and len(results) == 3 and {r.version for r in results} == {0}
    assert repo(store).versions() == [0]

    # in turn: the late committer sees the version committed from the same parts
    publish_ranks(sharded[1], store, 4)
    assert not commit_parts(repo(store), 1, 4, timeout=5).already
    manifest = (store / version_key(1)).read_bytes()
    late = commit_parts(repo(store), 1, 4, timeout=5)
    assert late.already and late.version == 1 and (store / version_key(1)).read_bytes() == manifest
    # and once gc collected the parts, a clear error instead of a guess
    gc(repo(store), GcConfig(keep=2, grace_seconds=0))
    with pytest.raises(VersionError, match="already committed .* parts are not all stored"):
        commit_parts(repo(store), 1, 4, timeout=5)
    weightsync.pull(repo(store), tmp_path / "out", 1)
    ws.assert_replica(tmp_path / "out", sharded[1])


def test_a_committer_that_loses_the_head_race_mid_commit_succeeds(sharded, tmp_path):
    """Committer A stores the manifest and dies before moving the head; B commits the same version."""
    store = tmp_path / "store"
    publish_ranks(sharded[0], store, 2)

    class DiesBeforeHead(FileStore):
        def put_if_match(self, key, data, etag):  # as a timeout (it may have landed: the manifest stays)
            err = StoreError("injected crash before HEAD", key=key)
            err.retryable = True
            raise err

    with pytest.raises(StoreError, match="before HEAD"):
        commit_parts(weightsync.Repo(DiesBeforeHead(store)), 0, 2, timeout=5)
    assert (store / version_key(0)).exists() and not (store / HEAD_KEY).exists()
    res = commit_parts(repo(store), 0, 2, timeout=5)
    assert res.version == 0 and repo(store).versions() == [0]


# --- gc ---------------------------------------------------------------------------------------------------
def test_gc_removes_merged_and_abandoned_parts_and_keeps_pending_ones_with_their_chunks(sharded, tmp_path, ok_cli, ws):
    store = tmp_path / "store"
    publish_ranks(sharded[0], store, 2)
    commit_parts(repo(store), 0, 2, timeout=5)
    publish_ranks(sharded[1], store, 2)  # version 1: pending
    age(store, "chunks")  # the pending parts' chunks look old, the parts themselves do not
    res = json.loads(ok_cli("gc", "--store", f"file://{store}", "--keep", 1, "--grace-seconds", 60))
    assert (res["deleted_parts"], res["pending_parts"], res["deleted_chunks"]) == (2, 2, 0)
    assert not (store / "parts" / f"{0:020d}").exists()  # merged: gone, folder and all
    assert commit_parts(repo(store), 1, 2, timeout=5).version == 1  # its chunks survived gc
    weightsync.pull(repo(store), tmp_path / "out", 1)
    ws.assert_replica(tmp_path / "out", sharded[1])

    # version 2: rank 1 never publishes; young parts stay, old ones go with their chunks
    publish_part(sharded[2], repo(store), 0, 2)
    res = gc(repo(store), GcConfig(keep=1, grace_seconds=60))
    assert (res.deleted_parts, res.pending_parts) == (2, 1)  # version 1's merged parts; version 2's kept
    unreferenced = {k for k in (p.relative_to(store).as_posix() for p in (store / "chunks").rglob("*") if p.is_file())}
    unreferenced -= {chunk_key(c.id) for v in repo(store).versions() for c in repo(store).manifest(v).chunks}
    assert unreferenced  # version 2's
    age(store, "chunks")
    age(store, "parts")
    dry = gc(repo(store), GcConfig(keep=1, grace_seconds=60, dry_run=True))
    assert dry.deleted_parts == 1 and (store / part_key(2, 0, 2)).exists()
    res = gc(repo(store), GcConfig(keep=1, grace_seconds=60))
    assert res.deleted_parts == 1 and not any((store / PARTS_PREFIX).rglob("*.json"))
    assert not any((store / k).exists() for k in unreferenced)
    weightsync.pull(repo(store), tmp_path / "out", 1)  # the head is intact
    ws.assert_replica(tmp_path / "out", sharded[1])


def test_gc_deletes_a_refusal_with_the_parts_it_refused(sharded, tmp_path):
    store = tmp_path / "store"
    publish_ranks(sharded[0], store, 2)
    commit_parts(repo(store), 0, 2, timeout=5)
    publish_part(sharded[1], repo(store), 0, 2, files=[])  # no rank publishes any file of the head
    publish_part(sharded[1], repo(store), 1, 2, files=[])
    with pytest.raises(VersionError, match="no rank published"):
        commit_parts(repo(store), 1, 2, timeout=5)
    assert (store / refused_key(1, 2)).exists()
    res = gc(repo(store), GcConfig(keep=1, grace_seconds=60))
    assert (res.deleted_parts, res.pending_parts) == (2, 3)  # version 0's merged parts; version 1's young ones
    age(store, "parts")
    with pytest.raises(VersionError, match="no rank published"):  # a committer that retries: a young refusal
        commit_parts(repo(store), 1, 2, timeout=5)
    res = gc(repo(store), GcConfig(keep=1, grace_seconds=60))
    assert (res.deleted_parts, res.pending_parts) == (3, 0) and not (store / PARTS_PREFIX).exists()
    publish_ranks(sharded[1], store, 2)  # version 1 can be published again, and committed
    assert commit_parts(repo(store), 1, 2, timeout=5).version == 1
    assert not (store / refused_key(1, 2)).exists()


def test_gc_keeps_every_part_of_a_version_while_one_is_young(sharded, tmp_path):
    store = tmp_path / "store"
    publish_part(sharded[0], repo(store), 0, 3)
    publish_part(sharded[0], repo(store), 1, 3)
    age(store, "parts")
    age(store, "chunks")
    publish_part(sharded[0], repo(store), 2, 3)  # a late rank: a young part
    res = gc(repo(store), GcConfig(keep=1, grace_seconds=60))
    assert (res.deleted_parts, res.pending_parts, res.deleted_chunks) == (0, 3, 0)
    assert commit_parts(repo(store), 0, 3, timeout=5).version == 0


# --- bad input -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "args, rc, message",
    [
        (["publish-part", "{ckpt}", "--rank", "4", "--world", "4"], 2, "rank must be in 0..3"),
        (["publish-part", "{ckpt}", "--rank", "0", "--world", "0"], 2, "world size must be in"),
        (
            ["publish-part", "{ckpt}", "--rank", "0", "--world", "2", "--files", "missing.bin"],
            1,
            "no file 'missing.bin'",
        ),
        (["publish-part", "{ckpt}", "--rank", "0", "--world", "2", "--files", "../x"], 2, "unsafe file path"),
        (
            ["publish-part", "{ckpt}", "--rank", "0", "--world", "2", "--version", "latest"],
            2,
            "argument --version: wants a version number >= 0, not 'latest'",
        ),
        (["publish-part", "{tmp}/nowhere", "--rank", "0", "--world", "2"], 1, "checkpoint directory not found"),
        (["commit-parts", "--version", "0", "--world", "0"], 2, "world size must be in"),
        (["commit-parts", "--version", "0", "--world", "2", "--timeout", "-1"], 2, "--timeout must be >= 0"),
        (["commit-parts", "--version", "1", "--world", "2", "--timeout", "0"], 1, "0 of 2 parts stored after 0s"),
        (["commit-parts", "--version", "0", "--world", "2", "--timeout", "0"], 1, "parts are not all stored any more"),
    ],
)
def test_bad_input_gives_one_line_and_changes_nothing(sharded, tmp_path, run_cli, ws, args, rc, message):
    store = tmp_path / "store"
    weightsync.publish(sharded[0], repo(store))
    before = ws.snapshot(store)
    args = [a.format(ckpt=sharded[1], tmp=tmp_path) for a in args]
    got, out, err = run_cli(args[0], "--store", f"file://{store}", *args[1:])
    assert (got, out) == (rc, "")
    if message.startswith("argument "):  # argparse's: the usage, then the error
        assert err.splitlines()[-1] == f"weightsync {args[0]}: error: {message}"
    else:
        assert message in ws.error_line(err)
    assert ws.snapshot(store) == before


def test_a_rank_whose_chunks_gc_took_before_its_part_writes_no_part(sharded, tmp_path, monkeypatch):
    """Like a single publisher before its commit: chunks stored earlier than ``refresh_after`` are
    touched again before the part is written, and one already collected stops the rank."""
    from weightsync.sync.transfer import Uploader

    store = tmp_path / "store"
    publish_ranks(sharded[0], store, 2)
    commit_parts(repo(store), 0, 2)
    real_join = Uploader.join

    def join_then_collected(self):
        real_join(self)
        for cid in list(self.stored_at):
            FileStore(store).delete(chunk_key(cid))

    monkeypatch.setattr(Uploader, "join", join_then_collected)
    with pytest.raises(VersionError, match="deleted before its commit"):
        publish_part(sharded[1], repo(store), 0, 2, config=PublishConfig(refresh_after=0))
    assert list(FileStore(store).list(parts_prefix(1))) == []


# --- publisher daemons in rank mode ----------------------------------------------------------------------
def test_rank_publisher_daemons_publish_parts_and_one_commits_each_version(sharded, tmp_path, daemons, ws):  # noqa: F811
    """Three publisher daemons watch one folder holding three checkpoints with --rank R --world 3;
    rank 2 commits. Rank 0 starts late, so the committer's first waits time out and are retried
    without encoding again; no rank goes on to the next checkpoint before the commit of the last;
    every version equals its checkpoint byte for byte."""
    store, watch = tmp_path / "store", tmp_path / "watch"
    url = f"file://{store}"
    for v, ckpt in enumerate(sharded[:3]):
        shutil.copytree(ckpt, watch / f"step_{v:06d}")
        (watch / f"step_{v:06d}" / "COMPLETE").write_text("")

    def start(r):
        extra = ["--commit", "--commit-timeout", 1] if r == 2 else []
        return daemons("publisher", ["--store", url, "--watch", watch, "--rank", r, "--world", 3, *extra])

    pubs = {r: start(r) for r in (1, 2)}
    wait_for(lambda: "missing rank 0" in pubs[2].log(), 30, "the committer to time out waiting for rank 0")
    # rank 1's part can be in the store (the committer saw it) before its daemon says so
    wait_for(lambda: pubs[1].status()["part_stored"] == 0, 30, "rank 1 to have stored its part of version 0")
    assert repo(store).head_version() is None
    pubs[0] = start(0)
    wait_for(lambda: repo(store).head_version() == 2, 90, "version 2\n" + "\n".join(p.log() for p in pubs.values()))
    for v, ckpt in enumerate(sharded[:3]):
        weightsync.pull(repo(store), tmp_path / "out", v)
        ws.assert_replica(tmp_path / "out", ckpt)
        assert repo(store).manifest(v).parent == (v - 1 if v else None)
    owned = {r: set(assign_files([f.path for f in repo(store).manifest(2).files], r, 3)) for r in range(3)}
    for r, p in pubs.items():
        for v in range(3):
            assert p.log().count(f"published part {r} of 3 of version {v}") == 1, (r, v)
        s = wait_for(
            lambda p=p: (s := p.status())["head_version"] == 2 and s["part_stored"] is None and s, 20, "status"
        )
        assert s["rank"] == r and s["world"] == 3 and set(s["last_publish"]["files"]) == owned[r]
    assert pubs[2].log().count("committed version") == 3


def test_a_rank_publisher_waits_for_the_commit_keeps_its_part_over_a_restart_and_refuses_bad_options(
    sharded,
    tmp_path,
    daemons,  # noqa: F811  (the fixture imported above)
    run_cli,
    ws,
):
    store, watch = tmp_path / "store", tmp_path / "watch"
    for v in (0, 1):
        shutil.copytree(sharded[v], watch / f"step_{v:06d}")
        (watch / f"step_{v:06d}" / "COMPLETE").write_text("")
    args = ["--store", f"file://{store}", "--watch", watch, "--rank", 1, "--world", 2]
    pub = daemons("publisher", args)
    s = wait_for(lambda: (s := pub.status())["part_stored"] == 0 and s["state"] == "waiting" and s, 30, "the part")
    assert "part 1 of version 0 stored; waiting for its commit" in s["reason"] and repo(store).head_version() is None
    code, body, _ = http("POST", pub.url + "/v1/publish", {"path": str(watch / "step_000001")})
    assert code == 400 and "rank mode" in body["error"]
    assert pub.stop() == 0
    pub.start()  # the part is in the store: found, not encoded again
    wait_for(lambda: pub.status()["part_stored"] == 0, 20, "the stored part found")
    assert (
        "part 1 of version 0 is already stored" in pub.log()
        and pub.log().count("published part 1 of 2 of version 0") == 1
    )
    publish_part(sharded[0], repo(store), 0, 2)
    commit_parts(repo(store), 0, 2, timeout=5)  # another process commits: the daemon goes on to version 1
    wait_for(lambda: pub.status()["part_stored"] == 1, 30, "the part of version 1")
    for extra, message in (
        (["--rank", 2, "--world", 2], "rank must be in 0..1"),
        (["--world", 2], "need --rank"),
        (["--own-files"], "need --rank"),
        (["--world", 0], "world size must be in"),
        (["--rank", 0, "--world", 1], "needs --commit"),
        (["--commit"], "need --rank"),
        (["--rank", 0, "--world", 2, "--commit-timeout", 5], "--commit-timeout needs --commit"),
    ):
        rc, out, err = run_cli("publisher", "--store", f"file://{store}", "--watch", watch, *extra)
        assert rc == 2 and message in ws.error_line(err), (extra, err)


def test_a_waiting_rank_publisher_says_why_its_committer_refused_the_version(
    sharded,
    tmp_path,
    daemons,  # noqa: F811  (the fixture imported above)
):
    store, watch = tmp_path / "store", tmp_path / "watch"
    shutil.copytree(sharded[0], watch / "step_000000")
    (watch / "step_000000" / "COMPLETE").write_text("")
    args = ["--store", f"file://{store}", "--watch", watch, "--rank", 1, "--world", 2, "--poll-interval", 0.2]
    pub = daemons("publisher", args)
    wait_for(lambda: pub.status()["part_stored"] == 0, 30, "the part")
    publish_part(sharded[0], repo(store), 0, 3)  # a part of the same version for a world of 3
    with pytest.raises(VersionError, match="a part for a world of 3, not 2"):
        commit_parts(repo(store), 0, 2, timeout=5)
    s = wait_for(lambda: "refused" in (s := pub.status())["reason"] and s, 20, "the refusal in the status")
    assert s["state"] == "waiting" and s["part_stored"] == 0
    assert "the committer refused version 0: " in s["reason"] and "a part for a world of 3" in s["reason"]
    time.sleep(1)  # several more polls: logged once
    assert pub.log().count("the committer refused version 0") == 1, pub.log()
    doc = json.loads((store / refused_key(0, 2)).read_bytes())  # a retrying committer refuses for another reason
    (store / refused_key(0, 2)).write_text(json.dumps({**doc, "reason": "another reason"}))
    wait_for(lambda: "another reason" in pub.status()["reason"], 20, "the new reason in the status")
    time.sleep(1)
    assert pub.log().count("the committer refused version 0") == 2, pub.log()
    assert pub.stop() == 0


def test_rank_publisher_daemons_with_folders_of_their_own(sharded, tmp_path, daemons, ws):  # noqa: F811
    """--own-files: rank 1's folders hold two shards, rank 0's the rest; rank 1 commits."""
    store, url = tmp_path / "store", f"file://{tmp_path / 'store'}"
    watches = {r: tmp_path / f"watch{r}" for r in range(2)}
    pubs = [
        daemons(
            "publisher",
            [
                "--store",
                url,
                "--watch",
                watches[r],
                "--state-dir",
                tmp_path / f"state{r}",
                "--rank",
                r,
                "--world",
                2,
                "--own-files",
                *(["--commit"] if r == 1 else []),
            ],
        )
        for r in range(2)
    ]
    for v, ckpt in enumerate(sharded[:2]):
        names = sorted(ws.content(ckpt))
        mine = {1: [n for n in names if n.endswith(("3-of-00004.safetensors", "4-of-00004.safetensors"))]}
        mine[0] = sorted(set(names) - set(mine[1]))
        for r in range(2):
            folder = watches[r] / f"step_{v:06d}"
            folder.mkdir(parents=True)
            for n in mine[r]:
                shutil.copy(ckpt / n, folder / n)
            (folder / "COMPLETE").write_text("")
        wait_for(lambda: repo(store).head_version() == v, 60, f"version {v}\n" + "\n".join(p.log() for p in pubs))
        weightsync.pull(repo(store), tmp_path / "out", v)
        ws.assert_replica(tmp_path / "out", ckpt)
        assert sorted(pubs[1].status()["last_publish"]["files"]) == mine[1]


def test_a_rank_daemon_polls_the_store_jittered_and_less_often_in_a_large_job(tmp_path):
    """Every rank daemon of a job reads the head each poll (and a waiting one the refusal key): a
    rank's wait is drawn around ``--poll-interval``, stretched to ``world / 1000`` s (2,048 ranks
    polling every 2 s in step would ask 1,024 reads a second at once); a plain publisher keeps its
    interval."""
    import asyncio

    from prometheus_client import CollectorRegistry

    from weightsync.service.config import Identity, PublisherConfig, StoreConfig
    from weightsync.service.metrics import Metrics
    from weightsync.service.publisher import Publisher

    store, watch = f"file://{tmp_path / 'store'}", tmp_path / "watch"
    watch.mkdir()
    for rank, world, expect in ((None, 1, None), (0, 2, 2.0), (5, 4096, 4.096)):
        ranked = {} if rank is None else {"rank": rank, "world": world}
        cfg = PublisherConfig(StoreConfig(store), watch, tmp_path / "st", Identity("p"), poll_interval=2.0, **ranked)
        pub = Publisher(cfg, weightsync.open_repo(store), Metrics(CollectorRegistry(), "publisher"))

        async def idle(n: int, pub=pub) -> list[float]:
            pub._wake = asyncio.Event()
            return [await pub._iteration() for _ in range(n)]

        waits = asyncio.run(idle(40))
        assert pub.state == "idle", pub.reason
        if expect is None:
            assert set(waits) == {2.0}
        else:
            assert all(0.5 * expect <= w <= 1.5 * expect for w in waits) and len(set(waits)) == len(waits), waits
