"""Reading a checkpoint folder to publish it: its files as segments (a safetensors file's header and
tensors, any other file one blob), byte ranges as arrays, and the identity checks that fail a
publish whose files change while it reads them (docs/DESIGN.md)."""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import os
import resource
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from weightsync.errors import CheckpointError, FormatError
from weightsync.format.keys import MAX_SIZE, STATE_DIR, check_path
from weightsync.format.safetensors import MAX_HEADER, SourceSegment, parse_safetensors_header

_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY  # a FIFO swapped in must not block the open


class CheckpointChanged(CheckpointError):
    """A checkpoint file changed (replaced, written, appended, truncated, removed) while it was published."""


@dataclass(frozen=True)
class SourceFile:
    """A checkpoint file as scanned: its path, kind, size and segments, and the identity and header
    bytes that tell whether it changed while being published."""

    path: str  # relative, "/"-separated
    abspath: Path
    kind: str
    size: int
    segments: tuple[SourceSegment, ...]
    identity: tuple[int, ...] = ()  # (st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns, st_nlink) when scanned
    head: bytes = b""  # a safetensors file's header segment as scanned (b"" for a blob)


def _identity(st: os.stat_result) -> tuple[int, ...]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_nlink)


def _same(now: tuple[int, ...], then: tuple[int, ...]) -> bool:
    """Whether a file is as it was: same device, inode, size and mtime, and a ctime that moved only
    with the link count (a name added or removed, not its bytes; a write that set its mtime back
    moves the ctime alone)."""
    return now[:4] == then[:4] and (now[4] == then[4] or now[5] != then[5])


def describe_file(abspath: Path, relpath: str) -> SourceFile:
    """The file's layout, read through one descriptor, with its identity (``fstat`` of that descriptor)."""
    try:
        if not stat.S_ISREG(os.stat(abspath).st_mode):  # never open a FIFO or a device
            raise CheckpointError(f"{relpath}: not a regular file")
        fd = os.open(abspath, _OPEN_FLAGS)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise CheckpointError(f"{relpath}: not a regular file")
            size = st.st_size
            if size > MAX_SIZE:
                raise CheckpointError(f"{relpath}: {size} bytes, more than the format's limit of 2^50")
            if not relpath.endswith(".safetensors"):
                return SourceFile(
                    relpath, abspath, "blob", size, (SourceSegment("blob", "", "U8", (size,), 0, size),), _identity(st)
                )
            head = os.pread(fd, 8, 0)
            n = int.from_bytes(head, "little") if len(head) == 8 else 0
            if len(head) == 8 and n <= MAX_HEADER:
                head += _pread_all(fd, min(n, size - 8), 8)
            segments = parse_safetensors_header(head, size, relpath)
            return SourceFile(relpath, abspath, "safetensors", size, segments, _identity(st), head[: segments[0].end])
        finally:
            os.close(fd)
    except OSError as exc:
        raise CheckpointError(f"{relpath}: cannot read ({exc.strerror})") from None


def _pread_all(fd: int, n: int, offset: int) -> bytes:
    parts, got = [], 0
    while got < n:
        b = os.pread(fd, n - got, offset + got)
        if not b:
            break
        parts.append(b)
        got += len(b)
    return b"".join(parts)


def open_sources(files: list[SourceFile]) -> dict[str, int]:
    """A descriptor on each of ``files`` (by path), each checked to be the file that was scanned. A
    publish holds them all, and as many of its delta base's, so the soft limit on open files is
    raised to what they need (up to the hard limit) first; past the hard limit the error says so."""
    need = 2 * len(files) + 256  # the base's files, the store's sockets, threads' files, the interpreter's own
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(
                resource.RLIMIT_NOFILE, (need if hard == resource.RLIM_INFINITY else min(need, hard), hard)
            )
    fds: dict[str, int] = {}
    try:
        for f in files:
            fds[f.path] = open_source(f)
    except BaseException:
        for fd in fds.values():
            os.close(fd)
        raise
    return fds


def open_source(f: SourceFile) -> int:
    """A descriptor on ``f`` for reading its segments, checked to be the file that was scanned."""
    try:
        fd = os.open(f.abspath, _OPEN_FLAGS)
    except OSError as exc:
        if exc.errno in (errno.EMFILE, errno.ENFILE):
            soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
            raise CheckpointError(
                f"{f.path}: cannot open it: {exc.strerror} (a publish holds every file of the checkpoint open; "
                f"this process may open {soft}: raise the limit, ulimit -n)"
            ) from None
        raise CheckpointChanged(
            f"{f.path}: changed while being published (cannot open it again: {exc.strerror}); "
            "nothing was committed, publish it again once it is complete"
        ) from None
    try:
        check_unchanged(fd, f)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_unchanged(fd: int, f: SourceFile) -> None:
    """Raises :class:`CheckpointChanged` unless the open file ``fd`` still has ``f``'s scanned
    identity (same device and inode, size and mtime): replaced, written, appended or truncated."""
    now = _identity(os.fstat(fd))
    if f.identity and not _same(now, f.identity):
        what = (
            "was replaced by another file"
            if now[:2] != f.identity[:2]
            else f"changed size from {f.identity[2]} to {now[2]} bytes"
            if now[2] != f.identity[2]
            else "was modified"
        )
        raise CheckpointChanged(
            f"{f.path}: {what} while being published; nothing was committed, publish it again once it is complete"
        )


def still_as_scanned(files: list[SourceFile]) -> bool:
    """Every file's path still leads to the file scanned, unchanged (e.g. before linking the
    checkpoint into a cache as the version just published)."""
    try:
        return all(_same(_identity(os.stat(f.abspath)), f.identity) for f in files if f.identity)
    except OSError:
        return False


def check_still_as_scanned(files: list[SourceFile], rescan: Callable[[], list[SourceFile]]) -> None:
    """Raises :class:`CheckpointChanged` unless the checkpoint is still what was scanned: every
    path leads to the file read, unchanged, and no file was added or removed (called before a
    commit: a version is one state of the folder, never files of two training steps)."""
    for f in files:
        try:
            now = _identity(os.stat(f.abspath))
        except OSError as exc:
            raise CheckpointChanged(
                f"{f.path}: {exc.strerror.lower()} since it was read for publishing; nothing was "
                "committed, publish it again once it is complete"
            ) from None
        if f.identity and not _same(now, f.identity):
            what = "was replaced" if now[:2] != f.identity[:2] else "was modified"
            raise CheckpointChanged(
                f"{f.path}: {what} while being published; nothing was committed, publish it again once it is complete"
            )
    before, after = {f.path for f in files}, {f.path for f in rescan()}
    if before != after:
        diff = sorted(after - before) or sorted(before - after)
        how = "appeared in" if after - before else "vanished from"
        raise CheckpointChanged(
            f"{diff[0]}: {how} the checkpoint while it was published; nothing was committed, "
            "publish it again once it is complete"
        )


def check_header(f: SourceFile, data: np.ndarray) -> None:
    """Raises :class:`CheckpointChanged` unless ``data``, read as ``f``'s header segment, is the header scanned."""
    if f.head and data.tobytes() != f.head:
        raise CheckpointChanged(
            f"{f.path}: its safetensors header changed while being published; nothing was "
            "committed, publish it again once it is complete"
        )


def scan_checkpoint(
    directory: str | os.PathLike[str], ignore: tuple[str, ...] = (), outside: Path | None = None
) -> list[SourceFile]:
    """Every file under ``directory`` (sorted by path), skipping a top-level ``.weightsync`` folder
    (a pulled folder's state) and paths matching an ``ignore`` glob (e.g. a ``COMPLETE`` marker).
    ``outside``: a folder the scan must not reach (a file store's), through a link or not.

    Symlinks are followed, to files and to folders (Hugging Face cache snapshots are symlinks); a
    symlink loop, an unreadable folder, a top-level ``.weightsync`` that is not a folder (the name
    is reserved) or anything but a regular file fails the scan: nothing is left out without a
    word. Empty folders are not part of a version (docs/FORMAT.md, section 2)."""
    root = Path(directory)
    try:
        st = os.stat(root)
    except OSError:
        st = None
    if st is None:
        raise CheckpointError(f"checkpoint directory not found: {root}")
    if not stat.S_ISDIR(st.st_mode):
        raise CheckpointError(f"checkpoint {root} is not a directory")
    try:
        avoid = None if outside is None else (_folder_key(os.stat(outside)), os.path.realpath(outside))
    except OSError:
        avoid = None  # not made yet: nothing of it can be reached
    if avoid is not None and (st.st_dev, st.st_ino) == avoid[0]:
        raise CheckpointError(
            f"{root}: the checkpoint folder is the store's folder {outside}; keep the store elsewhere"
        )
    files: list[SourceFile] = []
    todo = [(root, "", frozenset({(st.st_dev, st.st_ino)}))]  # a stack, not recursion: trees may be deep
    while todo:
        todo.extend(_scan_dir(root, *todo.pop(), ignore, files, avoid))
    if not files:
        raise CheckpointError(f"checkpoint directory is empty: {root}")
    return sorted(files, key=lambda f: f.path)


def _scan_dir(
    root: Path,
    folder: Path,
    rel_dir: str,
    ancestors: frozenset[tuple[int, int]],
    ignore: tuple[str, ...],
    out: list[SourceFile],
    avoid: tuple[tuple[int, int], str] | None = None,
) -> list[tuple[Path, str, frozenset[tuple[int, int]]]]:
    """Describe the files of one folder into ``out``; returns its subfolders to scan."""
    try:
        with os.scandir(folder) as it:
            entries = sorted(it, key=lambda e: e.name)
    except OSError as exc:
        raise CheckpointError(f"{root}: cannot list folder {rel_dir or '.'!r} ({exc.strerror})") from None
    subdirs = []
    for e in entries:
        rel = f"{rel_dir}{e.name}"
        try:
            is_dir = e.is_dir()  # follows a symlink
            st = e.stat() if is_dir else None
        except OSError as exc:
            raise CheckpointError(f"{root}: cannot read {rel!r} ({exc.strerror})") from None
        if rel == STATE_DIR:
            if is_dir and not e.is_symlink():
                continue  # weightsync's own state: the checkpoint is a folder it pulled into
            if not any(fnmatch.fnmatchcase(rel, pat) for pat in ignore):
                raise CheckpointError(
                    f"{root}: cannot publish {rel!r}: the name is reserved for weightsync's state "
                    "folder (rename it, or leave it out with --ignore)"
                )
            continue
        if is_dir:
            key = (st.st_dev, st.st_ino)
            if key in ancestors:
                raise CheckpointError(
                    f"{root}: cannot publish {rel!r}: a symlink to a folder that contains it (a loop)"
                )
            if avoid is not None and (key == avoid[0] or (e.is_symlink() and _inside(e.path, avoid[1]))):
                raise CheckpointError(
                    f"{root}: cannot publish {rel!r}: it is, or links into, the store's folder; "
                    "keep the store outside the checkpoint"
                )
            subdirs.append((Path(e.path), f"{rel}/", ancestors | {key}))
            continue
        if any(fnmatch.fnmatchcase(rel, pat) for pat in ignore):
            continue
        try:
            check_path(rel)
        except FormatError as exc:
            raise CheckpointError(f"{root}: cannot publish file {rel!r}: {exc}") from None
        out.append(describe_file(Path(e.path), rel))
    return subdirs


def _folder_key(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


def _inside(path: str, folder: str) -> bool:
    """Whether the real path of ``path`` is ``folder`` (a real path) or below it."""
    real = os.path.realpath(path)
    return real == folder or real.startswith(folder.rstrip(os.sep) + os.sep)


def read_range(fd: int, begin: int, end: int, what: str) -> np.ndarray:
    """Bytes [begin, end) of an open file as a fresh 1-D uint8 array."""
    out = np.empty(end - begin, dtype=np.uint8)
    view, pos = memoryview(out), 0
    while pos < len(view):
        n = os.preadv(fd, [view[pos:]], begin + pos)
        if n == 0:
            raise CheckpointError(f"{what}: file shrank while reading (at byte {begin + pos})")
        pos += n
    return out
