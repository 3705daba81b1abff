"""Multi-rank publishing on a real SeaweedFS: three ``weightsync publish-part`` processes and a
``weightsync commit-parts`` process started together, then a delta, a racing second committer, and
gc of the merged parts. Every version is pulled and compared with its checkpoint file by file."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import pytest
from procs import finish, spawn_cli

import weightsync
from weightsync.demo import make_trajectory
from weightsync.format.keys import PARTS_PREFIX
from weightsync.sync.gc import GcConfig, gc
from weightsync.sync.parts import commit_parts, publish_part

pytestmark = pytest.mark.integration

TINY = {"hidden": 32, "layers": 1, "experts": 2, "vocab": 128}


def content(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(Path(root).rglob("*"))
        if p.is_file() and ".weightsync" not in p.relative_to(root).parts
    }


def test_three_ranks_on_s3_keyframe_then_delta(s3_url, tmp_path):
    traj = make_trajectory(tmp_path / "traj", steps=1, shards=3, **TINY)
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "xdg"))  # s3_env pointed boto3 at SeaweedFS
    committer = spawn_cli("commit-parts", "--store", s3_url, "--version", 0, "--world", 3, "--timeout", 90, env=env)
    ranks = [
        spawn_cli("publish-part", traj[0], "--store", s3_url, "--rank", r, "--world", 3, env=env) for r in range(3)
    ]
    for proc in ranks + [committer]:
        rc, out, err = finish(proc)
        assert rc == 0 and out.strip().splitlines()[-1] == "0", err

    repo = weightsync.open_repo(s3_url)
    assert repo.versions() == [0] and repo.manifest(0).keyframe
    weightsync.pull(repo, tmp_path / "out", 0)
    assert content(tmp_path / "out") == content(traj[0])

    # version 1, a delta, ranks in-process with their caches; two committers, one finds it done
    res = [publish_part(traj[1], repo, r, 3, cache_dir=tmp_path / f"cache{r}") for r in range(3)]
    assert sum(r.uploaded_bytes for r in res) < sum(p.stat().st_size for p in traj[1].iterdir()) / 10
    assert len(list(repo.store.list(PARTS_PREFIX))) == 6  # version 0's, not collected yet, and version 1's
    first = commit_parts(repo, 1, 3, timeout=30)
    second = commit_parts(weightsync.open_repo(s3_url), 1, 3, timeout=30)
    assert (first.already, second.already, first.parent) == (False, True, 0)
    weightsync.pull(repo, tmp_path / "out", 1)  # incremental, from version 0
    assert content(tmp_path / "out") == content(traj[1])

    time.sleep(1.1)  # S3 ages have a resolution of one second
    swept = gc(repo, GcConfig(keep=1, grace_seconds=3600))
    assert (swept.deleted_parts, swept.pending_parts, swept.deleted_chunks) == (6, 0, 0)
    assert list(repo.store.list(PARTS_PREFIX)) == []
    weightsync.pull(repo, tmp_path / "fresh", 1)
    assert content(tmp_path / "fresh") == content(traj[1])
