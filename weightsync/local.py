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

import json
import os
import shutil
import stat
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

from .checkpoint import read_range
from .errors import BaseMismatchError, ChecksumError, UsageError, WeightsyncError
from .format import FileEntry, Manifest, Segment, check_path

STATE_DIR = ".weightsync"
REFILL = "refill.json"  # present while a folder is being refilled in place


@dataclass(frozen=True)
class LocalState:
    version: int
    store: str
    files: dict[str, tuple[int, str, int]]  # path -> (size, xxh3, mtime_ns)


def state_dir(folder: Path) -> Path:
    return Path(folder) / STATE_DIR


def write_json_atomic(path: Path, doc: object, fsync: bool = True) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    with os.fdopen(fd, "w") as f:
        json.dump(doc, f)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)


def read_state(folder: Path) -> LocalState | None:
    path = state_dir(folder) / "state.json"
    try:
        doc = json.loads(path.read_text())
        files = {check_path(p): (int(s), str(h), int(m)) for p, (s, h, m) in doc["files"].items()}
        return LocalState(int(doc["version"]), str(doc["store"]), files)
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError, WeightsyncError) as exc:
        raise UsageError(f"{path}: corrupt weightsync state ({exc}); remove {STATE_DIR} to start afresh") from None


def _apply_journal(folder: Path, journal: dict) -> None:
    sdir = state_dir(folder)
    staging = sdir / "staging"
    for rel in journal["remove"]:  # first, so that a file may become a folder and back
        (folder / rel).unlink(missing_ok=True)
        _prune_dirs(folder, (folder / rel).parent)
    for rel in journal["install"]:
        src, dst = staging / rel, folder / rel
        if src.exists():
            dst.parent.mkdir(parents=True, exist_ok=True)
            os.replace(src, dst)
    files = {}
    for rel, (size, digest) in journal["files"].items():
        files[rel] = (size, digest, (folder / rel).stat().st_mtime_ns)
    write_json_atomic(sdir / "state.json", {"version": journal["version"], "store": journal["store"], "files": files})
    (sdir / "journal.json").unlink()
    (sdir / REFILL).unlink(missing_ok=True)  # a refill interrupted before this install replaced it
    shutil.rmtree(staging, ignore_errors=True)


def _prune_dirs(folder: Path, d: Path) -> None:
    while d != folder and d.is_dir() and not any(d.iterdir()):
        d.rmdir()
        d = d.parent


def recover(folder: Path) -> None:
    """Finish an interrupted install, or drop an unfinished staging area (spooled chunks stay)."""
    sdir = state_dir(folder)
    journal = sdir / "journal.json"
    if journal.exists():
        _apply_journal(folder, json.loads(journal.read_text()))
    elif (sdir / "staging").exists():
        shutil.rmtree(sdir / "staging")


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
    return sorted((files - expected) | (dirs - parents))


def prepare_target(folder: Path, owned: bool = False) -> LocalState | None:
    """Create the folder if needed, recover, and refuse a folder holding anything weightsync does not
    own. An interrupted refill (:func:`begin_refill`) is kept as it is for the next refill
    (``owned``), else emptied."""
    if folder.exists() and not folder.is_dir():
        raise UsageError(f"{folder} exists and is not a directory")
    if state_dir(folder).is_symlink() or (state_dir(folder).exists() and not state_dir(folder).is_dir()):
        raise UsageError(f"{state_dir(folder)} is not a directory of weightsync's own (a link?); refusing to write through it")
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


def empty_folder(folder: Path) -> None:
    """Remove every entry of ``folder`` but ``.weightsync`` (whose spool of verified chunks stays)."""
    for entry in folder.iterdir():
        if entry.name != STATE_DIR:
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()


def staging_dir(folder: Path) -> Path:
    return state_dir(folder) / "staging"


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
    files = {f.path: (f.size, f.xxh3, (folder / f.path).stat().st_mtime_ns) for f in manifest.files}
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


def unchanged_files(folder: Path, state: LocalState | None, manifest: Manifest) -> set[str]:
    """Paths whose local file already holds the target's bytes (same checksum, untouched since)."""
    if state is None:
        return set()
    same = set()
    for f in manifest.files:
        rec = state.files.get(f.path)
        if rec and rec[0] == f.size and rec[1] == f.xxh3:
            try:
                st = (folder / f.path).stat()
            except FileNotFoundError:
                continue
            if st.st_size == f.size and st.st_mtime_ns == rec[2]:
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
                self._fds[path] = os.open(self.folder / path, os.O_RDONLY)
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
    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir(parents=True)
    for rel in state.files:
        if check:
            check()
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
    write_json_atomic(state_dir(dst) / "state.json", {"version": state.version, "store": state.store, "files": state.files})


def _copy_file(src: Path, dst: Path, fsync: bool, check: Callable[[], None] | None, piece: int = 64 << 20) -> None:
    """Copy ``src`` to ``dst`` in the kernel (``copy_file_range``; reads and writes where that is
    not supported) piece by piece, calling ``check`` before each, then its mode and mtime (which
    state.json records)."""
    with open(src, "rb") as fi, open(dst, "wb") as fo:
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


def adopt(folder: Path, manifest: Manifest, source: Path, store_url: str) -> None:
    """Make ``folder`` hold ``manifest``'s version by linking (or copying) the files of ``source``,
    a directory that was just published as that version. Later reads still verify every segment."""
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
