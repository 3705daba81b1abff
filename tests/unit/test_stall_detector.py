"""The stall watch over store requests in flight (weightsync.service.stalls) on a fake clock, and the
S3 timeouts from flags and variables down to the S3 client's options."""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry

from weightsync import cli
from weightsync.service.flags import S3_CONNECT_TIMEOUT, S3_READ_TIMEOUT, subscriber_config
from weightsync.service.metrics import Metrics
from weightsync.service.runtime import RetryLog, stall_view
from weightsync.service.stalls import StallWatch
from weightsync.store.inflight import InFlight
from weightsync.store.s3_client import S3Options


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def sample(m: Metrics, name: str) -> float:
    return m.registry.get_sample_value(name, m.labels)


def test_a_request_past_stall_after_is_reported_once_and_its_end_too(caplog):
    clock = Clock()
    inflight = InFlight(clock=clock, wall=lambda: 1.7e9)
    m = Metrics(CollectorRegistry(), "publisher", runtime=False)
    watch = StallWatch(inflight, 60.0, m, logging.getLogger("test.stalls"))
    head = inflight.begin("GET", "HEAD", "s3://b/run")
    chunk = inflight.begin("PUT", "chunks/ab/ab12", "s3://b/run")
    clock.now += 30
    assert watch.check() == [] and sample(m, "weightsync_store_stalled_requests") == 0
    inflight.end(chunk)
    clock.now += 31
    with caplog.at_level(logging.INFO, "test.stalls"):
        assert [r.key for r in watch.check()] == ["HEAD"]
        assert [r.key for r in watch.check()] == ["HEAD"]  # reported once
    assert sample(m, "weightsync_store_stalled_requests") == 1 and sample(m, "weightsync_store_stalls_total") == 1
    assert [r.getMessage() for r in caplog.records] == [
        "store request stalled: GET s3://b/run/HEAD has not completed after 61s"
    ]
    assert watch.stalled() == [{"op": "GET", "key": "HEAD", "store": "s3://b/run", "seconds": 61.0, "since": 1.7e9}]
    state, reason, stalled = stall_view(watch, "idle", "version 15 is the newest checkpoint")
    assert state == "stalled" and reason.startswith("store request GET s3://b/run/HEAD has not completed after 61s")
    assert stall_view(watch, "stopping", "r")[0] == "stopping"
    inflight.end(head)
    caplog.clear()
    with caplog.at_level(logging.INFO, "test.stalls"):
        assert watch.check() == []
    assert [r.getMessage() for r in caplog.records] == ["stalled store request ended: GET s3://b/run/HEAD after 61s"]
    assert sample(m, "weightsync_store_stalled_requests") == 0 and stall_view(watch, "idle", "r") == ("idle", "r", [])


def test_retries_are_counted_each_and_logged_at_most_once_per_interval(caplog):
    counted = []
    retry_log = RetryLog(lambda *a: counted.append(a), every=3600)
    with caplog.at_level(logging.WARNING, "weightsync.store"):
        for i in range(3):
            retry_log("GET", "HEAD", TimeoutError("read timeout"), 0.25 * (i + 1))
    assert len(counted) == 3 and len(caplog.records) == 1
    assert caplog.records[0].fields["retry_in"] == "0.25s" and caplog.records[0].fields["op"] == "GET"


def test_s3_timeouts_come_from_flags_or_variables_and_reach_only_s3_stores(tmp_path):
    assert (S3_CONNECT_TIMEOUT, S3_READ_TIMEOUT) == (S3Options.connect_timeout, S3Options.read_timeout)
    env = {
        "WEIGHTSYNC_TARGET": str(tmp_path / "t"),
        "WEIGHTSYNC_S3_READ_TIMEOUT": "7.5",
        "WEIGHTSYNC_STALL_AFTER": "20",
    }

    def config(store: str, *argv: str):
        return subscriber_config(cli.build_parser(env).parse_args(["subscriber", "--store", store, *argv]), env)

    cfg = config("s3://b/run", "--s3-connect-timeout", "2")
    assert cfg.store.options() == {"connect_timeout": 2.0, "read_timeout": 7.5} and cfg.stall_after == 20.0
    assert config(str(tmp_path / "store")).store.options() == {}  # a file store has no client timeouts
    mirror = cli.build_parser(env).parse_args(["mirror", "--from", "s3://a/r", "--to", "s3://b/r"])
    assert (mirror.s3_read_timeout, mirror.s3_connect_timeout, mirror.stall_after) == (7.5, 10.0, 20.0)
