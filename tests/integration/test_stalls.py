"""A store that hangs, as operators meet it: SeaweedFS behind tests/faultproxy.py, which holds every
request for the head pointer (a frozen endpoint answers nothing). The publisher and a subscriber, as
real processes with short S3 timeouts, log each retried request and report the hung one past
``--stall-after`` (a WARNING, state ``stalled`` with the request in ``/v1/status``, the
``weightsync_store_stalled_requests`` gauge); the publisher still lists the checkpoint written
meanwhile as pending. Once the store answers again, the stall is logged as ended and the checkpoint
is published and synced. Stopped while the store hangs, both exit at once."""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "functional"))  # the daemon helpers

from faultproxy import FaultProxy, Rule  # noqa: E402
from test_daemons import Daemon, wait_for  # noqa: E402

from weightsync.demo import SyntheticTrainer  # noqa: E402

pytestmark = pytest.mark.integration
TINY = dict(hidden=32, layers=1, experts=2, vocab=128)
WATCH = ["--s3-read-timeout", "0.5", "--s3-connect-timeout", "0.5", "--stall-after", "1.5", "--retry-attempts", "50"]


def gauge(d: Daemon) -> float:
    m = re.search(r"^weightsync_store_stalled_requests\{[^}]*\} (\S+)$", d.get("/metrics")[1], re.M)
    return float(m.group(1))


def test_a_hung_store_is_logged_shown_and_exported_and_pending_checkpoints_stay_visible(s3_url, seaweed, tmp_path):
    proxy = FaultProxy(seaweed.endpoint, seed=1).start()
    env = {**seaweed.env(), "AWS_ENDPOINT_URL": proxy.endpoint}
    watch = tmp_path / "watch"
    trainer = SyntheticTrainer(**TINY, seed=0)
    (trainer.save(watch / "step_0") / "COMPLETE").write_text("")
    pub = sub = None
    try:
        pub = Daemon(
            "publisher", ["--store", s3_url, "--watch", watch, "--state-dir", tmp_path / "st", *WATCH], tmp_path, env
        ).start()
        wait_for(lambda: pub.status()["head_version"] == 0, 30, f"version 0\n{pub.log()}")
        sub = Daemon(
            "subscriber", ["--store", s3_url, "--target", tmp_path / "t", "--no-fsync", *WATCH], tmp_path, env
        ).start()
        sub.wait_version(0)

        hang = proxy.add(Rule("delay", method="GET", key=r"/HEAD$", delay=3600))  # the head pointer: no answer
        trainer.step()
        (trainer.save(watch / "step_1") / "COMPLETE").write_text("")
        for d in (pub, sub):
            status = wait_for(lambda d=d: (s := d.status())["state"] == "stalled" and s, 30, f"a stall\n{d.log()}")
            assert status["stalled"][0]["op"] == "GET" and status["stalled"][0]["key"] == "HEAD", status
            assert "has not completed after" in status["reason"] and "--stall-after 1.5" in status["reason"]
            wait_for(lambda d=d: gauge(d) >= 1, 10, "the gauge")
            wait_for(lambda d=d: "store request stalled: GET s3://" in d.log(), 10, "the stall's log line")
            assert re.search(r"WARNING weightsync\.store: store request failed; retrying op=GET key=HEAD", d.log())
        assert pub.status()["pending"] == [1]  # written while the store hung: listed, not hidden behind "idle"
        assert hang.fired >= 2

        proxy.clear()  # the store answers again
        sub.wait_version(1, timeout=60)
        for d in (pub, sub):
            wait_for(lambda d=d: d.status()["state"] != "stalled" and gauge(d) == 0, 30, f"the end\n{d.log()}")
            # the watch thread sets the gauge, then logs
            wait_for(lambda d=d: "stalled store request ended: GET s3://" in d.log(), 10, "the end's log line")
            assert re.search(r"^weightsync_store_stalls_total\{[^}]*\} [1-9]", d.get("/metrics")[1], re.M)
        assert pub.status()["head_version"] == 1 and pub.status()["pending"] == []

        # SIGTERM while the store hangs: the waits between retries end at once, the attempt in flight
        # within its read timeout; the daemons exit 0 well within their grace
        proxy.add(Rule("delay", method="GET", key=r"/HEAD$", delay=3600))
        for d in (pub, sub):
            wait_for(lambda d=d: d.status()["state"] == "stalled", 30, f"a stall\n{d.log()}")
        for d in (pub, sub):
            t0 = time.monotonic()
            assert d.stop(timeout=15) == 0, d.log()
            assert time.monotonic() - t0 < 10, d.log()
    finally:
        for d in (pub, sub):
            if d is not None and d.proc.poll() is None:
                d.proc.kill()  # a request held by the proxy would keep a SIGTERM waiting for its retries
                d.proc.wait()
        proxy.stop()


def test_a_one_shot_pull_from_a_hung_store_fails_within_its_s3_timeouts(s3_url, seaweed, tmp_path):
    """``pull --s3-read-timeout 0.5``: a store that never answers fails the command in seconds with
    one line (it waited 60 s an attempt, five attempts, with no flag to shorten it)."""
    import os
    import subprocess

    proxy = FaultProxy(seaweed.endpoint, seed=2).start()
    env = {**os.environ, **seaweed.env(), "AWS_ENDPOINT_URL": proxy.endpoint}
    ckpt = SyntheticTrainer(**TINY, seed=0).save(tmp_path / "step_0")
    cli = [sys.executable, "-m", "weightsync.cli"]
    subprocess.run([*cli, "publish", ckpt, "--store", s3_url, "--no-cache"], env=env, check=True, capture_output=True)
    proxy.add(Rule("delay", method="GET", key=r"/HEAD$", delay=3600))
    timeouts = ["--s3-read-timeout", "0.5", "--s3-connect-timeout", "0.5"]
    try:
        for command in (["pull", "--store", s3_url, tmp_path / "out", "--no-progress"], ["fleet", "--store", s3_url]):
            t0 = time.monotonic()  # (fleet, with its list of stores, parses its flags apart)
            r = subprocess.run([*cli, *command, *timeouts], capture_output=True, text=True, env=env, timeout=120)
            assert r.returncode == 1 and len(r.stderr.splitlines()) == 1 and "HEAD" in r.stderr, (command, r.stderr)
            assert time.monotonic() - t0 < 40
    finally:
        proxy.stop()
