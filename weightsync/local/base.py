"""The version a folder holds as the base of a delta: :class:`LocalVersion` reads its segments,
each checked against the manifest's checksum; :func:`clone` and :func:`adopt` make a folder hold a
version from another folder's files (reflinks or copies) without the store."""

from __future__ import annotations

import errno
import os
import resource
import shutil
import stat
from collections.abc import Callable
from pathlib import Path

import numpy as np
import xxhash

from weightsync.errors import BaseMismatchError, ChecksumError, UsageError, WeightsyncError
from weightsync.format.manifest import Manifest, Segment
from weightsync.local.checkpoint import read_range
from weightsync.local.install import clear_folder, install, prepare_folder, staging_dir
from weightsync.local.lock import FolderLock, claim
from weightsync.local.state import (
    _holds,
    _times,
    fsync_dir,
    open_regular,
    private_dir,
    read_state,
    safe_join,
    write_json_atomic,
)


class LocalVersion:
    """Verified reads of segments from a folder that holds ``manifest``'s version (a delta base)."""

    def __init__(self, folder: Path, manifest: Manifest):
        self.folder = Path(folder)
        self.manifest = manifest
        self._fds: dict[str, int] = {}

    def read(self, path: str, seg: Segment, check: bool = True) -> np.ndarray:
        """The segment's bytes, checked against its checksum; BaseMismatchError if they differ or
        cannot be read. ``check=False``: not hashed, for a caller that verifies what it builds
        from them and calls ``read`` again to tell a wrong base from a bad payload."""
        what = f"{self.folder}/{path}"
        try:
            if path not in self._fds:
                self._fds[path] = open_regular(self.folder / path)
            data = read_range(self._fds[path], seg.begin, seg.end, what)
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE):  # the process's limit, not the base: no rebuild helps
                raise WeightsyncError(
                    f"{what}: cannot open it: {exc.strerror} (this process may open "
                    f"{resource.getrlimit(resource.RLIMIT_NOFILE)[0]} files: raise the limit, ulimit -n)"
                ) from None
            raise BaseMismatchError(f"{what}: base for version {self.manifest.version} unreadable ({exc})") from None
        except WeightsyncError as exc:
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
        """Close the files opened by :meth:`read`."""
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def check_checksum(what: str, expected: str, data: bytes | np.ndarray) -> None:
    """Raise :class:`ChecksumError` unless ``data`` has the XXH3-128 ``expected``."""
    actual = xxhash.xxh3_128_hexdigest(data)
    if actual != expected:
        raise ChecksumError(what, expected, actual)


def clone(
    src: Path, dst: Path, copy: bool = False, fsync: bool = False, check: Callable[[], None] | None = None
) -> None:
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
    made = {}  # each file's times right after it was linked or copied
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
                made[rel] = _times(dst / rel)
                continue
            except OSError:
                pass  # another file system, or links not allowed: copy
        _copy_file(src / rel, dst / rel, fsync, check)
        made[rel] = _times(dst / rel)
        if _identity(os.lstat(safe_join(src, rel))) != _identity(st):  # a source written meanwhile
            raise UsageError(f"{src / rel} changed while it was copied into {dst}; not cloning it")
    if fsync:
        for d in {(dst / rel).parent for rel in state.files}:
            fsync_dir(d)
    files = {}
    for rel, (size, digest, *_) in state.files.items():
        st = os.lstat(dst / rel)
        if (st.st_mtime_ns, st.st_ctime_ns) != made[rel] and not _holds(dst / rel, size, digest):
            raise UsageError(
                f"{dst / rel} changed while version {state.version} was copied into {dst}; not recording it"
            )
        files[rel] = (size, digest, st.st_mtime_ns, st.st_ctime_ns)
    write_json_atomic(private_dir(dst) / "state.json", {"version": state.version, "store": state.store, "files": files})


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    return st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


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
    prepare_folder(folder)
    staging, staged = staging_dir(folder), {}
    for f in manifest.files:
        dst = staging / f.path
        dst.parent.mkdir(parents=True, exist_ok=True)
        src = (source / f.path).resolve()  # checkpoints may be symlinks (Hugging Face cache snapshots)
        try:
            os.link(src, dst)
        except OSError:
            shutil.copyfile(src, dst)
        staged[f.path] = _times(dst)
    install(folder, manifest, store_url, staged, fsync=False)
