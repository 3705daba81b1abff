"""Rebuilding segments from a plan: the one path from fetched chunks to verified bytes.

Both the folder pull (:mod:`weightsync.sync.pull`) and the selected-tensor paths (partial folders,
:mod:`weightsync.sync.selection`; the torch sink) go through here: :func:`fetch_jobs` makes the
chunk bytes a list of :class:`TensorJob` needs available locally, :class:`Payloads` reads each
step's payload from them and checks it against the step's checksum, and :func:`build_segments`
decodes every job's steps onto its base bytes on a thread pool, in order, each result checked
against its segment's xxh3 before anyone sees it.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np

from weightsync.codec.payload import rebuild
from weightsync.errors import ChecksumError, FormatError, NotFoundError
from weightsync.format.keys import chunk_key
from weightsync.format.manifest import Segment
from weightsync.local.base import LocalVersion, check_checksum
from weightsync.local.state import open_regular
from weightsync.store.repo import Repo
from weightsync.sync.lazy import NO_LAZY, Reads
from weightsync.sync.observer import Operation
from weightsync.sync.pipeline import TASK_BYTES, ordered_map
from weightsync.sync.plan import ChunkNeed, Recipe, Step, chunk_needs
from weightsync.sync.transfer import fetch_chunks

BaseReader = Callable[[str, Segment], np.ndarray]  # (file path, local segment) -> its bytes, verified


@dataclass(frozen=True)
class TensorJob:
    """One segment to rebuild: the file it belongs to and its recipe."""

    path: str
    recipe: Recipe


def fetch_jobs(
    repo: Repo,
    jobs: Sequence[TensorJob],
    spool: Path,
    concurrency: int = 32,
    op: Operation | None = None,
    reads: Reads = NO_LAZY,
) -> tuple[dict[str, Path], int]:
    """Make the chunk bytes ``jobs`` read available locally (:func:`fetch_chunks`, ``reads`` saying
    which come from a fallback store); returns chunk id -> file and the bytes to fetch."""
    needs: tuple[ChunkNeed, ...] = chunk_needs(j.recipe for j in jobs)
    return fetch_chunks(repo, needs, spool, concurrency, op, reads), sum(n.fetch_bytes for n in needs)


class Payloads:
    """Step payloads read from local chunk files (a spool, or a file store's own files), each
    checked against its step's checksum. Thread-safe; :meth:`close` closes the files. ``reads``:
    which chunks came from a fallback store (named in messages instead of ``url``)."""

    def __init__(self, url: str, chunks: dict[str, Path], reads: Reads = NO_LAZY):
        self.url, self.chunks, self.reads = url, chunks, reads
        self._fds: dict[str, int] = {}

    def read(self, step: Step) -> bytes:
        """The bytes of ``step``'s payload, checked against its checksum (:class:`ChecksumError`)."""
        buf = bytearray()
        for rng in step.ranges:
            fd = self._fds.get(rng.chunk.id)
            if fd is None:
                try:
                    opened = open_regular(self.chunks[rng.chunk.id])
                except FileNotFoundError:
                    key = chunk_key(rng.chunk.id)
                    raise NotFoundError(
                        f"{self.url}: missing chunk {key} (collected while pulling?)", key=key
                    ) from None
                fd = self._fds.setdefault(rng.chunk.id, opened)
                if fd != opened:  # another thread opened it first
                    os.close(opened)
            buf += os.pread(fd, rng.length, rng.offset)
        keys = ", ".join(sorted({chunk_key(r.chunk.id) for r in step.ranges}))
        url = self.url
        if self.reads.fallback is not None and any(r.chunk.id in self.reads.from_fallback for r in step.ranges):
            url = self.reads.fallback.url
        what = f"payload of version {step.version} in {url}/{keys}"
        check_checksum(what, step.xxh3, buf)
        if step.sha256 and hashlib.sha256(buf).hexdigest() != step.sha256:
            raise ChecksumError(what, f"sha256 {step.sha256}", f"sha256 {hashlib.sha256(buf).hexdigest()}")
        return bytes(buf)

    def close(self) -> None:
        """Close the chunk files opened so far."""
        for fd in list(self._fds.values()):
            os.close(fd)
        self._fds.clear()


def rebuild_job(job: TensorJob, payloads: Payloads, base: LocalVersion | BaseReader | None) -> np.ndarray:
    """The bytes of ``job``'s segment, verified against its xxh3.

    ``base``: a :class:`LocalVersion` (a folder's version, as a pull reads it): its bytes are read
    into a fresh buffer without hashing and decoded in place; the result's hash covers them (a
    wrong base cannot give the right result), and only a wrong result reads them again, checked,
    to tell a base changed behind our back (:class:`BaseMismatchError`: rebuild without it) from a
    bad payload. Saves a pass over every byte of the model per pull. Otherwise a function giving
    verified bytes that stay the caller's (decoded into a new buffer).
    """
    r, t = job.recipe, job.recipe.segment
    what = f"{job.path}: {t.name or t.role}"
    steps = [
        (step.codec, partial(payloads.read, step), step.backward, step.reverse and partial(payloads.read, step.reverse))
        for step in r.steps
    ]
    if not isinstance(base, LocalVersion):
        cur = None if r.base is None else base(job.path, r.base)
        return rebuild(t.dtype, t.nbytes, t.xxh3, cur, steps, what)
    cur = None if r.base is None else base.read(job.path, r.base, check=False)
    try:
        return rebuild(t.dtype, t.nbytes, t.xxh3, cur, steps, what, in_place=True)
    except (ChecksumError, FormatError):
        if r.base is not None:
            base.read(job.path, r.base)  # raises BaseMismatchError if the base is not what it should be
        raise


def build_segments(
    jobs: Sequence[TensorJob],
    payloads: Payloads,
    base: LocalVersion | BaseReader | None,
    *,
    threads: int = 4,
    inflight_bytes: int = 256 << 20,
    op: Operation | None = None,
    then: Callable[[TensorJob, np.ndarray], object] | None = None,
) -> Iterator[tuple[TensorJob, np.ndarray]]:
    """Yield each job with its rebuilt, verified bytes (:func:`rebuild_job`), in order, decoding on
    ``threads`` threads with at most about ``inflight_bytes`` of work in memory (3x each segment).
    ``op``'s observer may cancel (:meth:`~weightsync.sync.observer.Observer.check`) before each segment.
    ``then(job, bytes)``, if given, runs on the same thread after the decode, and its result is
    yielded instead of the bytes (work per tensor that should not wait for the caller's loop)."""

    def build(job: TensorJob) -> np.ndarray:
        if op is not None:
            op.check()
        data = rebuild_job(job, payloads, base)
        return data if then is None else then(job, data)

    yield from ordered_map(build, jobs, lambda j: 3 * j.recipe.segment.nbytes, inflight_bytes, threads, 3 * TASK_BYTES)


def build_tensors(
    jobs: Sequence[TensorJob],
    chunk_paths: dict[str, Path],
    base: LocalVersion | BaseReader | None,
    *,
    url: str,
    threads: int = 4,
    inflight_bytes: int = 256 << 20,
    op: Operation | None = None,
    then: Callable[[TensorJob, np.ndarray], object] | None = None,
    reads: Reads = NO_LAZY,
) -> Iterator[tuple[TensorJob, np.ndarray]]:
    """:func:`build_segments` reading payloads from ``chunk_paths`` (chunk id -> local file, as
    :func:`fetch_jobs` returns, with its ``reads``), closing them when done or abandoned."""
    payloads = Payloads(url, chunk_paths, reads)
    try:
        yield from build_segments(
            jobs, payloads, base, threads=threads, inflight_bytes=inflight_bytes, op=op, then=then
        )
    finally:
        payloads.close()
