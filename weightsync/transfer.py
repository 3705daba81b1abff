"""Bounded parallel chunk transfers between a :class:`Repo` and memory or a local spool.

Memory bound of an :class:`Uploader`: at most ``concurrency`` chunks queued or in flight, i.e.
``concurrency * chunk_bytes`` (16 x 16 MiB = 256 MiB by default). :func:`fetch_chunks` streams each
chunk to a file in the spool and holds at most ``concurrency`` chunks in memory.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path

from .chunking import SealedChunk
from .errors import NotFoundError, UsageError
from .format import ChunkRef, chunk_key
from .repo import Repo, verify_chunk


class Uploader:
    """Uploads sealed chunks in the background; :meth:`join` waits and re-raises the first failure."""

    def __init__(self, repo: Repo, concurrency: int, on_bytes: Callable[[int], None] | None = None):
        if concurrency < 1:
            raise UsageError("upload concurrency must be at least 1")
        self.repo = repo
        self._pool = ThreadPoolExecutor(concurrency, thread_name_prefix="ws-upload")
        self._slots = threading.Semaphore(concurrency)
        self._futures: list[Future] = []
        self._on_bytes = on_bytes
        self.uploaded_bytes = 0
        self.skipped_bytes = 0
        self.seconds = 0.0
        self._lock = threading.Lock()

    def submit(self, chunk: SealedChunk) -> None:
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
            if moved:
                self.uploaded_bytes += len(chunk.data)
            else:
                self.skipped_bytes += len(chunk.data)
        if moved and self._on_bytes:
            self._on_bytes(len(chunk.data))

    def _raise_failed(self) -> None:
        for f in self._futures:
            if f.done() and f.exception():
                raise f.exception()
        self._futures = [f for f in self._futures if not f.done()]

    def join(self) -> None:
        wait(self._futures)
        self._raise_failed()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def spool_path(spool: Path, chunk_id: str) -> Path:
    return spool / chunk_id


def fetch_chunks(
    repo: Repo,
    chunks: Iterable[ChunkRef],
    spool: Path,
    concurrency: int,
    on_bytes: Callable[[int], None] | None = None,
) -> dict[str, Path]:
    """Make every chunk available as a verified local file; returns id -> path.

    A file store's own files are read in place (verified once here); other chunks are downloaded to
    ``spool``, verified, then renamed into place, so a file in the spool is always a verified chunk
    and a restarted pull does not download it again.
    """
    spool.mkdir(parents=True, exist_ok=True)
    wanted = {c.id: c for c in chunks}
    paths: dict[str, Path] = {}

    def one(ref: ChunkRef) -> tuple[str, Path]:
        key = chunk_key(ref.id)
        local = repo.store.local_path(key)
        if local is not None:
            try:
                data = local.read_bytes()
            except FileNotFoundError:
                raise NotFoundError(f"{repo.url}: missing chunk {key}", key=key) from None
            verify_chunk(f"{repo.url}/{key}", ref.id, ref.size, data)
            return ref.id, local
        dest = spool_path(spool, ref.id)
        if dest.exists() and dest.stat().st_size == ref.size:
            return ref.id, dest
        data = repo.get_chunk(ref.id, ref.size)
        fd, tmp = tempfile.mkstemp(dir=spool, prefix=".tmp-")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, dest)
        if on_bytes:
            on_bytes(len(data))
        return ref.id, dest

    with ThreadPoolExecutor(max(1, concurrency), thread_name_prefix="ws-fetch") as pool:
        for cid, path in pool.map(one, wanted.values()):
            paths[cid] = path
    return paths
