"""Store requests in flight: which are running now and since when, so that a daemon can notice one
that hangs (a frozen endpoint answers nothing, and each attempt waits for its read timeout).
:class:`~weightsync.store.retry.RetryingStore` records every request, its retries included."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Running:
    """One request in flight: an id, the operation (``GET``, ``PUT``...), the key, the store's URL, and
    when it began (``started``: the monotonic clock; ``since``: unix seconds)."""

    id: int
    op: str
    key: str
    store: str
    started: float
    since: float


class InFlight:
    """The requests running now (thread-safe): :meth:`begin` and :meth:`end` around each one."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time):
        self.clock, self.wall = clock, wall
        self._running: dict[int, Running] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def begin(self, op: str, key: str, store: str) -> int:
        """A request starts; returns its id, for :meth:`end`."""
        with self._lock:
            rid = next(self._ids)
            self._running[rid] = Running(rid, op, key, store, self.clock(), self.wall())
            return rid

    def end(self, rid: int) -> None:
        """The request ``rid`` ended (answered, failed or given up)."""
        with self._lock:
            self._running.pop(rid, None)

    def older_than(self, seconds: float) -> list[Running]:
        """The requests running for more than ``seconds``, oldest first."""
        now = self.clock()
        with self._lock:
            return sorted((r for r in self._running.values() if now - r.started > seconds), key=lambda r: r.started)

    def __len__(self) -> int:
        with self._lock:
            return len(self._running)
