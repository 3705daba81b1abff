"""Head polling of the subscriber (issue 19, docs/OPERATIONS.md "One head poller per replica").

:class:`HeadReader` reads the store's head conditionally (an unchanged head is one small request
without a body, a ``304`` on S3) and publishes what it read to the followers that long-poll
``GET /v1/head``. :class:`LeaderFeed` is a follower's side (``--head-from``): it waits on a leader
subscriber's ``/v1/head`` instead of sleeping between polls, and falls back to polling the store
while the leader does not answer. The leader only says *when* to look: the follower then reads the
head itself, and everything else from the store with the usual checks.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import threading
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass

from weightsync.service.runtime import event
from weightsync.store.repo import Repo

log = logging.getLogger("weightsync.subscriber")

LEADER_WAIT = 30.0  # seconds a follower's long poll is held; with no news it then reads the head itself
LEADER_GRACE = 5.0  # seconds past the wait after which a leader that has not answered counts as down
MAX_ANSWER = 64 << 10  # bytes of a leader's answer read at most (a head answer is ~150)
LEADER_GAP = 1.0  # a follower takes the leader's answers at most this often (or every poll interval if shorter)


@dataclass(frozen=True)
class HeadState:
    """The head as last read: ``version`` (None: no head yet), ``seq`` (an opaque number, random at
    start so that a restarted leader never repeats one its followers hold, bumped by the first read
    and whenever the version read differs from the one before) and ``read_at`` (unix time of the last
    successful read, None before it)."""

    version: int | None
    seq: int
    read_at: float | None


class HeadReader:
    """Conditional reads of ``repo``'s head, shared by a subscriber's loop, its idle standby copy and
    the leader refresh (thread-safe: one read at a time, so a slow read never overwrites a newer one).
    ``count(outcome)`` counts each read (``changed``, ``unchanged``, ``error``)."""

    def __init__(self, repo: Repo, count: Callable[[str], None], clock: Callable[[], float] = time.time):
        self.repo, self._count, self.clock = repo, count, clock
        self._lock = threading.Lock()
        self._etag: str | None = None
        self.state = HeadState(None, random.randrange(1, 1 << 40), None)
        self.read_mono = float("-inf")  # time.monotonic() of the last successful read
        self._loop: asyncio.AbstractEventLoop | None = None
        self._changed: asyncio.Event | None = None
        self._closed = False

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Wake the waiters of :meth:`wait` (which run on ``loop``) when the head moves."""
        self._loop, self._changed, self._closed = loop, asyncio.Event(), False

    def read(self) -> int | None:
        """The head version, read now (blocking: one conditional request; a worker thread's call)."""
        with self._lock:
            try:
                got = self.repo.head_if_changed(self._etag)
            except Exception:
                self._count("error")
                raise
            still_missing = got == (None, None) and self._etag is None and self.state.read_at is not None
            self._count("unchanged" if got is None or still_missing else "changed")
            version = self.state.version
            if got is not None:
                version, self._etag = got
            seq = self.state.seq + (version != self.state.version or self.state.read_at is None)
            moved = seq != self.state.seq
            self.state = HeadState(version, seq, self.clock())
            self.read_mono = time.monotonic()
        if moved and self._loop is not None:
            with suppress(RuntimeError):  # the loop closed meanwhile: no one waits
                self._loop.call_soon_threadsafe(self._pulse)
        return version

    def _pulse(self) -> None:
        if self._changed is not None:
            changed, self._changed = self._changed, asyncio.Event()
            changed.set()

    def close(self) -> None:
        """Answer every held :meth:`wait` now, and later ones at once (the API is shutting down)."""
        self._closed = True
        self._pulse()

    async def wait(self, after: int | None, seconds: float) -> HeadState:
        """The head state once its ``seq`` differs from ``after`` (at once if it does, or if ``after`` is
        None), or after ``seconds`` with no change (``GET /v1/head``'s long poll)."""
        if after is None or after != self.state.seq or self._closed or self._changed is None:
            return self.state
        with suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._changed.wait(), seconds)
        return self.state

    def doc(self, store: str, subscriber: str) -> dict:
        """The ``GET /v1/head`` answer of subscriber ``subscriber`` (its id)."""
        s = self.state
        return {"store": store, "id": subscriber, "version": s.version, "seq": s.seq, "read_at": s.read_at}


class LeaderError(Exception):
    """The leader's answer could not be used (unreachable, an error status, not a head answer, another store)."""


class LeaderFeed:
    """A follower's wait between polls (``--head-from URL``): a long poll of the leader subscriber's
    ``GET /v1/head`` instead of a sleep. Any answer ends the wait (a new head, or none within
    :data:`LEADER_WAIT`: the follower then reads the head itself either way); answers are taken at
    most once per :data:`LEADER_GAP` or ``interval``, whichever is shorter (a leader that answers at
    once, or lies about news, makes the follower read the head at most that often). A leader that
    fails (unreachable, a bad answer, another store, this subscriber itself: ``own_id``) is logged
    once per outage and the follower polls the store every ``interval`` meanwhile, asking the leader
    again before each poll. ``token``: the bearer token sent (the follower's own API token).
    ``count(outcome)`` counts news from the leader (``leader``); ``up(ok)`` reports whether the
    leader answers."""

    def __init__(
        self,
        url: str,
        store: str,
        interval: float,
        *,
        own_id: str | None = None,
        token: str | None = None,
        count: Callable[[str], None] = lambda outcome: None,
        up: Callable[[bool], None] = lambda ok: None,
        wait: float = LEADER_WAIT,
        grace: float = LEADER_GRACE,
    ):
        self.url, self.store, self.interval, self.own_id = url.rstrip("/"), store, interval, own_id
        self._headers = {} if token is None else {"Authorization": f"Bearer {token}"}
        self._count, self._up = count, up
        self.long_wait, self.grace = wait, grace
        self.ok = True  # optimistic at start: the first call finds out
        self.seq: int | None = None  # the leader's seq last seen
        self.last_error: str | None = None
        self._answered = float("-inf")  # monotonic time the last answer taken ended a wait
        self._session = None

    def status(self) -> dict:
        """The ``head_from`` part of ``GET /v1/status``."""
        return {"url": self.url, "ok": self.ok, "seq": self.seq, "error": self.last_error}

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def wait(self, wake: asyncio.Event) -> None:
        """Until the leader answers (taken at most once per :data:`LEADER_GAP`), or ``interval`` when it
        fails, or until ``wake`` is set (an API request, a stop)."""
        start = time.monotonic()
        request = asyncio.ensure_future(self._ask(self.long_wait if self.ok else 0.0))
        woken = asyncio.ensure_future(wake.wait())
        try:
            await asyncio.wait({request, woken}, return_when=asyncio.FIRST_COMPLETED)
            if not request.done():
                return  # woken: the loop runs now; the held poll is dropped
            until, taken = self._answered + min(self.interval, LEADER_GAP), True
            try:
                self._news(request.result())
            except LeaderError as exc:
                self._failed(str(exc))
                until, taken = start + self.interval, False  # poll the store as without a leader
            left = until - time.monotonic()
            if left > 0:
                with suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(asyncio.shield(woken), left)
            if taken:
                self._answered = time.monotonic()  # when this answer ends the wait
        finally:
            for task in (request, woken):
                task.cancel()
            for task in (request, woken):
                with suppress(asyncio.CancelledError, Exception):
                    await task

    async def _ask(self, seconds: float) -> dict:
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession(headers=self._headers)
        query = {"wait": f"{seconds:g}"} | ({} if self.seq is None else {"after": str(self.seq)})
        timeout = aiohttp.ClientTimeout(total=seconds + (self.grace if self.ok else min(self.grace, self.interval)))
        try:
            async with self._session.get(
                f"{self.url}/v1/head", params=query, timeout=timeout, allow_redirects=False
            ) as resp:  # never redirected: the token goes to the leader only
                body = await resp.content.read(MAX_ANSWER + 1)
                if len(body) > MAX_ANSWER:
                    raise LeaderError(f"GET {self.url}/v1/head: an answer of more than {MAX_ANSWER} bytes")
                if resp.status != 200:
                    raise LeaderError(f"GET {self.url}/v1/head: HTTP {resp.status}: {body[:200]!r}")
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as exc:
            raise LeaderError(f"GET {self.url}/v1/head: {type(exc).__name__}: {exc}") from None
        try:
            doc = json.loads(body)
        except (ValueError, RecursionError):
            raise LeaderError(f"GET {self.url}/v1/head: the answer is not JSON") from None
        return doc

    def _news(self, doc: object) -> None:
        """Take in an answer (raises LeaderError when it is no head answer of our store)."""
        seq = doc.get("seq") if isinstance(doc, dict) else None
        if type(seq) is not int or seq < 0:
            raise LeaderError(f"GET {self.url}/v1/head: not a head answer (no integer seq)")
        if self.own_id is not None and doc.get("id") == self.own_id:
            raise LeaderError(f"the leader {self.url} is this subscriber itself ({self.own_id})")
        if doc.get("store") != self.store:
            raise LeaderError(
                f"the leader {self.url} follows {doc.get('store')!r}, not this subscriber's store {self.store}"
            )
        if not self.ok:
            event(log, "the head leader answers again; waiting on it instead of polling the store", leader=self.url)
        self.ok, self.last_error = True, None
        self._up(True)
        if seq != self.seq:
            if self.seq is not None:
                self._count("leader")
            self.seq = seq

    def _failed(self, why: str) -> None:
        if self.ok:
            event(
                log,
                "the head leader does not answer; polling the store until it does",
                logging.WARNING,
                leader=self.url,
                error=why,
            )
        self.ok, self.last_error = False, why
        self._up(False)
