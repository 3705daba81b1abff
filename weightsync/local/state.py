"""What a local folder holds (docs/FORMAT.md section 5): its own ``.weightsync`` directory, the
``state.json`` that names the version it holds, checked paths into it, and snapshots of its files
that tell what changed since (size, mtime, ctime; hashes when only the ctime moved)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

import xxhash

from weightsync.errors import FormatError, UsageError, WeightsyncError
from weightsync.format.keys import MAX_VERSION, STATE_DIR, check_path
from weightsync.format.manifest import Manifest

REFILL = "refill.json"  # present while a folder is being refilled in place
PARTIAL_STATE = "partial.json"  # a partial folder's state (weightsync.sync.selection)


@dataclass(frozen=True)
class LocalState:
    """What ``state.json`` records: the version a folder holds, the store it came from, and per file
    its size, checksum and the times it had when installed (to tell later changes)."""

    version: int
    store: str
    files: dict[str, tuple[int, str, int, int | None]]  # path -> (size, xxh3, mtime_ns, ctime_ns or None: not recorded)


def state_dir(folder: Path) -> Path:
    """``folder/.weightsync``, the folder's own state (not checked: see :func:`private_dir`)."""
    return Path(folder) / STATE_DIR


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


def write_json_atomic(path: Path, doc: object, fsync: bool = True) -> None:
    """Write ``doc`` to ``path`` through a temporary file (fsynced unless ``fsync=False``) renamed
    over it: readers see the old file or the new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # a full disk: no temporary file left per failed write (a subscriber's API calls)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


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
    """The folder's :class:`LocalState`, or None if it claims no version; :class:`UsageError` if damaged."""
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


def _parents(paths) -> set[str]:
    """Every folder above each of ``paths`` (relative, ``/``-separated)."""
    return {p.rsplit("/", i)[0] for p in paths for i in range(1, p.count("/") + 1)}


def stray_entries(folder: Path, expected: set[str]) -> list[str]:
    """Entries of ``folder`` that are neither ``expected`` files nor their parent directories."""
    parents = _parents(expected)
    files, dirs = list_files(folder)
    links = {f for f in files & expected if os.path.islink(os.path.join(folder, f))}  # ours are regular files
    return sorted((files - expected) | (dirs - parents) | links)


Snapshot = dict[str, tuple[int, ...]]  # path -> (mode, inode, size, mtime_ns, ctime_ns, nlink)


def snapshot(folder: Path) -> Snapshot:
    """What each entry of ``folder`` is (``.weightsync`` aside), cheaply (one lstat a file): a file
    rewritten (even with its mtime set back: the ctime moves), replaced, added or removed changes
    it. Linking or unlinking another name of a file moves its ctime too (and its link count). A
    folder is seen by its name only (its times move with what is done inside it)."""
    files, dirs = list_files(folder)
    out: Snapshot = {rel: (stat.S_IFDIR, 0, 0, 0, 0, 0) for rel in dirs}  # a folder added or removed is seen
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
    mtime back). Folders must be the recorded files' parents."""
    parents = _parents(recorded)
    for rel in sorted(set(snap) | set(recorded)):
        if snap.get(rel, (0,))[0] == stat.S_IFDIR and rel in parents and rel not in recorded:
            continue
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


def rebase_state(folder: Path, store: str, fsync: bool = True) -> None:
    """Record ``store`` as where ``folder``'s version came from (its files are that store's version
    of the same number, checked by the caller): the other fields stay as they are."""
    path = state_dir(folder) / "state.json"
    doc = read_doc(path, "weightsync state")
    if doc is not None:
        write_json_atomic(path, {**doc, "store": store}, fsync)


def claims_version(folder: Path) -> bool:
    """Whether ``folder`` is a weightsync folder holding a version (whole or partial), or being refilled with one."""
    return any(os.path.lexists(folder / STATE_DIR / name) for name in ("state.json", PARTIAL_STATE, REFILL))


def version_holder(path: Path, itself: bool = True) -> Path | None:
    """The folder (``path`` itself unless ``itself`` is false, or one above it, as it really is)
    that holds a weightsync version or is being refilled with one, if any: its next update removes
    whatever else it holds, so nothing of another store or pull may live in it."""
    real = Path(os.path.realpath(path))
    for d in [real, *real.parents][0 if itself else 1 :]:
        if claims_version(d):
            return d
    return None


def holds(outer: Path, inner: Path) -> bool:
    """Whether folder ``inner`` (or the folder it would be created in) is ``outer`` or lies inside it,
    compared by device and inode so that no spelling hides it: a link, ``..``, a bind mount (whose
    path differs although the folder is the same)."""
    try:
        st = os.stat(outer)
    except OSError:
        return False
    d = Path(os.path.realpath(inner))
    for a in [d, *d.parents]:
        try:
            sa = os.stat(a)
        except OSError:
            continue  # not created yet: its parents decide
        if (sa.st_dev, sa.st_ino) == (st.st_dev, st.st_ino):
            return True
    return False


def fsync_dir(path: Path) -> None:
    """fsync a directory, so that renames in it survive a crash."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _times(path: Path) -> tuple[int, int]:
    st = os.lstat(path)
    return st.st_mtime_ns, st.st_ctime_ns


Times = tuple[int, int]  # (mtime_ns, ctime_ns) of a file as it was checked


def unchanged_files(folder: Path, state: LocalState | None, manifest: Manifest) -> dict[str, Times]:
    """Paths whose local file already holds the target's bytes: same checksum recorded, and the
    file untouched since (size, mtime and ctime as recorded; a write with its mtime set back still
    moves the ctime). A file whose ctime alone moved (a hard link made or dropped, an old state
    that recorded none) is hashed to tell. Each with its times as seen before any hash, which the
    install compares the file against (a file still so need not be hashed again)."""
    if state is None:
        return {}
    same = {}
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
                same[f.path] = (st.st_mtime_ns, st.st_ctime_ns)
    return same


def _holds(path: Path, size: int, digest: str) -> bool:
    """Whether ``path`` is a regular file with exactly these bytes."""
    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_size != size:
            return False
        return hash_file(path) == (size, digest)
    except OSError:
        return False
