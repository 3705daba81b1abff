"""One writer per folder: :class:`FolderLock`, an exclusive ``flock`` on ``FOLDER/.weightsync/lock``
held across processes by pull, publish's cache and the subscriber's slots (docs/RELIABILITY.md,
"The target folder")."""

from __future__ import annotations

import fcntl
import os
import socket
import stat
import time
from pathlib import Path

from weightsync.errors import UsageError
from weightsync.local.state import private_dir, state_dir

LOCK = "lock"  # held (flock) by the one process that writes the folder; never removed


class FolderBusyError(UsageError):
    """Another process (or another lock in this one) writes the folder."""


class FolderLock:
    """An exclusive claim on one or more folders: one writer at a time, across processes.

    Each folder's ``.weightsync/lock`` file is locked with ``flock`` (released by the kernel when
    the process dies, so a crash never leaves a stale lock) and names its holder. A second claim
    fails at once with :class:`FolderBusyError` naming the holder. Long-lived holders (the
    subscriber daemon over its slots) pass the lock to the operations they run, which then do
    not lock again (:meth:`covers`). On release the lock file goes, so does an empty
    ``.weightsync``, and so does the folder if the claim created it and it is empty: a claim that
    fails leaves no trace. (A claimant checks that the file it locked is still the one at the path, so removing
    it never lets two in.)
    """

    def __init__(self, folders: list[Path] | Path, what: str):
        self.folders = [Path(f) for f in ([folders] if isinstance(folders, (str, os.PathLike)) else folders)]
        self.what = what
        self._held: dict[str, tuple[int, Path, list[Path]]] = {}  # realpath -> (fd, lock path, dirs we made)

    def acquire(self) -> FolderLock:
        """Take the lock; :class:`FolderBusyError` (one line, naming the holder) if another holds it."""
        try:
            for folder in self.folders:
                self._lock_one(folder)
        except BaseException:
            self.release()
            raise
        return self

    def _lock_one(self, folder: Path) -> None:
        if folder.exists() and not folder.is_dir():
            raise UsageError(f"{folder} exists and is not a directory")
        made = [d for d in (*reversed(folder.parents), folder) if not os.path.lexists(d)]
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UsageError(f"cannot create {folder}: {exc.strerror}") from None
        if not os.path.lexists(state_dir(folder)):
            made.append(state_dir(folder))
        try:
            path = private_dir(folder) / LOCK
            fd = self._open_locked(folder, path)
        except BaseException:
            _remove_empty(made)
            raise
        self._held[os.path.realpath(folder)] = (fd, path, made)

    def _open_locked(self, folder: Path, path: Path) -> int:
        while True:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
            except OSError as exc:
                raise UsageError(f"cannot open the lock {path}: {exc.strerror}") from None
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:  # a hard link to a file elsewhere: not ours
                    raise UsageError(f"{path} is not a regular file of its own (a hard link?); refusing to use it")
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    raise FolderBusyError(f"{folder} is in use by {_holder(fd)}; one writer per folder") from None
                if not _same_file(fd, path):
                    os.close(fd)  # its holder removed it as we opened it: lock the one there now
                    continue
                since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
                os.ftruncate(fd, 0)
                try:  # who holds it, for a claimant's message only: a full disk does not stop the claim
                    os.pwrite(
                        fd, f"{self.what} (pid {os.getpid()} on {socket.gethostname()}, since {since})\n".encode(), 0
                    )
                except OSError:
                    os.ftruncate(fd, 0)  # (a claimant then names "another process")
                return fd
            except BaseException:
                os.close(fd)
                raise

    def check(self) -> None:
        """Take the lock again on any folder whose lock file is no longer the one held (the folder
        or its ``.weightsync`` was removed by hand): FolderBusyError if another process took it."""
        for key, (fd, path, made) in list(self._held.items()):
            if _same_file(fd, path):
                continue
            os.close(fd)
            del self._held[key]
            folder = path.parent.parent
            folder.mkdir(parents=True, exist_ok=True)
            self._held[key] = (self._open_locked(folder, private_dir(folder) / LOCK), path, made)

    def covers(self, folder: Path) -> bool:
        """Whether this lock, held, is the claim on ``folder``."""
        return os.path.realpath(folder) in self._held

    def release(self) -> None:
        """Release the lock and remove what taking it created (lock file, empty ``.weightsync``, folder)."""
        for fd, path, made in self._held.values():
            if _same_file(fd, path):
                path.unlink()  # while still locked: a claimant that opened it retries on the new one
            os.close(fd)  # closing the last descriptor drops the flock
            _remove_empty([*made, path.parent] if path.parent not in made else made)  # an empty .weightsync too
        self._held.clear()

    def __enter__(self) -> FolderLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _holder(fd: int) -> str:
    """Who holds a lock, as its holder wrote it (which it does just after locking: wait a little)."""
    for _ in range(20):
        if text := os.pread(fd, 4096, 0).decode(errors="replace").strip():
            return text
        time.sleep(0.01)
    return "another process"


def _same_file(fd: int, path: Path) -> bool:
    try:
        a, b = os.fstat(fd), os.lstat(path)
    except FileNotFoundError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _remove_empty(dirs: list[Path]) -> None:
    """Remove the directories a claim made, innermost first, where they are (still) empty."""
    for d in reversed(dirs):
        try:
            d.rmdir()
        except OSError:
            return


class claim:
    """``with claim(folder, held, what):`` the caller's lock if it covers ``folder``, else a new
    :class:`FolderLock` on it for the duration."""

    def __init__(self, folder: Path, held: FolderLock | None, what: str):
        self._held = held
        self._lock = None if held is not None and held.covers(folder) else FolderLock(Path(folder), what)

    def __enter__(self) -> FolderLock:
        """The lock on the folder: the caller's, or the new one (pass it on to nested operations)."""
        if self._lock is None:
            return self._held
        return self._lock.acquire()

    def __exit__(self, *exc) -> None:
        if self._lock is not None:
            self._lock.release()
