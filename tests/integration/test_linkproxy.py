"""benchmarks/linkproxy.py, the link proxy of the multi-region harness, between boto3 and SeaweedFS:
it counts every request by kind and its bytes exactly, passes bytes through unchanged, and its
shaping never lets a link go faster than its bandwidth or a request round trip faster than its RTT
(lower bounds only: a loaded machine can make the link slower, never faster)."""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from botocore.exceptions import ClientError

_PROXY = Path(__file__).resolve().parents[2] / "benchmarks" / "linkproxy.py"
_spec = importlib.util.spec_from_file_location("weightsync_bench_linkproxy", _PROXY)
linkproxy = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = linkproxy  # dataclasses look their module up by name
_spec.loader.exec_module(linkproxy)

pytestmark = pytest.mark.integration
BUCKET = "weightsync-test"


@pytest.fixture
def link(seaweed, request):
    opts = getattr(request, "param", {})
    proxy = linkproxy.LinkProxy(seaweed.endpoint, **opts).start()
    try:
        yield proxy
    finally:
        proxy.stop()


def _client(seaweed, link):
    return seaweed.client(endpoint_url=link.endpoint)


@pytest.mark.parametrize(
    ("method", "path", "ranged", "status", "kind"),
    [
        ("GET", "/b/p/chunks/ab/ab12", False, 200, "GET chunks"),
        ("GET", "/b/p/chunks/ab/ab12", True, 206, "GET chunks range"),
        ("HEAD", "/b/p/chunks/ab/ab12", False, 404, "HEAD chunks 404"),
        ("GET", "/b/p/HEAD", False, 304, "GET HEAD-key 304"),
        ("PUT", "/b/p/HEAD", False, 412, "PUT HEAD-key 412"),
        ("PUT", "/b/p/versions/00000000000000000001.json", False, 200, "PUT versions"),
        ("PUT", "/b/p/parts/00000000000000000001/00000-of-00002.json", False, 200, "PUT parts"),
        ("DELETE", "/b/p/lazy/00000000000000000001.json", False, 204, "DELETE lazy"),
        ("GET", "/b?list-type=2&prefix=p/versions/", False, 200, "LIST"),
        ("GET", "/b/p/weightsync.json", False, 200, "GET marker"),
        ("GET", "/b/p/fleet/sub-a.json", False, 200, "GET fleet"),
    ],
)
def test_classify(method, path, ranged, status, kind):
    assert linkproxy.classify(method, path, ranged, status) == kind


def test_pacer_books_bytes_one_after_another():
    p = linkproxy.Pacer(1000.0)
    t0 = time.monotonic()
    first = p.reserve(500)
    second = p.reserve(500)  # shares the link: done only after the first
    assert first >= t0 + 0.5 and second >= first + 0.5
    assert linkproxy.Pacer(None).reserve(1 << 30) <= time.monotonic()
    with pytest.raises(ValueError):
        linkproxy.Pacer(0)


def test_counts_every_request_by_kind_and_bytes_pass_unchanged(seaweed, link):
    c = _client(seaweed, link)
    data = os.urandom(300_000)
    c.put_object(Bucket=BUCKET, Key="lp/chunks/ab/ab1", Body=data)
    assert c.get_object(Bucket=BUCKET, Key="lp/chunks/ab/ab1")["Body"].read() == data
    got = c.get_object(Bucket=BUCKET, Key="lp/chunks/ab/ab1", Range="bytes=1000-1999")["Body"].read()
    assert got == data[1000:2000]
    c.put_object(Bucket=BUCKET, Key="lp/HEAD", Body=b'{"version": 7}')
    etag = c.head_object(Bucket=BUCKET, Key="lp/HEAD")["ETag"]
    with pytest.raises(ClientError) as exc:
        c.get_object(Bucket=BUCKET, Key="lp/HEAD", IfNoneMatch=etag)
    assert exc.value.response["Error"]["Code"] == "304"
    with pytest.raises(ClientError):
        c.head_object(Bucket=BUCKET, Key="lp/chunks/zz/missing")
    c.list_objects_v2(Bucket=BUCKET, Prefix="lp/chunks/")
    snap = link.snapshot()
    assert snap["requests"] == {
        "GET HEAD-key 304": 1,
        "GET chunks": 1,
        "GET chunks range": 1,
        "HEAD HEAD-key": 1,
        "HEAD chunks 404": 1,
        "LIST": 1,
        "PUT HEAD-key": 1,
        "PUT chunks": 1,
    }
    recs = link.records()
    assert len(recs) == 8 and all(r.end >= r.start for r in recs)
    assert snap["bytes_up"] == sum(r.up for r in recs) and snap["bytes_down"] == sum(r.down for r in recs)
    by = snap["by_kind"]
    assert data.__len__() < by["PUT chunks"][1] < len(data) + 4096  # the body and its head
    assert len(data) < by["GET chunks"][2] < len(data) + 4096
    assert 1000 < by["GET chunks range"][2] < 1000 + 4096
    assert [r.body for r in recs if r.kind == "PUT HEAD-key"] == [b'{"version": 7}']
    # a window of the counters: only what completed inside it
    assert link.snapshot(since=recs[-1].end)["requests"] == {"LIST": 1}


@pytest.mark.parametrize("link", [{"bandwidth": 2_000_000.0}], indirect=True)
def test_bandwidth_is_shared_by_the_connections_of_a_link(seaweed, link):
    size = 1_000_000
    direct = seaweed.client()
    direct.put_object(Bucket=BUCKET, Key="lp-bw/obj", Body=os.urandom(size))
    c = _client(seaweed, link)
    t0 = time.monotonic()
    with ThreadPoolExecutor(3) as pool:  # three downloads at once share 2 MB/s
        bodies = list(pool.map(lambda _: c.get_object(Bucket=BUCKET, Key="lp-bw/obj")["Body"].read(), range(3)))
    elapsed = time.monotonic() - t0
    assert all(len(b) == size for b in bodies)
    assert elapsed >= 3 * size / 2_000_000 - linkproxy.SLICE / 2_000_000, elapsed
    assert link.snapshot()["bytes_down"] >= 3 * size


@pytest.mark.parametrize("link", [{"rtt": 0.05, "connect_rtts": 0}], indirect=True)
def test_every_request_waits_a_round_trip(seaweed, link):
    c = _client(seaweed, link)
    c.put_object(Bucket=BUCKET, Key="lp-rtt/k", Body=b"x")
    for r in link.records():
        assert r.end - r.start >= 0.05 - 1e-3
    t0 = time.monotonic()
    for _ in range(10):
        c.head_object(Bucket=BUCKET, Key="lp-rtt/k")
    assert time.monotonic() - t0 >= 10 * 0.05 - 1e-3
    assert link.snapshot()["requests"] == {"HEAD other": 10, "PUT other": 1}


def test_bad_settings_are_refused(seaweed):
    with pytest.raises(ValueError):
        linkproxy.LinkProxy(seaweed.endpoint, rtt=-1)
    with pytest.raises(ValueError):
        linkproxy.LinkProxy(seaweed.endpoint, bandwidth=0.0)
    with pytest.raises(ValueError):
        linkproxy.LinkProxy(seaweed.endpoint).add(linkproxy.Rule("truncate"))


def test_a_request_is_counted_before_its_client_has_the_whole_answer(seaweed, link):
    c = _client(seaweed, link)
    c.put_object(Bucket=BUCKET, Key="lp-race/k", Body=b"x" * 100_000)
    for i in range(100):  # counted after the last write, 38 of 300 of these found their own request missing
        c.head_object(Bucket=BUCKET, Key="lp-race/k")
        assert sum(link.snapshot()["requests"].values()) == i + 2
