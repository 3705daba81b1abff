"""A local folder that holds one complete version: its state, verified reads, atomic updates.

Layout inside the folder (docs/FORMAT.md, "Local folders"): the version's files, and one hidden
``.weightsync`` directory with ``state.json`` (which version, from which store), ``journal.json``
while an update is being installed, ``staging/`` for the files being built and ``spool/`` for
verified downloaded chunks. An update is built entirely in ``staging/``, then a journal naming every
rename is written atomically, then the renames run. A kill before the journal leaves the old version
untouched; a kill after it is rolled forward by :func:`recover`, which every operation calls first.

A folder that nothing reads (a subscriber's standby slot) may instead be *refilled in place*:
``refill.json`` is written and ``state.json`` removed before the first byte changes, the files are
overwritten where they are (much cheaper than new files: their pages are already cached and
allocated), and ``state.json`` comes back last. A kill in between leaves a folder that claims no
version but is known to be weightsync's own (the marker), so the next refill overwrites it again.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import socket
import stat
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

from .checkpoint import read_range
from .errors import BaseMismatchError, ChecksumError, FormatError, UsageError, WeightsyncError
from .format import MAX_VERSION, FileEntry, Manifest, Segment, check_path

STATE_DIR = ".weightsync"
REFILL = "refill.json"  # present while a folder is being refilled in place
PARTIAL_STATE = "partial.json"  # a partial folder's state (weightsync.partial)
LOCK = "lock"  # held (flock) by the one process that writes the folder; never removed


@dataclass(frozen=True)
class LocalState:
    version: int
    store: str
    files: dict[str, tuple[int, str, int, int | None]]  # path -> (size, xxh3, mtime_ns, ctime_ns or None: not recorded)


def state_dir(folder: Path) -> Path:
    return Path(folder) / STATE_DIR


class FolderBusyError(UsageError):
    """Another process (or another lock in this one) writes the folder."""


def _own_dir(path: Path, create: bool) -> bool:
    """Whether ``path`` is a real directory (never a link), creating it with ``create``; refuses
    anything else standing there. Returns False if it is absent and not created."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        if not create:
            return False
        try:
            path.mkdir()
        except FileExistsError:
            pass  # created meanwhile: checked below
        except OSError as exc:
            raise UsageError(f"cannot create {path}: {exc.strerror}") from None
        st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise UsageError(f"{path} is not a directory of weightsync's own (a link or a file?); refusing to use it")
    return True


def private_dir(folder: Path, name: str | None = None, create: bool = True) -> Path | None:
    """``folder/.weightsync`` (or an entry ``name`` in it), checked to be a real directory and
    created if needed (else None if absent): local state is never written or read through a link."""
    sdir = state_dir(folder)
    if not _own_dir(sdir, create):
        return None
    if name is None:
        return sdir
    return sdir / name if _own_dir(sdir / name, create) else None


def safe_join(folder: Path, rel: str) -> Path:
    """``folder/rel`` for a path read from local state or a manifest: checked like a manifest path,
    and refused if a directory on the way is a link (it could lead out of the folder)."""
    try:
        check_path(rel)
    except FormatError as exc:
        raise UsageError(f"{folder}: {exc}") from None
    d = Path(folder)
    for part in rel.split("/")[:-1]:
        d = d / part
        try:
            if not stat.S_ISDIR(os.lstat(d).st_mode):
                raise UsageError(f"{d} is not a directory (a link?); refusing to go through it")
        except FileNotFoundError:
            break
    return Path(folder) / rel


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
                os.pwrite(fd, f"{self.what} (pid {os.getpid()} on {socket.gethostname()}, since {since})\n".encode(), 0)
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


def write_json_atomic(path: Path, doc: object, fsync: bool = True) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    with os.fdopen(fd, "w") as f:
        json.dump(doc, f)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)


def read_doc(path: Path, what: str) -> dict | None:
    """A JSON object of local state; None if absent; UsageError if it is anything else."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(st.st_mode):
        raise UsageError(f"{path}: {what} is not a regular file (a link?); remove {STATE_DIR} to start afresh")
    try:
        doc = json.loads(path.read_bytes())
    except (ValueError, RecursionError, OSError) as exc:
        raise UsageError(f"{path}: corrupt {what} ({type(exc).__name__}); remove {STATE_DIR} to start afresh") from None
    if not isinstance(doc, dict):
        raise UsageError(f"{path}: corrupt {what} (not an object); remove {STATE_DIR} to start afresh")
    return doc


def _version(v: object) -> int:
    if type(v) is not int or not 0 <= v <= MAX_VERSION:
        raise TypeError(f"version {v!r} is not an integer in 0..{MAX_VERSION}")
    return v


def read_state(folder: Path) -> LocalState | None:
    path = state_dir(folder) / "state.json"
    doc = read_doc(path, "weightsync state")
    if doc is None:
        return None
    try:
        files = {}
        for p, (size, digest, mtime, *ctime) in doc["files"].items():
            if len(ctime) > 1:
                raise ValueError(f"{p}: too many fields")
            files[check_path(p)] = (int(size), str(digest), int(mtime), int(ctime[0]) if ctime else None)
        return LocalState(_version(doc["version"]), str(doc["store"]), files)
    except (ValueError, KeyError, TypeError, AttributeError, WeightsyncError) as exc:
        raise UsageError(f"{path}: corrupt weightsync state ({exc}); remove {STATE_DIR} to start afresh") from None


def _read_journal(folder: Path) -> dict | None:
    """The journal of an interrupted install, every path in it checked; None if there is none."""
    path = state_dir(folder) / "journal.json"
    doc = read_doc(path, "install journal")
    if doc is None:
        return None
    try:
        journal = {
            "version": _version(doc["version"]),
            "store": str(doc["store"]),
            "install": [check_path(p) for p in doc["install"]],
            "remove": [check_path(p) for p in doc["remove"]],
            "files": {check_path(p): (int(size), str(digest)) for p, (size, digest) in doc["files"].items()},
        }
    except (ValueError, KeyError, TypeError, AttributeError, WeightsyncError) as exc:
        raise UsageError(f"{path}: corrupt install journal ({exc}); remove {STATE_DIR} to start afresh") from None
    if not set(journal["install"]) <= set(journal["files"]) or set(journal["remove"]) & set(journal["files"]):
        raise UsageError(f"{path}: corrupt install journal (it installs files its version lacks, or removes ones it has)")
    return journal


class TornInstallError(WeightsyncError):
    """An install could not complete: the folder now claims no version (the next pull rebuilds it)."""


def _apply_journal(folder: Path, journal: dict) -> None:
    """Run (or finish) the renames of ``journal``, then record its version. A staged file that is
    gone must already be in place (a rename done before a kill): its checksum says so; otherwise
    the folder is marked as holding no version and :class:`TornInstallError` is raised."""
    sdir = state_dir(folder)
    staging = sdir / "staging"
    private_dir(folder, "staging", create=False)  # a link there is refused
    for rel in journal["remove"]:  # first, so that a file may become a folder and back
        path = safe_join(folder, rel)
        if path.is_dir() and not path.is_symlink():
            raise UsageError(f"{path} is a folder weightsync did not put there (its version has a file there); "
                             "move it away first")
        path.unlink(missing_ok=True)
        _prune_dirs(folder, path.parent)
    for rel in journal["install"]:
        src, dst = safe_join(staging, rel), safe_join(folder, rel)
        if os.path.lexists(src):
            dst.parent.mkdir(parents=True, exist_ok=True)
            os.replace(src, dst)
        elif not _holds(dst, *journal["files"][rel]):
            _mark_torn(folder)
            raise TornInstallError(
                f"{folder}: the staged file {rel} of version {journal['version']} vanished before its install "
                f"(another process in {STATE_DIR}?); the folder now holds no version: pull again to rebuild it")
    files = {}
    for rel, (size, digest) in journal["files"].items():
        st = os.lstat(safe_join(folder, rel))
        if not stat.S_ISREG(st.st_mode) or st.st_size != size:
            _mark_torn(folder)
            raise TornInstallError(f"{folder}: {rel} is not the file version {journal['version']} installs; "
                                   "the folder now holds no version: pull again to rebuild it")
        files[rel] = (size, digest, st.st_mtime_ns, st.st_ctime_ns)
    write_json_atomic(sdir / "state.json", {"version": journal["version"], "store": journal["store"], "files": files})
    (sdir / "journal.json").unlink()
    (sdir / REFILL).unlink(missing_ok=True)  # a refill interrupted before this install replaced it
    shutil.rmtree(staging, ignore_errors=True)


def _holds(path: Path, size: int, digest: str) -> bool:
    """Whether ``path`` is a regular file with exactly these bytes."""
    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_size != size:
            return False
        return hash_file(path) == (size, digest)
    except OSError:
        return False


def open_regular(path: Path, follow: bool = True) -> int:
    """A read-only descriptor on ``path``, refused (OSError) unless it is a regular file: a FIFO or
    a device planted where a file should be is never read (the open does not block on it)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW))
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise IsADirectoryError(errno.EINVAL, "not a regular file", str(path))
    return fd


def hash_file(path: Path, block: int = 16 << 20) -> tuple[int, str]:
    """The size and xxh3-128 of a regular file's bytes, read once."""
    h, size = xxhash.xxh3_128(), 0
    with open(open_regular(path), "rb") as f:
        while buf := f.read(block):
            h.update(buf)
            size += len(buf)
    return size, h.hexdigest()


def _mark_torn(folder: Path) -> None:
    """The folder holds no complete version: it claims none, and is marked weightsync's own (the
    refill marker), so the next pull clears and rebuilds it instead of refusing a foreign folder."""
    sdir = state_dir(folder)
    write_json_atomic(sdir / REFILL, {"torn": True})
    (sdir / "state.json").unlink(missing_ok=True)
    (sdir / "journal.json").unlink(missing_ok=True)
    shutil.rmtree(sdir / "staging", ignore_errors=True)


def _prune_dirs(folder: Path, d: Path) -> None:
    while d != folder and d.is_dir() and not d.is_symlink() and not any(d.iterdir()):
        d.rmdir()
        d = d.parent


def recover(folder: Path) -> None:
    """Finish an interrupted install, or drop an unfinished staging area (spooled chunks stay).
    It writes: only a holder of the folder's lock may call it."""
    private_dir(folder)
    journal = _read_journal(folder)
    if journal is not None:
        _apply_journal(folder, journal)
    elif private_dir(folder, "staging", create=False):  # a link there is refused, not followed or removed
        shutil.rmtree(state_dir(folder) / "staging")


def interrupted(folder: Path) -> bool:
    """Whether an install into ``folder`` was interrupted and not yet finished (read-only)."""
    return os.path.lexists(state_dir(folder) / "journal.json")


def list_files(folder: Path) -> tuple[set[str], set[str]]:
    """Files (and links) under ``folder``, and every directory, skipping ``.weightsync``."""
    files, dirs = set(), set()
    for dirpath, dirnames, filenames in os.walk(folder):
        rel = os.path.relpath(dirpath, folder)
        prefix = "" if rel == "." else rel.replace(os.sep, "/") + "/"
        if rel == ".":
            dirnames[:] = [d for d in dirnames if d != STATE_DIR]
        for name in dirnames:
            if os.path.islink(os.path.join(dirpath, name)):
                files.add(prefix + name)  # a link to a directory is a stray entry, not a folder of ours
            else:
                dirs.add(prefix + name)
        files.update(prefix + name for name in filenames)
    return files, dirs


def stray_entries(folder: Path, expected: set[str]) -> list[str]:
    """Entries of ``folder`` that are neither ``expected`` files nor their parent directories."""
    parents = {p.rsplit("/", i)[0] for p in expected for i in range(1, p.count("/") + 1)}
    files, dirs = list_files(folder)
    links = {f for f in files & expected if os.path.islink(os.path.join(folder, f))}  # ours are regular files
    return sorted((files - expected) | (dirs - parents) | links)


def prepare_target(folder: Path, owned: bool = False) -> LocalState | None:
    """Create the folder if needed, recover, and refuse a folder holding anything weightsync does not
    own. An interrupted refill (:func:`begin_refill`) is kept as it is for the next refill
    (``owned``), else emptied. The caller holds the folder's lock (:func:`claim`)."""
    if folder.exists() and not folder.is_dir():
        raise UsageError(f"{folder} exists and is not a directory")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"cannot create {folder}: {exc.strerror}") from None
    recover(folder)
    state = read_state(folder)
    marker = state_dir(folder) / REFILL
    if marker.exists():
        if state is not None:  # killed before the first byte changed, or after the refill's state
            marker.unlink()
        elif owned:
            return None  # an interrupted refill: every file in it is weightsync's, to be overwritten
        else:  # ... and none of it a version: cleared for a pull that builds in staging
            empty_folder(folder)
            marker.unlink()
    if state is None and any(p.name != STATE_DIR for p in folder.iterdir()):
        raise UsageError(f"{folder} is not empty and holds no weightsync version; refusing to overwrite it")
    if state is not None and (stray := stray_entries(folder, set(state.files))):
        raise UsageError(f"{folder} holds entries weightsync did not put there ({', '.join(stray[:3])}); move them away first")
    return state


Snapshot = dict[str, tuple[int, ...]]  # path -> (mode, inode, size, mtime_ns, ctime_ns, nlink)


def snapshot(folder: Path) -> Snapshot:
    """What each entry of ``folder`` is (``.weightsync`` aside), cheaply (one lstat each): a file
    rewritten (even with its mtime set back: the ctime moves), replaced, added or removed changes
    it. Linking or unlinking another name of a file moves its ctime too (and its link count)."""
    files, dirs = list_files(folder)
    out = {}
    for rel in files:
        try:
            st = os.lstat(os.path.join(folder, rel))
        except FileNotFoundError:
            continue
        out[rel] = (stat.S_IFMT(st.st_mode), st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_nlink)
    return out


def snapshot_change(before: Snapshot, now: Snapshot) -> str | None:
    """How a folder changed between two snapshots, or None. A ctime that moved with the link count
    (a hard link made or dropped elsewhere: a backup, a clone) is no change of its bytes."""
    for rel in sorted(set(before) | set(now)):
        if rel not in before:
            return f"{rel} was added"
        if rel not in now:
            return f"{rel} was removed"
        a, b = before[rel], now[rel]
        if a[:2] != b[:2]:
            return f"{rel} was replaced"
        if a[2:4] != b[2:4] or (a[4] != b[4] and a[5] == b[5]):
            return f"{rel} was modified"
    return None


Recorded = dict[str, tuple[int, str, int | None, int | None]]  # path -> (size, xxh3, mtime_ns, ctime_ns) as installed


def installed_change(folder: Path, recorded: Recorded, snap: Snapshot) -> str | None:
    """How ``folder`` (as ``snap`` saw it) differs from the files its state records, or None. A
    file whose ctime alone moved is hashed to tell (a link count change, or a write that set its
    mtime back)."""
    for rel in sorted(set(snap) | set(recorded)):
        if rel not in recorded:
            return f"{rel} was added"
        if rel not in snap:
            return f"{rel} was removed"
        mode, _, size, mtime, ctime, _ = snap[rel]
        want_size, digest, want_mtime, want_ctime = recorded[rel]
        if mode != stat.S_IFREG or size != want_size or want_mtime not in (None, mtime):
            return f"{rel} was modified"
        if want_ctime not in (None, ctime) and not _holds(safe_join(folder, rel), size, digest):
            return f"{rel} was modified"
    return None


def disown(folder: Path) -> None:
    """Make ``folder`` claim no version (its files changed behind weightsync's back), keeping it
    marked as weightsync's own so that the next update rebuilds it; its files stay as they are."""
    sdir = state_dir(folder)
    write_json_atomic(sdir / REFILL, {"disowned": True})
    for name in ("state.json", PARTIAL_STATE):
        (sdir / name).unlink(missing_ok=True)


def empty_folder(folder: Path) -> None:
    """Remove every entry of ``folder`` but ``.weightsync`` (whose spool of verified chunks stays)."""
    for entry in folder.iterdir():
        if entry.name != STATE_DIR:
            _remove(entry)


def clear_folder(folder: Path) -> None:
    """Remove every entry of ``folder``, local state included, but its lock file (which a holder
    keeps: a new file would let a second writer in); creates the folder if needed."""
    folder.mkdir(parents=True, exist_ok=True)
    empty_folder(folder)
    sdir = state_dir(folder)
    if sdir.is_dir() and not sdir.is_symlink():
        for entry in sdir.iterdir():
            if entry.name != LOCK:
                _remove(entry)
        if not any(sdir.iterdir()):
            sdir.rmdir()
    elif os.path.lexists(sdir):
        sdir.unlink()


def _remove(entry: Path) -> None:
    shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()


def staging_dir(folder: Path) -> Path:
    """The folder's staging area (created, checked to be a real directory)."""
    return private_dir(folder, "staging")


def spool_dir(folder: Path) -> Path:
    """The folder's spool of verified downloaded chunks (created, checked to be a real directory)."""
    return private_dir(folder, "spool")


def install(folder: Path, manifest: Manifest, store_url: str, staged: list[str], fsync: bool = True) -> None:
    """Atomically make ``folder`` hold ``manifest``'s version: ``staged`` files replace the current ones."""
    old = read_state(folder)
    keep = {f.path for f in manifest.files}
    remove = sorted(set(old.files) - keep) if old else []
    journal = {
        "version": manifest.version,
        "store": store_url,
        "install": sorted(staged),
        "remove": remove,
        "files": {f.path: [f.size, f.xxh3] for f in manifest.files},
    }
    write_json_atomic(state_dir(folder) / "journal.json", journal, fsync)
    _apply_journal(folder, journal)


def begin_refill(folder: Path, manifest: Manifest, store_url: str, fsync: bool = True) -> None:
    """Before overwriting ``folder``'s files in place: mark it weightsync's own, make it claim no
    version, and remove the entries ``manifest``'s version does not have (so that no directory
    stands where a file goes)."""
    sdir = state_dir(folder)
    write_json_atomic(sdir / REFILL, {"version": manifest.version, "store": store_url}, fsync)
    (sdir / "state.json").unlink(missing_ok=True)
    if fsync:
        fsync_dir(sdir)
    for rel in stray_entries(folder, {f.path for f in manifest.files}):
        path = folder / rel
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def open_in_place(path: Path):
    """``path`` opened for overwriting in place (no truncation: the caller truncates at the end).
    A file with other hard links (shared with another folder by :func:`clone` or :func:`adopt`),
    or anything that is not a regular file, is replaced by a new file instead, so that another
    folder never sees its bytes change."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    if st is not None and stat.S_ISREG(st.st_mode) and st.st_nlink == 1:
        return open(os.open(path, os.O_WRONLY | os.O_NOFOLLOW), "wb", closefd=True)
    if st is not None:
        path.unlink()
    return open(path, "xb")


def finish_refill(folder: Path, manifest: Manifest, store_url: str, fsync: bool = True) -> None:
    """After every file of ``manifest`` is in place and verified: the state, then the marker goes."""
    files = {f.path: (f.size, f.xxh3, *_times(folder / f.path)) for f in manifest.files}
    sdir = state_dir(folder)
    write_json_atomic(sdir / "state.json", {"version": manifest.version, "store": store_url, "files": files}, fsync)
    (sdir / REFILL).unlink(missing_ok=True)
    if fsync:
        fsync_dir(sdir)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _times(path: Path) -> tuple[int, int]:
    st = os.lstat(path)
    return st.st_mtime_ns, st.st_ctime_ns


def unchanged_files(folder: Path, state: LocalState | None, manifest: Manifest) -> set[str]:
    """Paths whose local file already holds the target's bytes: same checksum recorded, and the
    file untouched since (size, mtime and ctime as recorded; a write with its mtime set back still
    moves the ctime). A file whose ctime alone moved (a hard link made or dropped, an old state
    that recorded none) is hashed to tell."""
    if state is None:
        return set()
    same = set()
    for f in manifest.files:
        rec = state.files.get(f.path)
        if rec and rec[0] == f.size and rec[1] == f.xxh3:
            try:
                st = os.lstat(safe_join(folder, f.path))
            except (FileNotFoundError, NotADirectoryError):
                continue
            if not (stat.S_ISREG(st.st_mode) and st.st_size == f.size and st.st_mtime_ns == rec[2]):
                continue
            if st.st_ctime_ns == rec[3] or _holds(safe_join(folder, f.path), f.size, f.xxh3):
                same.add(f.path)
    return same


class LocalVersion:
    """Verified reads of segments from a folder that holds ``manifest``'s version (a delta base)."""

    def __init__(self, folder: Path, manifest: Manifest):
        self.folder = Path(folder)
        self.manifest = manifest
        self._fds: dict[str, int] = {}
        self._files = {f.path: f for f in manifest.files}

    def find(self, path: str, key: tuple[str, str]) -> Segment | None:
        f = self._files.get(path)
        return None if f is None else next((s for s in f.segments if s.key == key), None)

    def file(self, path: str) -> FileEntry | None:
        return self._files.get(path)

    def read(self, path: str, seg: Segment, check: bool = True) -> np.ndarray:
        """The segment's bytes, checked against its checksum; BaseMismatchError if they differ or
        cannot be read. ``check=False``: not hashed, for a caller that verifies what it builds
        from them and calls ``read`` again to tell a wrong base from a bad payload."""
        what = f"{self.folder}/{path}"
        try:
            if path not in self._fds:
                self._fds[path] = open_regular(self.folder / path)
            data = read_range(self._fds[path], seg.begin, seg.end, what)
        except (OSError, WeightsyncError) as exc:
            raise BaseMismatchError(f"{what}: base for version {self.manifest.version} unreadable ({exc})") from None
        if not check:
            return data
        actual = xxhash.xxh3_128_hexdigest(data)
        if actual != seg.xxh3:
            raise BaseMismatchError(
                f"{what}: bytes of {seg.name or seg.role} differ from version {self.manifest.version} "
                f"(expected xxh3 {seg.xxh3}, got {actual})"
            )
        return data

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def check_checksum(what: str, expected: str, data: bytes | np.ndarray) -> None:
    actual = xxhash.xxh3_128_hexdigest(data)
    if actual != expected:
        raise ChecksumError(what, expected, actual)


def clone(src: Path, dst: Path, copy: bool = False, fsync: bool = False, check: Callable[[], None] | None = None) -> None:
    """Make ``dst`` hold the version ``src`` holds, by hard links where possible, or with ``copy``
    by copies of its own (which a later refill may overwrite in place).

    Links are safe because weightsync never writes into a file with other links: an update renames
    new files over old names, and a refill in place (:func:`open_in_place`) replaces a linked file
    by a new one, so two folders sharing inodes never see each other change. ``dst`` is emptied
    first and gets its state last, so a kill, or ``check`` raising (it is called between pieces of
    64 MiB), leaves it without state (a folder to clear), never claiming a version it does not
    hold. ``fsync``: the copies are on disk before the state claims them.
    """
    state = read_state(src)
    if state is None:
        raise UsageError(f"{src} holds no weightsync version to clone")
    clear_folder(dst)
    for rel, (size, _, mtime, _) in state.files.items():
        if check:
            check()
        st = os.lstat(safe_join(src, rel))
        if not stat.S_ISREG(st.st_mode) or (st.st_size, st.st_mtime_ns) != (size, mtime):
            raise UsageError(f"{src / rel} changed since version {state.version} was installed; not cloning it")
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        if not copy:
            try:
                os.link(src / rel, dst / rel)
                continue
            except OSError:
                pass  # another file system, or links not allowed: copy
        _copy_file(src / rel, dst / rel, fsync, check)
    if fsync:
        for d in {(dst / rel).parent for rel in state.files}:
            fsync_dir(d)
    files = {rel: (size, digest, *_times(dst / rel)) for rel, (size, digest, *_) in state.files.items()}
    write_json_atomic(private_dir(dst) / "state.json", {"version": state.version, "store": state.store, "files": files})


def _copy_file(src: Path, dst: Path, fsync: bool, check: Callable[[], None] | None, piece: int = 64 << 20) -> None:
    """Copy ``src`` to ``dst`` in the kernel (``copy_file_range``; reads and writes where that is
    not supported) piece by piece, calling ``check`` before each, then its mode and mtime (which
    state.json records)."""
    with open(open_regular(src, follow=False), "rb") as fi, open(dst, "wb") as fo:
        size, done = os.fstat(fi.fileno()).st_size, 0
        kernel = hasattr(os, "copy_file_range")
        while done < size:
            if check:
                check()
            n = min(piece, size - done)
            if kernel:
                try:
                    n = os.copy_file_range(fi.fileno(), fo.fileno(), n)
                except OSError:
                    kernel = False  # another file system type, an old kernel: copy through memory
                    continue
            else:
                n = fo.write(fi.read(n))
            if n == 0:
                break
            done += n
        fo.flush()
        if os.fstat(fo.fileno()).st_size != size:
            raise OSError(f"{src} changed size while being copied to {dst}")
        if fsync:
            os.fsync(fo.fileno())
    shutil.copystat(src, dst)


def adopt(folder: Path, manifest: Manifest, source: Path, store_url: str, lock: FolderLock | None = None) -> None:
    """Make ``folder`` hold ``manifest``'s version by linking (or copying) the files of ``source``,
    a directory that was just published as that version. Later reads still verify every segment."""
    with claim(folder, lock, "weightsync publish (caching the published version)"):
        _adopt(folder, manifest, source, store_url)


def _adopt(folder: Path, manifest: Manifest, source: Path, store_url: str) -> None:
    prepare_target(folder)
    staging = staging_dir(folder)
    for f in manifest.files:
        dst = staging / f.path
        dst.parent.mkdir(parents=True, exist_ok=True)
        src = (source / f.path).resolve()  # checkpoints may be symlinks (Hugging Face cache snapshots)
        try:
            os.link(src, dst)
        except OSError:
            shutil.copyfile(src, dst)
    install(folder, manifest, store_url, [f.path for f in manifest.files], fsync=False)
