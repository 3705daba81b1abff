"""Scratch folders a killed process does not leak: :class:`ScratchDir`.

A publisher without a cache rebuilds its whole delta base in a temporary folder, a sink spools the
payloads it fetches, an in-process publisher mirrors the model in ``/dev/shm``: a process killed
(SIGKILL, the OOM killer) leaves them behind, and the next start makes another. Each scratch folder
is therefore claimed by its process with a :class:`~weightsync.local.lock.FolderLock` (``flock``,
dropped by the kernel when the process dies), and every new one first removes the folders of its
kind, in the same parent and of the same user, whose claim is no longer held.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import stat
import tempfile
from pathlib import Path

from weightsync.local.lock import LOCK, FolderLock
from weightsync.local.state import state_dir

log = logging.getLogger("weightsync.scratch")


class ScratchDir:
    """A new folder ``PREFIX*`` under ``parent`` (the temp folder by default), claimed by this
    process until :meth:`close` removes it; a context manager that gives its path."""

    def __init__(self, prefix: str, what: str, parent: str | os.PathLike | None = None):
        root = Path(parent) if parent is not None else Path(tempfile.gettempdir())
        root.mkdir(parents=True, exist_ok=True)
        sweep(root, prefix)
        self.path = Path(tempfile.mkdtemp(prefix=prefix, dir=root))
        self._lock: FolderLock | None = FolderLock(self.path, what)
        try:
            self._lock.acquire()
        except BaseException:
            shutil.rmtree(self.path, ignore_errors=True)
            raise

    def close(self) -> None:
        """Remove the folder (idempotent)."""
        if self._lock is not None:
            shutil.rmtree(self.path, ignore_errors=True)  # still claimed: no sweeper takes it meanwhile
            self._lock.release()
            self._lock = None

    def __enter__(self) -> Path:
        return self.path

    def __exit__(self, *exc) -> None:
        self.close()


def sweep(parent: Path, prefix: str) -> list[Path]:
    """Remove the ``prefix*`` folders in ``parent`` that are this user's and whose claim no process
    holds (its holder died); the removed ones. A folder whose claim was never written (its
    process is between creating it and locking it), or that is not claimed at all, is left."""
    removed = []
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return removed
    for entry in entries:
        if not entry.name.startswith(prefix):
            continue
        folder = Path(entry.path)
        try:
            st = os.lstat(folder)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
                continue
            sdir = state_dir(folder)
            if not stat.S_ISDIR(os.lstat(sdir).st_mode):  # not through a link
                continue
            fd = os.open(sdir / LOCK, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            if not os.pread(fd, 1, 0):  # the holder writes its name just after it locks
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # held: in use
                continue
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
        finally:
            os.close(fd)
    if removed:
        log.info("removed %d scratch folder(s) left by processes that died: %s", len(removed), removed[:3])
    return removed
