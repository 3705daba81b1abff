"""Watching and stopping a long operation: one :class:`Observer` for progress, transfers and
cancellation, passed once (as s3transfer's subscribers). Publish, pull, partial pulls and the torch
sink call its hooks as they run; the base class's do nothing, so a subclass overrides what it needs
(the CLI's tqdm bars, :class:`~weightsync.service.progress.Progress`; the daemons' stop token)::

    class Stop(Observer):
        def check(self):
            if stopping.is_set():
                raise Stopped()

    weightsync.pull(store, folder, observer=Stop())
"""

from __future__ import annotations

import time
from collections.abc import Callable

from weightsync.errors import UsageError


class Observer:
    """Hooks an operation calls while it runs (the base class's do nothing).

    Threads: :meth:`on_phase`, :meth:`on_progress` and :meth:`on_done` are called from the thread
    that called the operation; :meth:`on_transfer` from the transfer threads (``ws-upload-*``,
    ``ws-fetch-*``), several at once; :meth:`check` from any of these and from the decode threads
    (``ws-work-*``). Whatever a hook raises aborts the operation and reaches its caller.
    """

    def on_phase(self, name: str, total_bytes: int) -> None:
        """A phase with a byte total starts: ``"encode"`` (publish: the bytes of the segments to read,
        diff and encode), ``"fetch"`` (pull, partial pull, torch sink prepare: the chunk bytes to
        download; they are reported by :meth:`on_transfer`, not :meth:`on_progress`), ``"write"``
        (pull, partial pull: the bytes of the files to rebuild) or ``"stage"`` (torch sink prepare:
        the bytes of the changed tensors)."""

    def on_progress(self, nbytes: int) -> None:
        """``nbytes`` more of the current phase are done (a segment encoded, a file written, a tensor
        staged)."""

    def on_transfer(self, nbytes: int) -> None:
        """``nbytes`` were uploaded to the store or downloaded from it (a chunk, or ranges of one)."""

    def on_done(self, seconds: dict[str, float]) -> None:
        """The operation succeeded; ``seconds`` are its result's timings (not called on failure)."""

    def check(self) -> None:
        """Raise (the caller's own exception) to cancel the operation. Called after every report and
        before each segment is decoded; an operation stops before it commits or installs anything,
        or finishes if it is past that point."""


class Callbacks(Observer):
    """The ``progress(done, total)`` and ``on_bytes(nbytes)`` callables that ``publish`` and ``pull``
    took before observers (kept for one release): ``progress`` gets the bytes done of the current
    phase and its total after each step, ``on_bytes`` each transfer."""

    def __init__(
        self, progress: Callable[[int, int], None] | None = None, on_bytes: Callable[[int], None] | None = None
    ):
        self._progress, self._on_bytes = progress, on_bytes
        self._done = self._total = 0

    def on_phase(self, name: str, total_bytes: int) -> None:
        self._done, self._total = 0, total_bytes

    def on_progress(self, nbytes: int) -> None:
        self._done += nbytes
        if self._progress is not None:
            self._progress(self._done, self._total)

    def on_transfer(self, nbytes: int) -> None:
        if self._on_bytes is not None:
            self._on_bytes(nbytes)


def observer_of(observer: Observer | None, legacy: dict[str, Callable | None]) -> Observer | None:
    """``observer``, or the deprecated ``progress=``/``on_bytes=`` keywords (``legacy``) as one."""
    unknown = set(legacy) - {"progress", "on_bytes"}
    if unknown:
        raise TypeError(f"unexpected keyword argument {sorted(unknown)[0]!r}")
    if not any(v is not None for v in legacy.values()):
        return observer
    if observer is not None:
        raise UsageError("pass observer=, or the older progress=/on_bytes=, not both")
    return Callbacks(legacy.get("progress"), legacy.get("on_bytes"))


class Operation:
    """One operation as its observer sees it: forwards each report and then runs
    :meth:`Observer.check`, and keeps the operation's clock (``started``, ``time.perf_counter()``)."""

    def __init__(self, observer: Observer | None = None):
        self.observer = observer if observer is not None else Observer()
        self.started = time.perf_counter()

    def elapsed(self) -> float:
        """Seconds since the operation started."""
        return time.perf_counter() - self.started

    def restart(self) -> None:
        """Start the clock again (the operation starts over from scratch)."""
        self.started = time.perf_counter()

    def phase(self, name: str, total_bytes: int) -> None:
        self.observer.on_phase(name, total_bytes)

    def progress(self, nbytes: int) -> None:
        self.observer.on_progress(nbytes)
        self.observer.check()

    def transferred(self, nbytes: int) -> None:
        self.observer.on_transfer(nbytes)
        self.observer.check()

    def check(self) -> None:
        self.observer.check()

    def done(self, seconds: dict[str, float]) -> None:
        self.observer.on_done(seconds)
