"""Progress of long work: the command line's bars (publish, publish-part, pull), drawn by tqdm, and
the daemons' :class:`DaemonProgress` (status and byte counters as chunks move); both are
:class:`~weightsync.sync.observer.Observer` s.

A bar shows the bytes done of the total, the rate and the time left (ETA). It is drawn on stderr
when stderr is a terminal, and as a widget in a Jupyter notebook (``tqdm.auto``); never into a log,
a pipe or CI output. Off switches: ``--no-progress`` (``Progress(..., enabled=False)``) and tqdm's
own ``TQDM_DISABLE=1`` in the environment.
"""

from __future__ import annotations

import sys
import threading
import time

from weightsync.sync.observer import Observer


def human_bytes(n: float) -> str:
    """``n`` bytes for people: ``512 B``, ``1.5 MiB``..."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def ratio_text(raw: int, stored: int) -> str:
    """How many times smaller ``stored`` bytes are than ``raw``: ``125.4x``; ``-`` for none stored
    (nothing changed), where the quotient would be a meaningless million."""
    return f"{raw / stored:.1f}x" if stored else "-"


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """``n`` and ``noun``, plural (``noun`` + s unless given) unless ``n`` is 1: ``1 file``, ``3 files``."""
    return f"{n} {noun}" if n == 1 else f"{n} {plural or noun + 's'}"


def in_notebook() -> bool:
    """Whether this runs in a Jupyter kernel where tqdm draws widgets (cheap outside one)."""
    if "ipykernel" not in sys.modules:
        return False
    import tqdm.auto  # picks the notebook class, its warnings silenced
    from tqdm.autonotebook import tqdm

    return tqdm.__module__ == "tqdm.notebook"


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class Progress(Observer):
    """The observer of a publish, publish-part or pull that draws its phase (bytes encoded, or
    written) as one tqdm bar; also callable as ``progress(done, total)``.

    ``enabled``: None (default) draws when ``stream`` (stderr) is a terminal or in a notebook;
    False never draws; True always does. ``TQDM_DISABLE=1`` turns every bar off. Safe to call from
    several threads. The bar closes when ``done`` reaches ``total`` (or on :meth:`close`, or when
    the operation is done).
    """

    def __init__(self, label: str, stream=None, enabled: bool | None = None):
        self.label = label
        self.stream = stream or sys.stderr
        self.enabled = (_isatty(self.stream) or in_notebook()) if enabled is None else enabled
        self._bar = None
        self._lock = threading.Lock()
        self._done = self._total = 0

    def on_phase(self, name: str, total_bytes: int) -> None:
        self._done, self._total = 0, total_bytes

    def on_progress(self, nbytes: int) -> None:
        self._done += nbytes
        self(self._done, self._total)

    def on_done(self, seconds: dict[str, float]) -> None:
        self.close()

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        with self._lock:
            if self._bar is None:
                from tqdm.auto import tqdm

                # disable is not passed, so that TQDM_DISABLE (tqdm's environment default) applies
                self._bar = tqdm(
                    total=total,
                    desc=self.label,
                    unit="B",
                    unit_scale=True,
                    unit_divisor=1024,
                    file=self.stream,
                    leave=True,
                    dynamic_ncols=True,
                    mininterval=0.1,
                )
            bar = self._bar
            if total != bar.total:
                bar.total = total
            bar.update(done - bar.n)
            if done >= total:
                self._close()

    def close(self) -> None:
        """Close the bar (once the operation ended, or failed)."""
        with self._lock:
            self._close()

    def _close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class DaemonProgress(Observer):
    """The observer of a daemon's sync or publish: cancellation through ``stop`` (the daemon's stop
    token), every byte moved handed to ``on_bytes`` as its chunk lands (the bytes counters move during
    an hour-long first download, not at its end), and where the operation stands for ``/v1/status``
    (:meth:`doc`: phase, bytes done of the phase's total, bytes moved, start time). Thread-safe."""

    def __init__(self, stop: Observer, on_bytes, version: int | None, clock=time.time):
        self.stop, self.on_bytes, self.version = stop, on_bytes, version
        self.started = clock()
        self.phase, self.done, self.total, self.moved = "plan", 0, None, 0  # until the first phase starts
        self._lock = threading.Lock()

    def on_phase(self, name: str, total_bytes: int) -> None:
        with self._lock:
            self.phase, self.done, self.total = name, 0, total_bytes

    def on_progress(self, nbytes: int) -> None:
        with self._lock:
            self.done += nbytes

    def on_transfer(self, nbytes: int) -> None:
        with self._lock:
            self.moved += nbytes
            if self.phase == "fetch":  # the fetch phase's progress is its downloads
                self.done += nbytes
        self.on_bytes(nbytes)

    def check(self) -> None:
        self.stop.check()

    def doc(self) -> dict:
        """``progress`` in ``/v1/status``: version, phase, bytes_done, bytes_total (None: not known
        yet), transferred_bytes (downloaded or uploaded so far) and started (unix seconds)."""
        with self._lock:
            return {
                "version": self.version,
                "phase": self.phase,
                "bytes_done": self.done,
                "bytes_total": self.total,
                "transferred_bytes": self.moved,
                "started": self.started,
            }
