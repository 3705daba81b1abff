"""A subscriber's A/B slots: the ``current`` symlink, the version each slot holds, and when the
standby slot may be refilled in place (after the swap hook succeeded, or ``hold`` seconds without
one; docs/DESIGN.md gives the rule and why)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from weightsync.errors import UsageError
from weightsync.local.state import STATE_DIR, fsync_dir, read_state
from weightsync.store import same_store
from weightsync.sync.selection import STATE as PARTIAL_STATE
from weightsync.sync.selection import read_partial_state


class Slots:
    """The A/B slots of a target folder and the ``current`` symlink that names one of them."""

    NAMES = ("a", "b")

    def __init__(self, root: Path):
        self.root = Path(root)
        self.link = self.root / "current"

    def path(self, name: str) -> Path:
        """The folder of slot ``name`` (``a`` or ``b``)."""
        return self.root / "slots" / name

    def current(self) -> str | None:
        """The slot ``current`` points at; None if there is no ``current`` yet."""
        try:
            dest = os.readlink(self.link)
        except FileNotFoundError:
            return None
        except OSError:
            raise UsageError(f"{self.link} exists and is not a symlink; refusing to manage {self.root}") from None
        for name in self.NAMES:
            if dest == f"slots/{name}":
                return name
        raise UsageError(f"{self.link} points at {dest!r}, not at slots/a or slots/b")

    def standby(self) -> str:
        """The slot ``current`` does not point at."""
        return "b" if self.current() == "a" else "a"

    def flip(self, name: str) -> None:
        """Point ``current`` at slot ``name`` atomically (new symlink, then rename over the old)."""
        tmp = self.root / f".current-{os.getpid()}"
        tmp.unlink(missing_ok=True)
        os.symlink(f"slots/{name}", tmp)
        os.replace(tmp, self.link)
        fsync_dir(self.root)


def slot_version(folder: Path, partial: bool, store: str | None = None) -> int | None:
    """The version a slot holds in the given mode (None if empty, filled in the other mode, or, given
    ``store``, filled from another store: a subscriber restarted with another ``--store`` served the
    old store's bytes as the new store's version of that number)."""
    state = read_partial_state(folder) if partial else None
    if not partial:
        if (folder / STATE_DIR / PARTIAL_STATE).exists():
            return None
        state = read_state(folder)
    if state is None or (store is not None and not same_store(state.store, store)):
        return None
    return state.version


class StandbyRelease:
    """Whether the standby slot's files may be overwritten in place (see the module doc). Swaps are
    numbered; a hook outcome counts only for the swap it was fired for."""

    def __init__(self, hold: float | None, hooked: bool, clock: Callable[[], float] = time.monotonic):
        self.hold, self.hooked, self.clock = hold, hooked, clock
        self.since = clock()  # nothing is known about swaps before this process started
        self.swaps = 0
        self.confirmed = 0  # the last swap whose hook succeeded (0: none)

    def swapped(self) -> int:
        """The slot that served until now became the standby; returns this swap's number."""
        self.since = self.clock()
        self.swaps += 1
        return self.swaps

    def confirm(self, swap: int) -> None:
        """The hook fired for swap number ``swap`` succeeded."""
        self.confirmed = max(self.confirmed, swap)

    def free(self) -> bool:
        """Whether the standby slot may be refilled in place now (the rule in docs/DESIGN.md)."""
        if self.hold is None:
            return False
        if self.hooked:
            return self.swaps > 0 and self.confirmed == self.swaps
        return self.clock() - self.since >= self.hold
