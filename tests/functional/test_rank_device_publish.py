"""Rank publishers fed by device diffs (weightsync.torch.device.RankDeviceDiffPublisher) on file
stores: ranks as threads and as real processes, commits that fail, time out or lose to another
version, a rank restarted with an empty snapshot, two ranks given one number.

Every committed version is pulled and each rank's file compared byte for byte with a safetensors
dump of that rank's shard at that step, and tensor by tensor (integer views) with the trainer's
tensors. The bytes moved device -> host are checked against the changes from the committed
version: a rank whose part was not committed diffs against what the store holds, never against
its own uncommitted part."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from rank_device_worker import ints, shard
from safetensors.torch import load_file

import weightsync
from weightsync.codec import CodecConfig
from weightsync.errors import UsageError, VersionError
from weightsync.format.keys import part_key
from weightsync.format.manifest import head_to_json, part_from_json
from weightsync.sync.observer import Observer
from weightsync.sync.parts import commit_parts, publish_part
from weightsync.sync.publish import PublishConfig
from weightsync.torch.device import RankDeviceDiffPublisher, rank_filename
from weightsync.torch.state_dict import publish_state_dict, save_state_dict

WORKER = Path(__file__).resolve().parents[1] / "rank_device_worker.py"
CFG = PublishConfig(keyframe_interval=3)


def expected_d2h(prev: dict | None, sd: dict) -> int:
    """Bytes a device diff moves from ``prev`` to ``sd``: int32 positions and new values of the
    changed elements; whole tensors that are new, reshaped or retyped (or denser than that)."""
    total = 0
    for name, t in sd.items():
        p = None if prev is None else prev.get(name)
        if p is None or p.dtype != t.dtype or p.shape != t.shape:
            total += t.nbytes
        else:
            k = int((ints(p) != ints(t)).sum())
            total += min(k * (4 + t.element_size()), t.nbytes)
    return total


def check_version(store, version: int, steps: dict[int, int], tmp: Path, world: int) -> None:
    """Pull ``version``: rank r's file must be rank r's shard at ``steps[r]``, bit for bit."""
    out = tmp / f"pulled-{version}"
    weightsync.pull(store, out, version)
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == [
        rank_filename(r, world) for r in range(world)
    ]
    for r in range(world):
        sd, meta = shard(r, steps[r])
        ref = tmp / f"ref-{version}-{r}.safetensors"
        save_state_dict(sd, ref, meta)
        assert (out / rank_filename(r, world)).read_bytes() == ref.read_bytes(), (version, r)
        got = load_file(out / rank_filename(r, world))
        assert got.keys() == sd.keys()
        for name, t in sd.items():
            assert got[name].dtype == t.dtype and got[name].shape == t.shape
            assert torch.equal(ints(got[name]), ints(t)), (version, r, name)


def ranks(store, world: int, tmp: Path, config=CFG, timeout: float = 60.0, **kw) -> list[RankDeviceDiffPublisher]:
    return [
        RankDeviceDiffPublisher(
            store,
            rank=r,
            world=world,
            commit=r == 0,
            commit_timeout=timeout,
            poll=0.02,
            config=config,
            work_dir=tmp / "w",
            **kw,
        )
        for r in range(world)
    ]


def round_(pubs, step: int, version: int | None = None, **kw) -> list:
    """Every rank publishes its shard at ``step`` at once (threads); results or exceptions."""

    def one(pub):
        sd, meta = shard(pub.rank, step)
        try:
            return pub.publish(sd, step if version is None else version, meta, **kw)
        except Exception as exc:
            return exc

    with ThreadPoolExecutor(len(pubs)) as pool:
        return list(pool.map(one, pubs))


class Crash(Observer):
    """Cancels a publish before its part is written: a rank that dies mid-way."""

    def check(self) -> None:
        raise RuntimeError("rank crashed")


@pytest.mark.parametrize("entropy_coder", [True, False], ids=["ans", "sparse"])
def test_ranks_as_threads_publish_bit_exact_parts_equal_to_the_folder_path(tmp_path, entropy_coder):
    """Three ranks, six steps (keyframes at 0 and 3; a tensor added, reshaped, retyped and removed,
    metadata): every version bit-exact, only changes cross to the host, and each part equals the
    part `publish_part` makes from a folder holding the same file (same payloads and chunks)."""
    cfg = PublishConfig(codec=CodecConfig(entropy_coder=entropy_coder), keyframe_interval=3)
    store, world = tmp_path / "store", 3
    pubs = ranks(store, world, tmp_path, cfg)
    try:
        for step in range(6):
            res = round_(pubs, step)
            for r, x in enumerate(res):
                assert not isinstance(x, Exception), x
                assert (x.version, x.committed, x.keyframe, x.route) == (
                    step,
                    True,
                    step % 3 == 0,
                    "full" if step == 0 else "direct",
                )
                prev = None if step == 0 else shard(r, step - 1)[0]
                assert x.d2h_bytes == expected_d2h(prev, shard(r, step)[0])
                assert pubs[r].base_version == step
            assert sum(x.commit is not None for x in res) == 1 and res[0].commit.version == step
            check_version(store, step, dict.fromkeys(range(world), step), tmp_path, world)
            # the same files published from a checkpoint folder, on the same parent, give the same parts
            folder = tmp_path / f"ckpt-{step}"
            for r in range(world):
                sd, meta = shard(r, step)
                folder.mkdir(exist_ok=True)
                save_state_dict(sd, folder / rank_filename(r, world), meta)
                key = part_key(step, r, world)
                mine = part_from_json(weightsync.open_repo(store).store.get(key), key)
                twin = _twin_part(store, tmp_path / f"twin-{step}-{r}", folder, r, world, step, cfg)
                assert (mine.files, mine.chunks, mine.keyframe, mine.parent) == twin
    finally:
        for p in pubs:
            p.close()
    assert list((tmp_path / "w").iterdir()) == []  # closed: mirrors removed


def _twin_part(store: Path, copy: Path, folder: Path, rank: int, world: int, step: int, cfg):
    """``publish_part`` of ``folder``'s rank file on a copy of ``store`` as it was before ``step``."""
    shutil.copytree(store, copy)
    repo = weightsync.open_repo(copy)
    for w in range(world):  # back to the head before this step
        (copy / part_key(step, w, world)).unlink()
    (copy / "versions" / f"{step:020d}.json").unlink()
    head = copy / "HEAD"
    if step == 0:
        head.unlink()
    else:
        head.write_bytes(head_to_json(step - 1))
    r = publish_part(folder, repo, rank, world, files=[rank_filename(rank, world)], version=step, config=cfg)
    part = part_from_json(repo.store.get(part_key(step, rank, world)), "twin")
    shutil.rmtree(copy)
    assert r.version == step
    return part.files, part.chunks, part.keyframe, part.parent


def test_a_round_not_committed_leaves_every_rank_at_the_committed_version(tmp_path):
    """Rank 1 dies before its part at step 2 (a plain change: rank 0's mirror patched in place)
    and at step 3 (new, reshaped, retyped and removed tensors: mirrors rebuilt): rank 0's commit
    times out, and both ranks stay at version 1. Step 4 is published on version 1 with only the
    changes from it crossing to the host, and is bit-exact."""
    store, world = tmp_path / "store", 2
    pubs = ranks(store, world, tmp_path, timeout=1.0)
    try:
        for step in (0, 1):
            assert all(x.committed for x in round_(pubs, step))
        for step in (2, 3):
            sd0, meta0 = shard(0, step)
            sd1, meta1 = shard(1, step)
            with pytest.raises(RuntimeError, match="rank crashed"):
                pubs[1].publish(sd1, step, meta1, observer=Crash())
            with pytest.raises(VersionError, match=f"version {step}: 1 of 2 parts stored"):
                pubs[0].publish(sd0, step, meta0)
            assert [p.base_version for p in pubs] == [1, 1]
            assert weightsync.open_repo(store).head_version() == 1
        res = round_(pubs, 4)
        for r, x in enumerate(res):
            assert (x.version, x.parent, x.committed, x.route) == (4, 1, True, "direct")
            assert x.d2h_bytes == expected_d2h(shard(r, 1)[0], shard(r, 4)[0])
        check_version(store, 4, {0: 4, 1: 4}, tmp_path, world)
        check_version(store, 1, {0: 1, 1: 1}, tmp_path, world)
        assert [x.version for x in weightsync.versions(store)] == [0, 1, 4]
    finally:
        for p in pubs:
            p.close()


def test_late_commit_of_a_pending_part_is_taken_and_early_publish_waits_for_it(tmp_path):
    """wait=False: the parts are written and the next publish settles them. A version committed
    later by `commit-parts` (no rank commits) becomes the base: the next diff is from it."""
    store, world = tmp_path / "store", 2
    pubs = ranks(store, world, tmp_path, timeout=30.0)
    for p in pubs:
        p.committer = False
    try:
        for step in (0, 1):
            res = round_(pubs, step, wait=False)
            assert all(x.committed is None for x in res)
            assert [p.base_version for p in pubs] == [None if step == 0 else step - 1] * 2
            commit_parts(weightsync.open_repo(store), step, world, timeout=10)
        pubs[0].committer = True
        res = round_(pubs, 2)  # settles version 1 first: committed, so the base moves to it
        for r, x in enumerate(res):
            assert x.route == "direct" and x.d2h_bytes == expected_d2h(shard(r, 1)[0], shard(r, 2)[0])
        assert [p.base_version for p in pubs] == [2, 2]
        check_version(store, 2, {0: 2, 1: 2}, tmp_path, world)
    finally:
        for p in pubs:
            p.close()


def test_waiting_ranks_poll_with_a_generator_of_their_own(tmp_path):
    """The ranks' polls are jittered (`parts.rank_poll`) by a generator per publisher: a training
    that seeded `random` (often the same on every rank) gets the same sequence whether or not a
    rank waited, and the ranks do not poll in step."""
    store, world = tmp_path / "store", 2
    pubs = ranks(store, world, tmp_path, timeout=30.0)
    for p in pubs:
        p.committer = False
    state = random.getstate()  # given back after: the tests after this one keep an unseeded generator
    try:
        assert all(x.committed is None for x in round_(pubs, 0, wait=False))
        late = threading.Timer(0.5, commit_parts, (weightsync.open_repo(store), 0, world), {"timeout": 10})
        late.start()
        random.seed(1234)
        assert pubs[0].settle() is True  # polled for about 0.5 s, 25 times at 0.02 s
        late.join()
        after = random.random()
        random.seed(1234)
        assert after == random.random()
        assert pubs[0]._rng is not pubs[1]._rng
    finally:
        random.setstate(state)
        for p in pubs:
            p.close()


def test_another_version_committed_instead_means_a_full_copy_from_the_store(tmp_path):
    """Both ranks' parts of version 2 are written, but a single publisher commits a different
    version 2 first: the committer refuses, both ranks roll back, and the next round (on the new
    head, which none of them holds) copies every tensor and is bit-exact."""
    store, world = tmp_path / "store", 2
    pubs = ranks(store, world, tmp_path, timeout=5.0, allow_removed=True)
    try:
        for step in (0, 1):
            assert all(x.committed for x in round_(pubs, step))
        pubs[0].committer = False
        assert all(x.committed is None for x in round_(pubs, 2, wait=False))
        other, _ = shard(5, 9)
        publish_state_dict(other, store, 2, work_dir=tmp_path / "w")  # version 2, not the ranks'
        with pytest.raises(VersionError, match="stale parent|already exists"):
            commit_parts(weightsync.open_repo(store), 2, world, timeout=5)
        assert [p.settle() for p in pubs] == [False, False]
        assert [p.base_version for p in pubs] == [1, 1]
        pubs[0].committer = True
        res = round_(pubs, 3)
        for r, x in enumerate(res):
            assert (x.version, x.parent, x.route, x.keyframe) == (3, 2, "full", True)
            assert x.d2h_bytes == x.tensor_bytes
        check_version(store, 3, {0: 3, 1: 3}, tmp_path, world)
    finally:
        for p in pubs:
            p.close()


def test_ranks_on_different_parents_are_refused_and_a_tampered_mirror_is_not_trusted(tmp_path):
    """Rank 0's part of version 3 is built on version 1; a foreign version 2 is committed; rank 1's
    part of version 3 is built on it. The committer refuses the mix, neither rank moves its base,
    and the next round is exact. Then a byte of a rank's host mirror flips: it no longer matches
    the head, so that rank copies every tensor again."""
    store, world = tmp_path / "store", 2
    pubs = ranks(store, world, tmp_path, timeout=5.0, allow_removed=True)
    try:
        for step in (0, 1):
            assert all(x.committed for x in round_(pubs, step))
        pubs[0].committer = False
        r0 = pubs[0].publish(*shard(0, 3)[:1], 3, shard(0, 3)[1], wait=False)
        publish_state_dict(shard(7, 1)[0], store, 2, work_dir=tmp_path / "w")
        r1 = pubs[1].publish(*shard(1, 3)[:1], 3, shard(1, 3)[1], wait=False)
        assert (r0.parent, r1.parent, r1.route) == (1, 2, "full")
        with pytest.raises(VersionError, match="stale parent|disagree on parent"):
            commit_parts(weightsync.open_repo(store), 3, world, timeout=5)
        assert [p.settle() for p in pubs] == [False, False]
        assert [p.base_version for p in pubs] == [1, None]
        pubs[0].committer = True
        res = round_(pubs, 4)
        assert [(x.parent, x.route, x.d2h_bytes == x.tensor_bytes) for x in res] == [(2, "full", True)] * 2
        check_version(store, 4, {0: 4, 1: 4}, tmp_path, world)
        mirror = pubs[1].mirror.current.folder / pubs[1].filename
        data = bytearray(mirror.read_bytes())
        data[-1] ^= 1
        mirror.write_bytes(bytes(data))
        res = round_(pubs, 5)
        assert [x.route for x in res] == ["direct", "full"] and res[1].d2h_bytes == res[1].tensor_bytes
        check_version(store, 5, {0: 5, 1: 5}, tmp_path, world)
    finally:
        for p in pubs:
            p.close()


def test_restarted_rank_and_rank_number_given_twice(tmp_path):
    """A rank process restarted (empty snapshot and mirror) publishes a delta part from a full
    host copy. Two publishers given the same rank: the second's part is refused, the version is
    never committed, and the next round with the right ranks is exact."""
    store, world = tmp_path / "store", 2
    pubs = ranks(store, world, tmp_path, timeout=1.0)
    try:
        for step in (0, 1):
            assert all(x.committed for x in round_(pubs, step))
        pubs[1].close()
        pubs[1] = ranks(store, world, tmp_path)[1]
        res = round_(pubs, 2)
        assert (res[1].route, res[1].keyframe, res[1].d2h_bytes) == ("full", False, res[1].tensor_bytes)
        assert res[0].route == "direct" and res[0].d2h_bytes < res[0].tensor_bytes / 4
        check_version(store, 2, {0: 2, 1: 2}, tmp_path, world)

        twin = RankDeviceDiffPublisher(
            store, rank=0, world=world, commit_timeout=1.0, poll=0.02, work_dir=tmp_path / "w"
        )
        sd0, _ = shard(0, 3)
        sd1, _ = shard(1, 3)
        try:
            res = list(ThreadPoolExecutor(2).map(lambda a: _try(a[0].publish, a[1], 3), [(pubs[0], sd0), (twin, sd1)]))
        finally:
            twin.close()
        assert all(isinstance(x, VersionError) for x in res), res
        assert any("already holds a different part" in str(x) for x in res)
        assert weightsync.open_repo(store).head_version() == 2 and pubs[0].base_version == 2
        res = round_(pubs, 4)
        assert [x.parent for x in res] == [2, 2] and [x.route for x in res] == ["direct", "direct"]
        check_version(store, 4, {0: 4, 1: 4}, tmp_path, world)
    finally:
        for p in pubs:
            p.close()


def test_rank_restarted_after_its_part_finds_it_stored_and_the_version_commits(tmp_path):
    """Rank 1 writes its part of version 2 and dies before the commit; restarted, it publishes the
    same tensors as version 2: the identical part is found (nothing written), the commit goes
    through, and the restarted rank's base is version 2."""
    store, world = tmp_path / "store", 2
    pubs = ranks(store, world, tmp_path, timeout=30.0)
    try:
        for step in (0, 1):
            assert all(x.committed for x in round_(pubs, step))
        sd1, meta1 = shard(1, 2)
        first = pubs[1].publish(sd1, 2, meta1, wait=False)
        assert not first.existed and first.committed is None
        pubs[1].close()  # dies with its part stored, uncommitted
        pubs[1] = ranks(store, world, tmp_path)[1]
        res = round_(pubs, 2)
        assert res[1].existed and res[1].route == "full" and [x.committed for x in res] == [True, True]
        assert [p.base_version for p in pubs] == [2, 2]
        check_version(store, 2, {0: 2, 1: 2}, tmp_path, world)
        # again, with the version committed from the stored part while the restarted rank encodes
        assert round_(pubs[1:], 3, wait=False)[0].committed is None
        pubs[1].close()
        pubs[1] = ranks(store, world, tmp_path)[1]
        pubs[0].committer = False  # its thread would commit both stored parts before rank 1 plans
        r0 = pubs[0].publish(*shard(0, 3)[:1], 3, shard(0, 3)[1], wait=False)
        pubs[0].committer = True
        sd1, meta1 = shard(1, 3)

        class CommitMeanwhile(Observer):
            def check(self) -> None:
                if weightsync.open_repo(store).head_version() == 2:
                    commit_parts(weightsync.open_repo(store), 3, world, timeout=5)

        r1 = pubs[1].publish(sd1, 3, meta1, observer=CommitMeanwhile())
        assert (r0.committed, r1.committed, r1.existed) == (None, True, True)
        assert pubs[0].settle() is True and [p.base_version for p in pubs] == [3, 3]
        check_version(store, 3, {0: 3, 1: 3}, tmp_path, world)
    finally:
        for p in pubs:
            p.close()


def _try(fn, *args):
    try:
        return fn(*args)
    except Exception as exc:
        return exc


def test_bad_arguments_are_refused_before_anything_is_written(tmp_path):
    store = tmp_path / "store"
    for kw, msg in [
        ({"rank": 2, "world": 2}, "rank must be in 0..1"),
        ({"rank": 0, "world": 0}, "world size"),
        ({"rank": 0, "world": 1, "filename": "../x.safetensors"}, "filename"),
        ({"rank": 0, "world": 1, "filename": "a/b.safetensors"}, "plain name"),
        ({"rank": 0, "world": 1, "commit_timeout": -1}, "commit_timeout"),
    ]:
        with pytest.raises(UsageError, match=msg):
            RankDeviceDiffPublisher(store, work_dir=tmp_path / "w", **kw)
    assert not store.exists()
    assert rank_filename(16, 64) == "rank-00017-of-00064.safetensors"


def _spawn(store: Path, tmp: Path, rank: int, world: int, steps: str, *extra) -> subprocess.Popen:
    args = [sys.executable, str(WORKER), str(store), "--rank", str(rank), "--world", str(world)]
    args += ["--steps", steps, "--work", str(tmp / "w"), *map(str, extra)]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _lines(proc: subprocess.Popen) -> tuple[int, list[dict], str]:
    try:
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, [json.loads(x) for x in out.splitlines() if x.strip()], err


def test_ranks_as_processes_with_a_crash_and_a_restart(tmp_path):
    """Three rank processes on a file store, rank 0 committing. Rank 2's process dies at step 2
    before its part; versions 0-1 commit, 2 times out on ranks 0 and 1 (which stay at version 1),
    a restarted rank 2 (empty snapshot: full host copy) rejoins at step 3. Every committed version
    is pulled and compared bit for bit."""
    store, world = tmp_path / "store", 3
    procs = [
        _spawn(store, tmp_path, 0, world, "0-4", "--commit", "--timeout", 120, "--short-at", 2),
        _spawn(store, tmp_path, 1, world, "0-4", "--timeout", 120, "--short-at", 2),
        _spawn(store, tmp_path, 2, world, "0-4", "--timeout", 120, "--crash-at", 2),
    ]
    rc, lines, err = _lines(procs[2])
    assert rc == 17 and [x["step"] for x in lines] == [0, 1], err
    restarted = _spawn(store, tmp_path, 2, world, "3-4", "--timeout", 120)
    out = [_lines(p) for p in procs[:2]] + [_lines(restarted)]
    for r, (rc, lines, err) in enumerate(out):
        assert rc == 0, err
        by_step = {x["step"]: x for x in lines}
        if r < 2:
            assert "not committed" in by_step[2]["error"] or "parts stored" in by_step[2]["error"]
            assert by_step[2]["base"] == 1
            assert by_step[3]["route"] == "direct" and by_step[3]["parent"] == 1
            assert by_step[3]["d2h"] == expected_d2h(shard(r, 1)[0], shard(r, 3)[0])
        else:
            assert (by_step[3]["route"], by_step[3]["d2h"]) == ("full", by_step[3]["tensor_bytes"])
        assert by_step[4]["route"] == "direct" and by_step[4]["committed"] and by_step[4]["base"] == 4
    assert [v.version for v in weightsync.versions(store)] == [0, 1, 3, 4]
    for v in (0, 1, 3, 4):
        check_version(store, v, dict.fromkeys(range(world), v), tmp_path, world)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_ranks_move_only_changes_and_roll_back_on_the_device(tmp_path):
    """CUDA shards: only the changes cross to the host, a failed round is undone on the device
    snapshot, and every committed version is bit-exact."""
    store, world = tmp_path / "store", 2
    pubs = ranks(store, world, tmp_path, timeout=1.0)

    def gpu(r, step):
        sd, meta = shard(r, step)
        return {k: v.cuda() for k, v in sd.items()}, meta

    try:
        for step in (0, 1):
            for r in (1, 0):
                sd, meta = gpu(r, step)
                pubs[r].publish(sd, step, meta, wait=r == 0)
            assert pubs[1].settle() is True
        with pytest.raises(RuntimeError, match="rank crashed"):
            pubs[1].publish(*gpu(1, 2)[:1], 2, gpu(1, 2)[1], observer=Crash())
        with pytest.raises(VersionError):
            pubs[0].publish(*gpu(0, 2)[:1], 2, gpu(0, 2)[1])
        for r in (1, 0):
            sd, meta = gpu(r, 4)
            x = pubs[r].publish(sd, 4, meta, wait=r == 0)
            assert x.route == "direct" and x.d2h_bytes == expected_d2h(shard(r, 1)[0], shard(r, 4)[0])
        assert pubs[1].settle() is True
        for v in (0, 1, 4):
            check_version(store, v, dict.fromkeys(range(world), v), tmp_path, world)
    finally:
        for p in pubs:
            p.close()
