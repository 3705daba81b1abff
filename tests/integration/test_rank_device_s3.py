"""Rank publishers fed by device diffs on a real SeaweedFS: two ranks as threads, rank 0 committing
in a thread (``wait=False``), a round a rank dies in, and every committed version pulled and
compared bit for bit with the trainer's tensors."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from rank_device_worker import ints, shard
from safetensors.torch import load_file

import weightsync
from weightsync.errors import VersionError
from weightsync.sync.observer import Observer
from weightsync.sync.publish import PublishConfig
from weightsync.torch.device import RankDeviceDiffPublisher, rank_filename

pytestmark = pytest.mark.integration


class Crash(Observer):
    def check(self) -> None:
        raise RuntimeError("rank crashed")


def test_two_ranks_on_s3_with_a_failed_round(s3_url, tmp_path):
    world = 2
    pubs = [
        RankDeviceDiffPublisher(
            s3_url,
            rank=r,
            world=world,
            commit=r == 0,
            commit_timeout=30.0,
            poll=0.05,
            config=PublishConfig(keyframe_interval=3),
            work_dir=tmp_path / "w",
        )
        for r in range(world)
    ]

    def round_(step: int, **kw):
        with ThreadPoolExecutor(world) as pool:
            return list(pool.map(lambda p: p.publish(*_args(p.rank, step), **kw), pubs))

    def check(version: int) -> None:
        out = tmp_path / f"out-{version}"
        weightsync.pull(s3_url, out, version)
        for r in range(world):
            sd, _ = shard(r, version)
            got = load_file(out / rank_filename(r, world))
            assert got.keys() == sd.keys()
            for name, t in sd.items():
                assert got[name].dtype == t.dtype and torch.equal(ints(got[name]), ints(t)), (version, r, name)

    try:
        for step in (0, 1):
            assert all(x.committed for x in round_(step))
            check(step)
        res = round_(2, wait=False)  # the committer runs in a thread; the next round settles it
        assert [x.committed for x in res] == [None, None]
        assert [x.committed for x in round_(3)] == [True, True]  # version 2 settled first, then 3
        check(2)
        check(3)
        pubs[0].commit_timeout = 2.0
        with pytest.raises(RuntimeError, match="rank crashed"):
            pubs[1].publish(*_args(1, 4), observer=Crash())
        with pytest.raises(VersionError, match="1 of 2 parts"):
            pubs[0].publish(*_args(0, 4))
        assert [p.base_version for p in pubs] == [3, 3]
        pubs[0].commit_timeout = 30.0
        res = round_(5)
        assert [(x.parent, x.route, x.committed) for x in res] == [(3, "direct", True)] * 2
        check(5)
        assert [v.version for v in weightsync.versions(s3_url)] == [0, 1, 2, 3, 5]
    finally:
        for p in pubs:
            p.close()


def _args(rank: int, step: int):
    sd, meta = shard(rank, step)
    return sd, step, meta
