"""A one-line progress bar on stderr, shown only when stderr is a terminal."""

from __future__ import annotations

import sys
import time


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


class Progress:
    def __init__(self, label: str, stream=None, interval: float = 0.1):
        self.label = label
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty()
        self.interval = interval
        self._last = 0.0
        self._t0 = time.perf_counter()

    def __call__(self, done: int, total: int) -> None:
        now = time.perf_counter()
        if not self.enabled or (now - self._last < self.interval and done < total):
            return
        self._last = now
        pct = 100.0 * done / total if total else 100.0
        rate = done / max(now - self._t0, 1e-9)
        self.stream.write(f"\r{self.label}: {pct:5.1f}% {human_bytes(done)} / {human_bytes(total)} ({human_bytes(rate)}/s)\x1b[K")
        if done >= total:
            self.stream.write("\n")
        self.stream.flush()
