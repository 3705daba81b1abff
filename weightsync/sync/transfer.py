"""Bounded parallel chunk transfers between a :class:`Repo` and memory or a local spool.

Memory bound of an :class:`Uploader`: at most ``concurrency`` chunks queued or in flight, i.e.
``concurrency * chunk_bytes`` (32 x 16 MiB = 512 MiB by default). :func:`fetch_chunks` writes each
chunk to a file in the spool and holds at most ``concurrency`` chunks in memory.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path

import xxhash

from weightsync.errors import ChecksumError, NotFoundError, UsageError
from weightsync.format.chunking import SealedChunk
from weightsync.format.keys import chunk_key
from weightsync.store.repo import Repo
from weightsync.sync.lazy import NO_LAZY, Reads
from weightsync.sync.observer import Operation
from weightsync.sync.plan import ChunkNeed


class Uploader:
    """Uploads sealed chunks in the background; :meth:`join` waits and re-raises the first failure."""

    def __init__(self, repo: Repo, concurrency: int, op: Operation | None = None):
        if concurrency < 1:
            raise UsageError("upload concurrency must be at least 1")
        self.repo = repo
        self._pool = ThreadPoolExecutor(concurrency, thread_name_prefix="ws-upload")
        self._slots = threading.Semaphore(concurrency)
        self._futures: list[Future] = []
        self._op = op
        self.uploaded_bytes = 0
        self.skipped_bytes = 0
        self.seconds = 0.0
        self.stored_at: dict[str, float] = {}  # chunk id -> time.monotonic() when stored or touched
        self._lock = threading.Lock()

    def submit(self, chunk: SealedChunk) -> None:
        """Queue ``chunk`` for upload; blocks while ``concurrency`` uploads are in flight, and raises the
        first failed upload's error."""
        self._raise_failed()
        self._slots.acquire()
        self._futures.append(self._pool.submit(self._put, chunk))

    def _put(self, chunk: SealedChunk) -> None:
        t0 = time.perf_counter()
        try:
            moved = self.repo.put_chunk(chunk.id, chunk.data)
        finally:
            self._slots.release()
        with self._lock:
            self.seconds += time.perf_counter() - t0
            self.stored_at[chunk.id] = time.monotonic()
            if moved:
                self.uploaded_bytes += len(chunk.data)
            else:
                self.skipped_bytes += len(chunk.data)
        if moved and self._op is not None:
            self._op.transferred(len(chunk.data))

    def _raise_failed(self) -> None:
        for f in self._futures:
            if f.done() and f.exception():
                raise f.exception()
        self._futures = [f for f in self._futures if not f.done()]

    def join(self) -> None:
        """Wait for every queued upload; raise the first one's error if any failed."""
        wait(self._futures)
        self._raise_failed()

    def close(self) -> None:
        """Stop the upload threads (queued uploads are cancelled)."""
        self._pool.shutdown(wait=True, cancel_futures=True)


def fetch_chunks(
    repo: Repo,
    needs: Iterable[ChunkNeed],
    spool: Path,
    concurrency: int,
    op: Operation | None = None,
    reads: Reads = NO_LAZY,
) -> dict[str, Path]:
    """Make the needed bytes of every chunk available in a local file; returns id -> path.

    A file store's own files are read in place. Otherwise a chunk that is mostly needed is
    downloaded whole, checked against its id and renamed into ``spool`` (a file there is always a
    verified chunk, so a restarted pull does not download it again); a chunk of which little is
    needed is fetched as ranged reads into a sparse file at the same offsets. Every payload read
    from either is checked against its own checksum before it is decoded. ``spool`` is a real
    directory of the caller's (checked by :func:`weightsync.local.spool_dir`). The ``"fetch"`` phase
    starts with the bytes to download, and each download is reported to ``op`` as it lands
    (:meth:`~weightsync.sync.observer.Operation.transferred`).

    ``reads`` (:func:`weightsync.sync.lazy.plan_reads`): the chunks read from a fallback store
    instead, because ``repo`` notes them as not copied yet. Those are always downloaded into the
    spool, never read in place: whole ones checked against their id, ranges by their payloads.
    """
    needs = list(needs)
    if op is not None:
        op.phase("fetch", sum(n.fetch_bytes for n in needs))

    def one(need: ChunkNeed) -> tuple[str, Path]:
        ref = need.chunk
        key = chunk_key(ref.id)
        src = reads.source(repo, ref.id)
        local = repo.store.local_path(key) if src is repo else None
        if local is not None:
            if not local.exists():
                raise NotFoundError(f"{repo.url}: missing chunk {key}", key=key)
            return ref.id, local
        dest = spool / ref.id
        if _spooled(dest, ref.id, ref.size):
            return ref.id, dest
        fd, tmp = tempfile.mkstemp(dir=spool, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                moved = _download(src, need, key, f)
        except BaseException:
            os.unlink(tmp)
            raise
        if need.whole():
            os.replace(tmp, dest)
        else:
            dest = spool / f"{ref.id}.ranges"
            os.replace(tmp, dest)
        if op is not None:
            op.transferred(moved)
        return ref.id, dest

    with ThreadPoolExecutor(max(1, concurrency), thread_name_prefix="ws-fetch") as pool:
        return dict(pool.map(one, needs))


def _spooled(path: Path, chunk_id: str, size: int) -> bool:
    """Whether ``path`` holds the chunk, checked by content (a chunk's id is its checksum), not by
    size: a spool left by a killed pull or planted by hand is reused only when right. A wrong
    entry is dropped."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if stat.S_ISREG(st.st_mode) and st.st_size == size:
        with open(path, "rb") as f:
            if xxhash.xxh3_128_hexdigest(f.read()) == chunk_id:
                return True
    _remove_entry(path)
    return False


def _remove_entry(path: Path) -> None:
    shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink(missing_ok=True)


def clear_spool(spool: Path) -> None:
    """Remove a spool and what it holds (never following a link out of it)."""
    if spool.is_symlink():
        spool.unlink()
    elif spool.is_dir():
        for p in spool.iterdir():
            _remove_entry(p)
        spool.rmdir()


def _download(repo: Repo, need: ChunkNeed, key: str, f) -> int:
    if need.whole():
        f.write(repo.get_chunk(need.chunk.id, need.chunk.size))
        return need.chunk.size
    moved = 0
    for off, n in need.ranges:
        data = repo.store.get_range(key, off, n)
        if len(data) != n:
            raise ChecksumError(f"{repo.url}/{key} range [{off}, {off + n})", f"{n} bytes", f"{len(data)} bytes")
        f.seek(off)
        f.write(data)
        moved += n
    return moved
