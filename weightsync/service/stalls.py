"""Noticing a store that hangs: a thread that looks at the store requests in flight
(:class:`~weightsync.store.inflight.InFlight`) every few seconds and reports each one running past
``--stall-after`` seconds, its retries included: a WARNING when it stalls and a line when it ends, the
``weightsync_store_stalled_requests`` gauge and ``weightsync_store_stalls_total``, and the daemons'
``/v1/status`` (state ``stalled``). A frozen endpoint answers nothing; without this a daemon would
show its last state (``idle``, ``serving``) until the retries ran out, minutes later."""

from __future__ import annotations

import logging
import threading

from weightsync.service.runtime import event
from weightsync.store.inflight import InFlight, Running


class StallWatch:
    """Reports the requests of ``inflight`` running for more than ``after`` seconds (see the module doc)
    to ``metrics`` (a :class:`~weightsync.service.metrics.Metrics`) and ``logger``."""

    def __init__(
        self, inflight: InFlight, after: float, metrics, logger: logging.Logger, interval: float | None = None
    ):
        self.inflight, self.after, self.metrics, self.log = inflight, after, metrics, logger
        self.interval = interval if interval is not None else max(0.05, min(5.0, after / 4))
        self._reported: dict[int, Running] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def start(self) -> StallWatch:
        """Check every ``interval`` seconds from a daemon thread, until :meth:`stop`."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="stall-watch", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the thread (a check in progress finishes)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.check()

    def check(self) -> list[Running]:
        """Look once: report requests that stalled since the last look and those that ended; returns the
        stalled ones."""
        stalled = self.inflight.older_than(self.after)
        now = self.inflight.clock()
        with self._lock:
            ended = [r for rid, r in self._reported.items() if rid not in {s.id for s in stalled}]
            new = [r for r in stalled if r.id not in self._reported]
            self._reported = {r.id: r for r in stalled}
        self.metrics.store_stalled.set(len(stalled))
        for r in new:
            self.metrics.store_stalls.inc()
            event(
                self.log,
                f"store request stalled: {r.op} {r.store}/{r.key} has not completed after {now - r.started:.0f}s",
                logging.WARNING,
                op=r.op,
                key=r.key,
                store=r.store,
                seconds=f"{now - r.started:.1f}",
                stall_after=f"{self.after:g}",
            )
        for r in ended:
            event(
                self.log,
                f"stalled store request ended: {r.op} {r.store}/{r.key} after {now - r.started:.0f}s",
                op=r.op,
                key=r.key,
                store=r.store,
                seconds=f"{now - r.started:.1f}",
            )
        return stalled

    def stalled(self) -> list[dict]:
        """The requests running past ``after`` now, for a status document (oldest first)."""
        now = self.inflight.clock()
        return [
            {"op": r.op, "key": r.key, "store": r.store, "seconds": round(now - r.started, 1), "since": r.since}
            for r in self.inflight.older_than(self.after)
        ]

    def describe(self) -> str | None:
        """One line about the oldest stalled request (the status' reason), or None."""
        running = self.stalled()
        if not running:
            return None
        r = running[0]
        more = f" (and {len(running) - 1} more)" if len(running) > 1 else ""
        return (
            f"store request {r['op']} {r['store']}/{r['key']} has not completed after {r['seconds']:.0f}s"
            f"{more}; --stall-after {self.after:g}"
        )
