"""weightsync.service.heads in process: the head reader's outcomes and sequence numbers, its long poll,
and what a follower takes from a leader's answers (a real aiohttp leader for the wait itself)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from aiohttp import web

from weightsync.errors import FormatError
from weightsync.format.keys import HEAD_KEY
from weightsync.format.manifest import head_to_json
from weightsync.service.heads import HeadReader, LeaderError, LeaderFeed
from weightsync.store import MemoryStore
from weightsync.store.repo import Repo


@pytest.fixture
def repo(request):
    return Repo(MemoryStore(request.node.name))


def move(repo: Repo, version: int, raw: bytes | None = None) -> None:
    _, etag = repo.head()
    repo.store.put_if_match(HEAD_KEY, raw or head_to_json(version), etag)


def test_outcomes_and_seq(repo):
    counted: list[str] = []
    reader = HeadReader(repo, counted.append)
    start = reader.state.seq
    assert reader.read() is None and reader.state.seq == start + 1  # the first read is news, even of no head
    assert reader.read() is None and reader.state.seq == start + 1
    move(repo, 0)
    assert reader.read() == 0 and reader.read() == 0 and reader.state.seq == start + 2
    move(repo, 0, head_to_json(0) + b"\n")  # rewritten, same version: read whole, no news
    assert reader.read() == 0 and reader.state.seq == start + 2
    move(repo, 1)
    assert reader.read() == 1 and reader.state.seq == start + 3 and reader.state.read_at is not None
    assert counted == ["changed", "unchanged", "changed", "unchanged", "changed", "changed"]  # no head, still none
    move(repo, 2, b"not json")
    with pytest.raises(FormatError):
        reader.read()
    assert counted[-1] == "error" and reader.state.version == 1


def test_two_readers_of_one_store_start_at_different_seqs(repo):
    assert HeadReader(repo, lambda o: None).state.seq != HeadReader(repo, lambda o: None).state.seq


def test_wait_holds_until_the_head_moves_and_close_releases_it(repo):
    move(repo, 3)
    reader = HeadReader(repo, lambda o: None)

    async def main():
        reader.attach(asyncio.get_running_loop())
        await asyncio.to_thread(reader.read)
        seq = reader.state.seq
        assert (await reader.wait(None, 30)).seq == seq  # no after: at once
        assert (await reader.wait(seq - 1, 30)).seq == seq  # another seq (a restarted leader's): at once
        assert (await reader.wait(seq, 0.05)).seq == seq  # nothing new within the wait
        held = asyncio.create_task(reader.wait(seq, 60))
        await asyncio.sleep(0)
        assert not held.done()
        move(repo, 4)
        await asyncio.to_thread(reader.read)  # a read in another thread wakes the waiter
        got = await asyncio.wait_for(held, 30)
        assert (got.version, got.seq) == (4, seq + 1)
        held = asyncio.create_task(reader.wait(got.seq, 60))
        await asyncio.sleep(0)
        reader.close()  # the API shuts down: held polls answer
        assert (await asyncio.wait_for(held, 30)).seq == got.seq
        assert reader.doc("file:///s", "me") == {
            "store": "file:///s",
            "id": "me",
            "version": 4,
            "seq": got.seq,
            "read_at": got.read_at,
        }

    asyncio.run(main())


@pytest.mark.parametrize(
    "doc, why",
    [
        ([], "no integer seq"),
        ({"store": "s", "seq": True}, "no integer seq"),
        ({"store": "s", "seq": -1}, "no integer seq"),
        ({"store": "s", "seq": "7"}, "no integer seq"),
        ({"store": "other", "seq": 7}, "follows 'other'"),
        ({"store": "s", "seq": 7, "id": "me"}, "is this subscriber itself"),
    ],
)
def test_a_follower_refuses_answers_it_cannot_use(doc, why):
    feed = LeaderFeed("http://leader:1", "s", 1.0, own_id="me")
    with pytest.raises(LeaderError, match=why):
        feed._news(doc)
    assert feed.seq is None


def test_news_counts_changes_of_seq_after_the_first_answer():
    counted, ups = [], []
    feed = LeaderFeed("http://leader:1", "s", 1.0, own_id="me", count=counted.append, up=ups.append)
    for seq in (5, 5, 6, 6, 2):
        feed._news({"store": "s", "seq": seq, "id": "leader", "version": 99})
    assert counted == ["leader", "leader"] and feed.seq == 2 and ups == [True] * 5


class InstantLeader:
    """A leader that answers every long poll at once, with news each time (a liar's best attack)."""

    def __init__(self):
        self.calls = 0
        self._loop = asyncio.new_event_loop()
        ready = threading.Event()

        async def head(request: web.Request) -> web.Response:
            self.calls += 1
            return web.json_response({"store": "s", "id": "liar", "version": 10**9, "seq": self.calls})

        async def main():
            app = web.Application()
            app.router.add_get("/v1/head", head)
            self._runner = web.AppRunner(app)
            await self._runner.setup()
            site = web.TCPSite(self._runner, "127.0.0.1", 0)
            await site.start()
            self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
            ready.set()

        self._thread = threading.Thread(
            target=lambda: (self._loop.run_until_complete(main()), self._loop.run_forever()), daemon=True
        )
        self._thread.start()
        assert ready.wait(10)

    def close(self):
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


def test_a_leader_answering_at_once_is_taken_at_most_once_per_gap():
    leader = InstantLeader()
    interval = 0.2  # shorter than LEADER_GAP: the gap is the interval

    async def main():
        feed = LeaderFeed(leader.url, "s", interval)
        wake = asyncio.Event()
        start = time.monotonic()
        for _ in range(4):
            await feed.wait(wake)
        elapsed = time.monotonic() - start
        await feed.close()
        return feed, elapsed

    try:
        feed, elapsed = asyncio.run(main())
    finally:
        leader.close()
    assert leader.calls == 4 and feed.ok and feed.seq == 4
    assert elapsed >= 3 * interval  # a lower bound set by the waits (sleeps never end early)


def test_a_wake_ends_a_held_long_poll():
    async def main():
        # a leader that holds every poll (a real subscriber's /v1/head with nothing new)
        reader = HeadReader(Repo(MemoryStore("held")), lambda o: None)
        reader.attach(asyncio.get_running_loop())

        async def head(request):
            after = request.query.get("after")
            await reader.wait(None if after is None else int(after), float(request.query["wait"]))
            return web.json_response(reader.doc("memory://held", "leader"))

        app = web.Application()
        app.router.add_get("/v1/head", head)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        feed = LeaderFeed(url, "memory://held", 0.01)
        wake = asyncio.Event()
        await feed.wait(wake)  # the first answer comes at once (no after yet)
        held = asyncio.create_task(feed.wait(wake))
        await asyncio.sleep(0.05)
        assert not held.done()  # held by the leader (LEADER_WAIT is 30 s)
        wake.set()
        await asyncio.wait_for(held, 10)
        await feed.close()
        reader.close()
        await runner.cleanup()

    asyncio.run(main())
