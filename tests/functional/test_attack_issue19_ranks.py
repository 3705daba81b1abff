"""Hostile review of issue 19's rank device publishers (RankDeviceDiffPublisher) on file stores: a
commit that lands after every rank gave up on it, ranks that disagree on the keyframe decision,
state dicts whose tensors alias each other. Every committed version is pulled and compared bit for
bit with what the ranks published."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from rank_device_worker import ints, shard
from safetensors.torch import load_file

import weightsync
from weightsync.errors import VersionError
from weightsync.sync.parts import commit_parts
from weightsync.sync.publish import PublishConfig
from weightsync.torch.device import RankDeviceDiffPublisher, rank_filename

CFG = PublishConfig(keyframe_interval=3)


def make(store: Path, tmp: Path, world: int, configs=None, timeout: float = 60.0, committer: bool = True):
    return [
        RankDeviceDiffPublisher(
            store,
            rank=r,
            world=world,
            commit=committer and r == 0,
            commit_timeout=timeout,
            poll=0.02,
            config=CFG if configs is None else configs[r],
            work_dir=tmp / f"w{r}",
        )
        for r in range(world)
    ]


def round_(pubs, sds: list[dict], version: int, **kw) -> list:
    def one(pub):
        try:
            return pub.publish(sds[pub.rank], version, **kw)
        except Exception as exc:  # noqa: BLE001 - returned to the test
            return exc

    with ThreadPoolExecutor(len(pubs)) as pool:
        return list(pool.map(one, pubs))


def assert_pulled(store: Path, version: int, sds: list[dict], tmp: Path) -> None:
    out = tmp / f"pulled-{version}"
    weightsync.pull(store, out, version)
    for r, sd in enumerate(sds):
        got = load_file(out / rank_filename(r, len(sds)))
        assert got.keys() == sd.keys(), (version, r)
        for name, t in sd.items():
            assert got[name].dtype == t.dtype and got[name].shape == t.shape, (version, r, name)
            assert torch.equal(ints(got[name]), ints(t.detach().contiguous())), (version, r, name)


def test_a_commit_that_lands_after_every_rank_gave_up_leaves_the_next_version_bit_exact(tmp_path):
    store, world = tmp_path / "store", 2
    pubs = make(store, tmp_path, world, timeout=0.5, committer=False)
    try:
        for step in (0, 1):
            assert all(
                x.committed is None for x in round_(pubs, [shard(r, step)[0] for r in range(world)], step, wait=False)
            )
            commit_parts(weightsync.open_repo(store), step, world, timeout=10)
        res = round_(pubs, [shard(r, 2, events=False)[0] for r in range(world)], 2)  # nobody commits: both give up
        assert all(isinstance(x, VersionError) for x in res), res
        assert [p.base_version for p in pubs] == [1, 1]
        commit_parts(weightsync.open_repo(store), 2, world, timeout=10)  # ... and then it lands
        assert weightsync.open_repo(store).head_version() == 2
        sds = [shard(r, 3, events=False)[0] for r in range(world)]
        for p in pubs:
            p.commit_timeout = 30.0
        res = round_(pubs, sds, 3, wait=False)
        assert all(not isinstance(x, Exception) for x in res), res
        commit_parts(weightsync.open_repo(store), 3, world, timeout=10)
        assert [p.settle() for p in pubs] == [True, True]
        assert_pulled(store, 3, sds, tmp_path)
        assert_pulled(store, 2, [shard(r, 2, events=False)[0] for r in range(world)], tmp_path)
        sds = [shard(r, 4, events=False)[0] for r in range(world)]  # and once more from the moved base
        round_(pubs, sds, 4, wait=False)
        commit_parts(weightsync.open_repo(store), 4, world, timeout=10)
        assert [p.settle() for p in pubs] == [True, True]
        assert_pulled(store, 4, sds, tmp_path)
    finally:
        for p in pubs:
            p.close()


def test_ranks_that_disagree_on_the_keyframe_decision_never_commit_a_version_that_pulls_wrong(tmp_path):
    """Rank 0 makes a keyframe every 2 versions, rank 1 every 100: at version 2 their parts
    disagree. Either the commit is refused in a clear error, or every version pulls bit-exact.
    A refused commit ends every rank's wait with the committer's reason, not at its timeout."""
    store, world = tmp_path / "store", 2
    pubs = make(
        store,
        tmp_path,
        world,
        configs=[PublishConfig(keyframe_interval=2), PublishConfig(keyframe_interval=100)],
        timeout=120.0,
    )
    committed, refused = {}, []
    try:
        for step in range(5):
            sds = [shard(r, step, events=False)[0] for r in range(world)]
            t0 = time.monotonic()
            res = round_(pubs, sds, step)
            if all(not isinstance(x, Exception) and x.committed for x in res):
                committed[step] = sds
            else:
                refused.append(step)
                assert time.monotonic() - t0 < 60, "a rank waited for a commit its committer had refused"
                assert all(isinstance(x, VersionError) and "disagree on keyframe" in str(x) for x in res), res
                assert "the committer refused version" in str(res[1]), res
                assert pubs[1].base_version == max(committed)
    finally:
        for p in pubs:
            p.close()
    assert 0 in committed and refused
    for v, sds in committed.items():
        assert_pulled(store, v, sds, tmp_path)
    for v in committed:  # a fresh reader of each version, and a follower from the one before
        out = tmp_path / "follower"
        weightsync.pull(store, out, v)


def test_tensors_that_alias_each_other_publish_bit_exact(tmp_path):
    """Tied weights (one tensor under two names), a view of a row and a transposed view: changed
    in place between steps, as a trainer does."""
    store, world = tmp_path / "store", 1
    (pub,) = make(store, tmp_path, world)
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(32, 16, generator=g) * 0.02).bfloat16()
    sd = {"embed.weight": w, "lm_head.weight": w, "row0": w[0], "wT": w.t(), "tail": w[16:]}
    try:
        for step in range(4):
            if step:
                ints(w).view(-1)[step * 7 : step * 7 + 40] += 1  # in place: every alias moves
            r = pub.publish(sd, step)
            assert r.committed
            assert_pulled(store, step, [{k: v.clone() for k, v in sd.items()}], tmp_path / f"s{step}")
    finally:
        pub.close()


@pytest.mark.parametrize("alias_first", [True, False])
def test_a_view_published_before_its_base_tensor_is_bit_exact(tmp_path, alias_first):
    store = tmp_path / "store"
    (pub,) = make(store, tmp_path, 1)
    w = torch.arange(64, dtype=torch.int32).reshape(8, 8)
    sd = {"half": w[4:], "w": w} if alias_first else {"w": w, "half": w[4:]}
    try:
        for step in range(3):
            if step:
                w[5, step] += 100
            assert pub.publish(sd, step).committed
            assert_pulled(store, step, [{k: v.clone() for k, v in sd.items()}], tmp_path / f"s{step}")
    finally:
        pub.close()
