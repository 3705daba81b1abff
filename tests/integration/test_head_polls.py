"""Head polls on a real SeaweedFS, counted by tests/faultproxy.py between boto3 and the server: an
unchanged head costs one ``GET`` answered ``304`` without a body, for a poll through
:meth:`Repo.head_if_changed` and for a running subscriber daemon."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from faultproxy import FaultProxy, Rule

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "functional"))
from test_daemons import Daemon, wait_for  # noqa: E402

import weightsync  # noqa: E402
from weightsync.demo import make_trajectory  # noqa: E402
from weightsync.format.keys import HEAD_KEY  # noqa: E402
from weightsync.format.manifest import head_to_json  # noqa: E402
from weightsync.service.heads import HeadReader  # noqa: E402
from weightsync.store import open_store  # noqa: E402
from weightsync.store.repo import Repo  # noqa: E402
from weightsync.store.retry import RetryingStore, RetryPolicy  # noqa: E402

pytestmark = pytest.mark.integration

HEAD_PATH = r"/HEAD$"


def head_answers(proxy: FaultProxy, since: int) -> list[tuple[str, int, int]]:
    """(method, status, body bytes) of the answers to requests for the head key since answer ``since``."""
    return [(m, status, n) for m, p, status, n in proxy.answers[since:] if re.search(HEAD_PATH, p)]


@pytest.fixture
def proxy(s3_env, monkeypatch):
    with FaultProxy(s3_env.endpoint) as p:
        monkeypatch.setenv("AWS_ENDPOINT_URL", p.endpoint)
        yield p


def test_unchanged_head_polls_are_304s_without_a_body(s3_url, proxy):
    store = RetryingStore(open_store(s3_url), RetryPolicy(attempts=3, base_delay=0.0))
    repo = Repo(store)
    repo.init()
    store.put_if_match(HEAD_KEY, head_to_json(3), None)
    version, etag = repo.head()
    assert version == 3
    polls = 12
    mark = len(proxy.answers)
    for _ in range(polls):
        assert repo.head_if_changed(etag) is None
    assert head_answers(proxy, mark) == [("GET", 304, 0)] * polls  # N polls, N requests, no body

    store.put_if_match(HEAD_KEY, head_to_json(4), etag)
    mark = len(proxy.answers)
    version, etag4 = repo.head_if_changed(etag)
    assert version == 4 and etag4 != etag
    assert repo.head_if_changed(etag4) is None
    (moved, status, size), unchanged = head_answers(proxy, mark)
    assert (moved, status) == ("GET", 200) and size == len(head_to_json(4))
    assert unchanged == ("GET", 304, 0)

    # a throttled conditional read is retried, and still answers "unchanged" without a body
    proxy.add(Rule("503", method="GET", key=HEAD_PATH, count=1))
    mark = len(proxy.answers)
    assert repo.head_if_changed(etag4) is None
    assert proxy.counts() == {"503": 1} and head_answers(proxy, mark) == [("GET", 304, 0)]

    store.delete(HEAD_KEY)  # gone is never "unchanged"
    assert repo.head_if_changed(etag4) == (None, None)


def test_a_head_reader_counts_its_outcomes(s3_url, proxy):
    repo = Repo(open_store(s3_url))
    repo.init()
    repo.store.put_if_match(HEAD_KEY, head_to_json(7), None)
    counted: list[str] = []
    reader = HeadReader(repo, counted.append)
    mark = len(proxy.answers)
    assert [reader.read() for _ in range(5)] == [7] * 5
    assert counted == ["changed"] + ["unchanged"] * 4
    assert [s for _, s, _ in head_answers(proxy, mark)] == [200] + [304] * 4
    seq = reader.state.seq
    _, etag = repo.head()
    repo.store.put_if_match(HEAD_KEY, head_to_json(8), etag)
    assert reader.read() == 8 and reader.state.seq == seq + 1 and counted[-1] == "changed"
    assert reader.read() == 8 and reader.state.seq == seq + 1
    proxy.add(Rule("500", method="GET", key=HEAD_PATH, count=1))
    with pytest.raises(weightsync.WeightsyncError):
        reader.read()  # no retries in this store: the error is counted and raised
    assert counted[-1] == "error" and reader.state.version == 8


def test_a_serving_subscriber_polls_its_head_with_304s(s3_url, proxy, tmp_path):
    """A subscriber daemon on S3 (through the proxy) polling every 0.1 s: once it serves, every read of
    the head is a conditional GET answered 304 without a body, until the head moves."""
    traj = make_trajectory(tmp_path / "traj", steps=1, hidden=32, layers=1, experts=2, vocab=128)
    repo = weightsync.open_repo(s3_url)
    weightsync.publish(traj[0], repo)
    sub = Daemon("subscriber", ["--store", s3_url, "--target", tmp_path / "sub", "--no-fsync"], tmp_path)
    sub.start()
    try:
        sub.wait_version(0)
        mark = len(proxy.answers)
        wait_for(lambda: len(head_answers(proxy, mark)) >= 10, 60, "ten polls of the head")
        polls = head_answers(proxy, mark)
        assert polls and set(polls) == {("GET", 304, 0)}, polls
        weightsync.publish(traj[1], repo)
        sub.wait_version(1, timeout=60)
        mark = len(proxy.answers)
        wait_for(lambda: len(head_answers(proxy, mark)) >= 5, 60, "five more polls")
        assert set(head_answers(proxy, mark)) == {("GET", 304, 0)}
        code, text, _ = sub.get("/metrics")
        unchanged = re.search(r'weightsync_head_reads_total\{[^}]*outcome="unchanged"[^}]*\} (\S+)', text)
        assert code == 200 and float(unchanged.group(1)) >= 15
        assert sub.stop() == 0
    finally:
        if sub.proc and sub.proc.poll() is None:
            sub.proc.kill()


def test_an_idle_following_mirror_reads_both_heads_with_304s(s3_url, proxy, tmp_path):
    """A mirror following every 0.05 s on S3 (both stores through the proxy): once it has copied the
    head, each poll reads the source and the destination heads with conditional GETs answered 304
    without a body, until the source head moves."""
    import threading

    from weightsync.sync.mirror import MirrorConfig, mirror

    traj = make_trajectory(tmp_path / "traj", steps=1, hidden=32, layers=1, experts=2, vocab=128)
    src, dst = weightsync.open_repo(s3_url), weightsync.open_repo(s3_url + "-region")
    weightsync.publish(traj[0], src)
    stop = threading.Event()
    done: list = []
    t = threading.Thread(target=lambda: done.append(mirror(src, dst, True, MirrorConfig(interval=0.05), stop)))
    t.start()
    try:
        wait_for(lambda: dst.head_version() == 0, 60, "the region at version 0")
        mark = len(proxy.answers)
        wait_for(lambda: len(head_answers(proxy, mark)) >= 20, 60, "twenty polls of the heads")
        polls = head_answers(proxy, mark)
        # the mirror's own head move is read back once (200, its tag changed), among the first reads after
        # the mark (which may fall between a poll's read of the source head and of the destination's);
        # every other read is a 304
        moved = [i for i, p in enumerate(polls) if p != ("GET", 304, 0)]
        assert len(moved) <= 1 and all(i <= 2 and polls[i][:2] == ("GET", 200) for i in moved), polls
        weightsync.publish(traj[1], src)
        wait_for(lambda: dst.head_version() == 1, 60, "the region at version 1")
    finally:
        stop.set()
        t.join(60)
    assert done and done[0].copied_versions == [0, 1]
