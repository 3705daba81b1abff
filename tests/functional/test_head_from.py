"""One head poller per replica (``--head-from``): follower subscribers wait on a leader subscriber's
``GET /v1/head`` and read the head themselves when it has news; a dead leader sends them back to
polling the store, and a lying one cannot make them install anything the store's head does not name.

Real daemons on a file store holding versions 0..5 (``published``); the test moves the store's head
itself (versions above it are interrupted publishes, which no subscriber may take). The lying leader
is a real HTTP server that answers what a hostile or broken leader would.
"""

from __future__ import annotations

import asyncio
import signal
import threading
from pathlib import Path

import pytest
from test_daemons import Daemon, free_port, http, verify_current, wait_for

from weightsync.format.keys import HEAD_KEY
from weightsync.format.manifest import head_to_json
from weightsync.store import FileStore
from weightsync.store.repo import Repo

STILL = "600"  # a follower's poll interval that never fires within a test: only the leader's news moves it


def set_head(store: Path, version: int) -> None:
    """Move the store's head to ``version`` (a manifest of it exists), as a publisher's commit does."""
    repo = Repo(FileStore(store))
    _, etag = repo.head()
    repo.store.put_if_match(HEAD_KEY, head_to_json(version), etag)


def metric(d: Daemon, name: str, **labels) -> float:
    code, text, _ = d.get("/metrics")
    assert code == 200
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith(name + "{") and want in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name}{{{want}}} in the metrics of {d.role}")


def subscriber(tmp: Path, store: Path, name: str, *extra, poll: str = "0.1", port: int = 0) -> Daemon:
    d = Daemon("subscriber", ["--store", store, "--target", tmp / name, "--no-fsync", "--id", name, *extra], tmp)
    d.args[-1] = poll  # Daemon appends --poll-interval 0.1
    d.args[d.args.index("--listen") + 1] = f"127.0.0.1:{port}"
    return d


@pytest.fixture
def world(published, tmp_path):
    """The store (head moved back to 2) and its checkpoints; every daemon started is killed at the end."""
    store, traj = published
    set_head(store, 2)
    started: list[Daemon] = []

    def start(d: Daemon) -> Daemon:
        started.append(d)
        return d.start()

    yield store, traj, start
    for d in started:
        if d.proc and d.proc.poll() is None:
            d.proc.kill()
            d.proc.wait()


def test_a_follower_takes_head_news_from_its_leader(world, tmp_path):
    store, traj, start = world
    leader = start(subscriber(tmp_path, store, "leader"))
    follower = start(subscriber(tmp_path, store, "follower", "--head-from", leader.url, poll=STILL))
    for d in (leader, follower):
        d.wait_version(2)
    status = follower.status()["head_from"]
    assert status["url"] == leader.url and status["ok"] is True, status

    code, head, _ = leader.get("/v1/head")
    assert code == 200 and head["version"] == 2 and head["store"] == f"file://{store}", head
    code, held, _ = leader.get(f"/v1/head?after={head['seq']}&wait=0.2")  # nothing new: held, then the same
    assert code == 200 and held["seq"] == head["seq"] and held["version"] == 2
    code, err, _ = leader.get("/v1/head?after=-1")
    assert code == 400 and "after" in err["error"]

    reads = metric(follower, "weightsync_head_reads_total", outcome="unchanged")
    set_head(store, 4)  # the follower polls every 600 s: only the leader's news can move it
    leader.wait_version(4)
    follower.wait_version(4)
    verify_current(f"file://{store}", tmp_path / "follower", 4, traj[4])
    assert metric(follower, "weightsync_head_reads_total", outcome="leader") >= 1
    assert metric(follower, "weightsync_head_reads_total", outcome="changed") >= 2  # its own reads
    assert metric(follower, "weightsync_head_leader_up") == 1
    assert metric(follower, "weightsync_head_reads_total", outcome="unchanged") <= reads + 3
    assert metric(leader, "weightsync_head_reads_total", outcome="unchanged") > 0  # the leader's 304s
    assert follower.stop() == 0 and leader.stop() == 0


def test_a_follower_polls_the_store_while_its_leader_is_gone(world, tmp_path):
    store, traj, start = world
    port = free_port()
    leader = start(subscriber(tmp_path, store, "leader", port=port))
    follower = start(subscriber(tmp_path, store, "follower", "--head-from", leader.url, poll="0.2"))
    follower.wait_version(2)
    wait_for(lambda: follower.status()["head_from"]["seq"] is not None, 30, "the follower to hear from its leader")

    leader.stop(signal.SIGKILL)  # mid-way: the follower is in a long poll of it
    set_head(store, 3)
    follower.wait_version(3)  # from its own polls of the store
    verify_current(f"file://{store}", tmp_path / "follower", 3, traj[3])
    status = wait_for(lambda: (s := follower.status()["head_from"])["ok"] is False and s, 30, "the leader to be down")
    assert leader.url in status["url"] and status["error"], status
    assert metric(follower, "weightsync_head_leader_up") == 0
    set_head(store, 4)
    follower.wait_version(4)
    assert follower.log().count("the head leader does not answer") == 1  # logged once per outage

    leader.start()  # the same port: the follower waits on it again
    wait_for(lambda: follower.status()["head_from"]["ok"], 30, f"the follower to wait on its leader\n{follower.log()}")
    assert "the head leader answers again" in follower.log()
    assert metric(follower, "weightsync_head_leader_up") == 1
    set_head(store, 5)
    for d in (leader, follower):
        d.wait_version(5)
    verify_current(f"file://{store}", tmp_path / "follower", 5, traj[5])
    assert follower.stop() == 0 and leader.stop() == 0


class FakeLeader:
    """A real HTTP server answering ``GET /v1/head`` as a broken or hostile leader would (``mode``)."""

    def __init__(self, mode: str, store: str):
        from aiohttp import web

        self.mode, self.store, self.calls = mode, store, 0
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._loop = asyncio.new_event_loop()
        started = threading.Event()

        async def head(request: web.Request) -> web.Response:
            self.calls += 1
            if self.mode == "lies":  # news at once, every time, of versions above the head or that do not exist
                doc = {"store": self.store, "version": 5 if self.calls % 2 else 99, "seq": self.calls, "read_at": 0}
                return web.json_response(doc)
            if self.mode == "other store":
                return web.json_response({"store": "file:///elsewhere", "version": 5, "seq": self.calls})
            if self.mode == "garbage":
                return web.Response(text="<html>not a head</html>" if self.calls % 2 else '{"seq": "x"}')
            return web.json_response({"error": "broken"}, status=500)

        async def main() -> None:
            app = web.Application()
            app.router.add_get("/v1/head", head)
            self._runner = web.AppRunner(app)
            await self._runner.setup()
            await web.TCPSite(self._runner, "127.0.0.1", self.port).start()
            started.set()

        self._thread = threading.Thread(
            target=lambda: (self._loop.run_until_complete(main()), self._loop.run_forever()), daemon=True
        )
        self._thread.start()
        assert started.wait(10)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


def test_a_lying_leader_never_moves_a_follower_past_the_store_head(world, tmp_path):
    store, traj, start = world
    liar = FakeLeader("lies", f"file://{store}")
    try:
        follower = start(subscriber(tmp_path, store, "follower", "--head-from", liar.url, poll=STILL))
        follower.wait_version(2)
        wait_for(lambda: liar.calls >= 6, 60, "the follower to ask the liar a few times")
        s = follower.status()
        assert (s["current_version"], s["latest_version"]) == (2, 2) and s["standby_version"] in (None, 2), s
        assert s["head_from"]["ok"] is True  # well-formed lies: it still says when to look ...
        reads = sum(metric(follower, "weightsync_head_reads_total", outcome=o) for o in ("changed", "unchanged"))
        assert reads <= liar.calls + 2  # ... one read of its own per answer at most
        assert "version 5" not in follower.log() and "version 99" not in follower.log()
        set_head(store, 3)  # the truth moves: the next news (a lie) makes it look, and it finds 3
        follower.wait_version(3)
        verify_current(f"file://{store}", tmp_path / "follower", 3, traj[3])
        assert follower.status()["current_version"] == 3
        assert follower.stop() == 0
    finally:
        liar.close()


@pytest.mark.parametrize("mode", ["other store", "garbage", "error"])
def test_a_leader_that_cannot_be_used_sends_the_follower_to_the_store(world, tmp_path, mode):
    store, traj, start = world
    bad = FakeLeader(mode, f"file://{store}")
    try:
        follower = start(subscriber(tmp_path, store, "follower", "--head-from", bad.url, poll="0.2"))
        follower.wait_version(2)
        status = wait_for(lambda: (s := follower.status()["head_from"])["ok"] is False and s, 30, "a refusal")
        why = {"other store": "follows 'file:///elsewhere'", "garbage": "/v1/head", "error": "HTTP 500"}[mode]
        assert why in status["error"], status
        set_head(store, 4)
        follower.wait_version(4)
        verify_current(f"file://{store}", tmp_path / "follower", 4, traj[4])
        assert follower.log().count("the head leader does not answer") == 1
        assert follower.stop() == 0
    finally:
        bad.close()


def test_a_subscriber_never_follows_itself(world, tmp_path):
    store, _, start = world
    port = free_port()
    d = start(subscriber(tmp_path, store, "self", "--head-from", f"http://127.0.0.1:{port}", poll="0.2", port=port))
    d.wait_version(2)
    status = wait_for(lambda: (s := d.status()["head_from"])["ok"] is False and s, 30, "the refusal")
    assert "is this subscriber itself (self)" in status["error"], status
    set_head(store, 3)
    d.wait_version(3)  # polls the store instead
    assert d.stop() == 0


@pytest.mark.parametrize("url", ["ftp://host:1", "http://", "http://host:99999", "http://h:1/path", "http://u@h:1"])
def test_a_bad_head_from_url_is_one_line_and_exit_2(run_cli, tmp_path, url, ws):
    rc, out, err = run_cli("subscriber", "--store", tmp_path / "s", "--target", tmp_path / "t", "--head-from", url)
    assert rc == 2 and "--head-from" in ws.error_line(err), (rc, out, err)


def test_the_head_answer_is_json(world, tmp_path):
    store, _, start = world
    d = start(subscriber(tmp_path, store, "only"))
    d.wait_version(2)
    code, body, headers = http("GET", d.url + "/v1/head?wait=0")
    assert code == 200 and headers["Content-Type"].startswith("application/json")
    assert set(body) == {"store", "id", "version", "seq", "read_at"} and body["id"] == "only"
    assert d.stop() == 0


def test_followers_send_their_api_token_to_the_leader(world, tmp_path):
    store, _, start = world
    good, bad = "t0ken-of-the-replica", "another-t0ken"
    leader = subscriber(tmp_path, store, "leader")
    leader.env["WEIGHTSYNC_API_TOKEN"], leader.token = good, good
    start(leader)
    follower = subscriber(tmp_path, store, "follower", "--head-from", leader.url, poll="0.2")
    follower.env["WEIGHTSYNC_API_TOKEN"], follower.token = good, good
    stranger = subscriber(tmp_path, store, "stranger", "--head-from", leader.url, poll="0.2")
    stranger.env["WEIGHTSYNC_API_TOKEN"], stranger.token = bad, bad
    for d in (start(follower), start(stranger)):
        d.wait_version(2)
    assert http("GET", leader.url + "/v1/head")[0] == 401
    wait_for(lambda: follower.status()["head_from"]["seq"] is not None, 30, "the follower to hear from its leader")
    assert follower.status()["head_from"]["ok"] is True
    status = wait_for(lambda: (s := stranger.status()["head_from"])["ok"] is False and s, 30, "a 401")
    assert "HTTP 401" in status["error"], status
    set_head(store, 3)
    for d in (leader, follower, stranger):
        d.wait_version(3)
        assert d.stop() == 0
        assert good not in d.log() and bad not in d.log()
