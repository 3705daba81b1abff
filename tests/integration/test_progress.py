"""Progress while a sync runs, on SeaweedFS behind tests/faultproxy.py slowing every chunk download: the
subscriber's ``/v1/status`` shows the phase, the bytes done of its total and the start time, and
``weightsync_download_bytes_total`` moves as chunks land, before the version is swapped in (and adds
up to the fetched bytes after it). The target and the pin are metrics too."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "functional"))  # the daemon helpers

from faultproxy import FaultProxy, Rule  # noqa: E402
from test_daemons import Daemon, wait_for  # noqa: E402

import weightsync  # noqa: E402
from weightsync.demo import make_trajectory  # noqa: E402

pytestmark = pytest.mark.integration


def metric(d: Daemon, name: str) -> float:
    m = re.search(rf"^{name}\{{[^}}]*\}} (\S+)$", d.get("/metrics")[1], re.M)
    return float(m.group(1))


def test_a_slow_download_shows_its_progress_and_moves_the_byte_counter(s3_url, seaweed, tmp_path):
    traj = make_trajectory(tmp_path / "traj", steps=0, hidden=128, layers=1, experts=2, vocab=512)
    cfg = weightsync.PublishConfig(chunk_bytes=64 << 10)
    weightsync.publish(traj[0], weightsync.open_repo(s3_url), 0, config=cfg)
    chunks = len(weightsync.open_repo(s3_url).manifest(0).chunks)
    assert chunks >= 6
    proxy = FaultProxy(seaweed.endpoint, seed=1).start()
    proxy.add(Rule("delay", method="GET", key=r"/chunks/", delay=0.4))
    env = {**seaweed.env(), "AWS_ENDPOINT_URL": proxy.endpoint}
    sub = None
    try:
        sub = Daemon(
            "subscriber",
            ["--store", s3_url, "--target", tmp_path / "t", "--no-fsync", "--concurrency", "2"],
            tmp_path,
            env,
        ).start()
        seen = wait_for(
            lambda: (s := sub.status())["progress"] and s["progress"]["bytes_done"] > 0 and s,
            30,
            f"a sync under way\n{sub.log()}",
        )
        p = seen["progress"]
        assert seen["state"] == "syncing" and seen["current_version"] is None
        assert (p["version"], p["phase"]) == (0, "fetch") and 0 < p["bytes_done"] < p["bytes_total"], p
        assert p["transferred_bytes"] == p["bytes_done"] and p["started"] > 0
        # counted just after the status's bytes, on the fetch thread: polled (each chunk takes 0.4 s more)
        wait_for(lambda: metric(sub, "weightsync_download_bytes_total"), 10, "the byte counter to move")
        assert sub.status()["progress"] is not None, "the counter moves as chunks land, not when the sync ends"
        done = sub.wait_version(0, timeout=60)
        assert done["progress"] is None
        assert metric(sub, "weightsync_download_bytes_total") == done["last_sync"]["fetched_bytes"] >= p["bytes_total"]
        assert (metric(sub, "weightsync_target_version"), metric(sub, "weightsync_pinned")) == (-1, 0)
        sub.put_target(0)
        assert (metric(sub, "weightsync_target_version"), metric(sub, "weightsync_pinned")) == (0, 1)
    finally:
        if sub is not None:
            sub.stop()
        proxy.stop()
