"""The pipelined mirror between two buckets of a real SeaweedFS, as ``weightsync mirror`` processes:
two shards (one committing) reading the source through a fault-injecting proxy, lazy keyframes, a
shard killed with SIGKILL and restarted. Every version is pulled from the region and compared with
its checkpoint file by file; chunks stored in the region are checked against their ids.
"""

from __future__ import annotations

import hashlib
import os
import signal
import time
from pathlib import Path

import pytest
import xxhash
from faultproxy import FaultProxy, Rule
from procs import finish, spawn_cli

import weightsync
from weightsync.demo import make_trajectory
from weightsync.format.keys import LAZY_PREFIX
from weightsync.sync.mirror import lazy_candidates

pytestmark = pytest.mark.integration

SMALL = {"hidden": 128, "layers": 1, "experts": 2, "vocab": 512, "lr": 1e-6}
REGION_BUCKET = "weightsync-region-p3"


def content(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(Path(root).rglob("*"))
        if p.is_file() and not p.relative_to(root).as_posix().startswith(".weightsync")
    }


def wait(pred, what: str, procs, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            assert p.poll() is None, f"a mirror exited with {p.returncode} waiting for {what}: {p.stderr.read()}"
        if result := pred():
            return result
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_sharded_lazy_mirror_through_faults_and_a_killed_shard(seaweed, s3_url, tmp_path):
    seaweed.make_bucket(REGION_BUCKET)
    region_url = f"s3://{REGION_BUCKET}/{s3_url.rsplit('/', 1)[1]}"
    traj = make_trajectory(tmp_path / "traj", steps=5, shards=2, **SMALL)
    src, region = weightsync.open_repo(s3_url), weightsync.open_repo(region_url)
    cfg = weightsync.PublishConfig(keyframe_interval=2, chunk_bytes=64 << 10)
    weightsync.publish(traj[0], src, config=cfg)
    proxy = FaultProxy(seaweed.endpoint, seed=7).start()
    proxy.add(Rule("503", method="GET", key=r"/chunks/", probability=0.1))
    proxy.add(Rule("reset", method="GET", key=r"/chunks/", probability=0.05))
    proxy.add(Rule("truncate", method="GET", key=r"/chunks/", probability=0.05))
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    common = ["--from", s3_url, "--to", region_url, "--follow", "--interval", "0.2", "--from-endpoint-url"]
    spawn = lambda shard, *extra: spawn_cli(  # noqa: E731
        "mirror", *common, proxy.endpoint, "--shard", shard, "--concurrency", "8", *extra, env=env
    )
    procs = {"committer": spawn("0/2", "--commit"), "shard": spawn("1/2")}
    try:
        wait(lambda: region.head_version() == 0, "version 0", procs.values())
        for v in range(1, len(traj)):
            weightsync.publish(traj[v], src, config=cfg, base_dir=traj[v - 1])
            if v == 3:  # the copying shard dies mid-run and comes back
                procs["shard"].send_signal(signal.SIGKILL)
                finish(procs["shard"], 30)
                procs["shard"] = spawn("1/2")
        last = len(traj) - 1
        wait(lambda: region.head_version() == last, f"version {last}", procs.values())
        wait(lambda: not list(region.store.list(LAZY_PREFIX)), "the lazy keyframe payloads", procs.values())
        for p in procs.values():
            p.send_signal(signal.SIGTERM)
        results = {name: finish(p, 60) for name, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        proxy.stop()
    for name, (rc, _, err) in results.items():
        assert rc == 0, f"{name}: {err}"
    assert results["committer"][1].strip() == str(last)
    assert proxy.total_injected > 0  # faults were met, and retried
    assert region.versions() == list(range(len(traj)))
    for key in region.store.list("chunks/"):  # nothing truncated or damaged was stored
        assert xxhash.xxh3_128_hexdigest(region.store.get(key)) == key.rsplit("/", 1)[1], key
    assert any(lazy_candidates(src.manifest(v)) for v in (2, 4))
    assert "mirrored version" in results["committer"][2] and "mirrored version" not in results["shard"][2]
    sub = tmp_path / "sub"
    for v in range(len(traj)):  # a follower of the region
        weightsync.pull(region, sub, v)
        assert content(sub) == content(traj[v]), v
    weightsync.pull(region, tmp_path / "fresh", last)  # and a fresh pull, the keyframes now whole
    assert content(tmp_path / "fresh") == content(traj[last])
