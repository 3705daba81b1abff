"""Regional mirrors: copy versions from one store into another in the store's commit order (chunks
verified, then the manifest, then its signatures, then the head), so that one cross-region transfer
serves a region (docs/DESIGN.md: what a destination must be, memory). A source repo with trusted
keys makes the mirror copy only versions one of them signed (docs/FORMAT.md section 7)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

from weightsync.errors import (
    AlreadyExistsError,
    NotAStoreError,
    NotFoundError,
    PreconditionFailedError,
    SignatureError,
    StoreError,
    UsageError,
    VersionError,
)
from weightsync.format.keys import HEAD_KEY, signature_key, version_key
from weightsync.format.manifest import ChunkRef, head_to_json, manifest_from_json
from weightsync.store.repo import Repo


class MirrorError(NotAStoreError):
    """The destination is not a mirror of the source (other lineage, or ahead of it)."""


@dataclass(frozen=True)
class MirrorConfig:
    """``concurrency``: chunks copied at once (memory: ``concurrency`` x chunk size).
    ``interval``: seconds between polls of the source head when following."""

    concurrency: int = 32
    interval: float = 5.0

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise UsageError(f"mirror concurrency must be at least 1, got {self.concurrency}")
        if not self.interval > 0:
            raise UsageError(f"mirror interval must be positive, got {self.interval}")


@dataclass
class MirrorResult:
    """What a mirror run did, over all its passes: versions copied or already there, chunks copied or
    touched, bytes, the heads seen, failed passes, seconds."""

    copied_versions: list[int] = field(default_factory=list)  # manifest written here, head moved to it
    skipped_versions: list[int] = field(default_factory=list)  # manifest already there, identical
    copied_chunks: int = 0  # chunk totals: counted as each chunk is done, in failed passes too
    copied_bytes: int = 0
    skipped_chunks: int = 0  # already at the destination (touched, not copied)
    head: int | None = None  # the destination head when the mirror returned
    source_head: int | None = None  # the source head read by the last pass
    passes: int = 0
    errors: int = 0  # failed passes while following (each retried at the next poll)
    seconds: float = 0.0


class MirrorObserver:
    """What a mirror reports as it runs (metrics, logs, health); every hook does nothing until a
    subclass overrides it. Each is called in the mirror's thread, except :meth:`on_chunk`."""

    def on_heads(self, source: int | None, destination: int | None) -> None:
        """A pass read both heads (None: no head yet), before it copies anything."""

    def on_chunk(self, copied: bool, nbytes: int) -> None:
        """A chunk of a version is done: copied, or found already there (``copied`` False). Called
        from the copying threads, one call at a time, also in a pass that fails later (the
        result's chunk totals move with it)."""

    def on_version(self, version: int, chunks: int, nbytes: int) -> None:
        """This mirror wrote ``version``'s manifest and the destination head is at (or past) it; the
        chunks and bytes it copied for that version in this pass."""

    def on_pass(self, result: MirrorResult) -> None:
        """A pass succeeded; ``result`` holds the running totals (``result.head``: the destination head)."""

    def on_error(self, exc: StoreError | SignatureError) -> None:
        """A pass failed with a store error, or stopped at a version the trusted keys did not sign,
        and will be retried at the next poll (``follow`` only)."""

    def on_waiting(self, reason: str) -> None:
        """Nothing to mirror yet (the source is not a weightsync store: it is empty); the mirror looks
        again at every poll (``follow`` only)."""


class _Stopped(Exception):
    pass


class _Mirror:
    def __init__(
        self,
        src: Repo,
        dst: Repo,
        cfg: MirrorConfig,
        stop: threading.Event,
        observer: MirrorObserver,
    ):
        self.src, self.dst, self.cfg, self.stop, self.observer = src, dst, cfg, stop, observer
        self.result = MirrorResult()
        self.present: set[str] = set()  # chunk ids known to be at the destination, right size
        self._lock = threading.Lock()

    # --- one pass ---------------------------------------------------------------------------------
    def prepare(self) -> None:
        if self.src.url == self.dst.url:
            raise UsageError(f"mirror source and destination are the same store: {self.src.url}")
        self.src.require()
        if not self.dst.check():
            self.dst.init()

    def run_pass(self) -> None:
        self.result.passes += 1
        self.present.clear()  # a regional gc may have collected chunks since the last pass
        src_head = self.src.head_version()
        dst_head = self.dst.head_version()
        self.result.head, self.result.source_head = dst_head, src_head
        self._check_lineage(src_head, dst_head)
        self.observer.on_heads(src_head, dst_head)
        if src_head is None or (dst_head is not None and dst_head >= src_head):
            return
        for v in self.src.versions():
            if dst_head is not None and v <= dst_head:
                continue
            if self.stop.is_set():
                raise _Stopped
            self._copy_version(v)

    def _check_lineage(self, src_head: int | None, dst_head: int | None) -> None:
        if dst_head is None:
            return
        if src_head is None or dst_head > src_head:
            raise MirrorError(
                f"{self.dst.url} is not a mirror of {self.src.url}: its head {dst_head} is ahead of the source "
                f"head {src_head}"
            )
        try:
            ours = self.src.store.get(version_key(dst_head))
        except NotFoundError:
            return  # collected at the source: nothing left to compare with
        self._same_manifest(dst_head, ours)

    def _same_manifest(self, version: int, data: bytes) -> None:
        try:
            theirs = self.dst.store.get(version_key(version))
        except NotFoundError:
            raise MirrorError(
                f"{self.dst.url} is not a mirror of {self.src.url}: it has no manifest of version {version}"
            ) from None
        if theirs != data:
            raise MirrorError(f"{self.dst.url} is not a mirror of {self.src.url}: version {version} differs")

    # --- one version ------------------------------------------------------------------------------
    def _copy_version(self, version: int) -> None:
        key = version_key(version)
        try:  # with trusted keys, checked before anything of the version is copied
            data, signatures = self.src.read_version(version)
        except VersionError:
            return  # collected at the source since it was listed
        m = manifest_from_json(data, f"{self.src.url}/{key}")
        if m.version != version:
            raise VersionError(f"{self.src.url}/{key}: manifest claims version {m.version}")
        try:  # chunks are checked even under an existing manifest: a regional gc may be at work
            chunks, nbytes = self._copy_chunks(m.chunks)
        except NotFoundError:
            if self.src.store.head(key) is None:
                return  # collected at the source while we copied it
            raise
        try:
            self.dst.store.put(key, data, mode="create")
            written = True
        except AlreadyExistsError:  # an interrupted earlier pass, or another mirror
            self._same_manifest(version, data)
            written = False
        if signatures is not None:  # before the head: a reader that trusts keys finds them with the version
            self.dst.store.put(signature_key(version), signatures, mode="overwrite")
        self._move_head(version)
        if written:  # counted once the head is there: a head move that fails leaves it to the next pass
            self.result.copied_versions.append(version)
            self.observer.on_version(version, chunks, nbytes)
        else:
            self.result.skipped_versions.append(version)

    def _counted(self, ref: ChunkRef, copied: bool, moved: list[int]) -> None:
        """Count one chunk as it is done (the totals, ``moved`` of its version, ``on_chunk``); under the lock."""
        if copied:
            moved[0] += 1
            moved[1] += ref.size
            self.result.copied_chunks += 1
            self.result.copied_bytes += ref.size
        else:
            self.result.skipped_chunks += 1
        self.observer.on_chunk(copied, ref.size)

    def _copy_chunks(self, refs: tuple[ChunkRef, ...]) -> tuple[int, int]:
        """Copy the chunks the destination lacks; returns (chunks, bytes) copied.

        Each chunk is counted as soon as it is copied or found (even if the version fails later),
        so the totals and ``on_chunk`` follow a long copy chunk by chunk."""
        moved = [0, 0]
        todo: dict[str, ChunkRef] = {}
        with self._lock:
            for r in refs:
                if r.id in self.present or r.id in todo:  # an earlier version's, or a repeat in this one
                    self._counted(r, False, moved)
                else:
                    todo[r.id] = r

        def one(ref: ChunkRef) -> None:
            if self.stop.is_set():
                raise _Stopped
            # present chunks are touched (a regional gc spares them until their manifest lands);
            # the source is read, size and XXH3-128 verified, only for chunks the region lacks
            copied = self.dst.store_chunk(ref.id, ref.size, lambda: self.src.get_chunk(ref.id, ref.size))
            with self._lock:
                self.present.add(ref.id)
                self._counted(ref, copied, moved)

        pool = ThreadPoolExecutor(min(self.cfg.concurrency, max(1, len(todo))), thread_name_prefix="ws-mirror")
        try:
            futures = [pool.submit(one, ref) for ref in todo.values()]
            wait(futures, return_when=FIRST_EXCEPTION)
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
        for f in futures:
            if not f.cancelled() and f.exception() is not None:
                raise f.exception()
        return moved[0], moved[1]

    def _move_head(self, version: int) -> None:
        """Move the destination head forward to ``version``; never backward."""
        for _ in range(100):
            current, etag = self.dst.head()
            if current is not None and current >= version:
                self.result.head = current
                return
            try:
                self.dst.store.put_if_match(HEAD_KEY, head_to_json(version), etag)
                self.result.head = version
                return
            except PreconditionFailedError:
                continue
        raise VersionError(f"could not move the head of {self.dst.url} to {version}: too much contention")


def mirror(
    src: Repo,
    dst: Repo,
    follow: bool = False,
    config: MirrorConfig = MirrorConfig(),
    stop: threading.Event | None = None,
    observer: MirrorObserver | None = None,
) -> MirrorResult:
    """Copy ``src``'s versions into ``dst`` (see the module docstring).

    With ``follow``, keep polling the source head every ``config.interval`` seconds until ``stop``
    is set (an empty or unreachable source is waited for: ``observer.on_waiting``, ``on_error``); a
    pass that fails with a store error (network, throttling), or stops at a version ``src``'s
    trusted keys did not sign (the versions before it are copied, nothing of it), is reported to
    ``observer.on_error`` and retried at the next poll, while integrity errors (checksums, a
    destination that is not a mirror) end the mirror. Setting ``stop`` ends a pass between chunks;
    the version being copied is then left uncommitted (its chunks are reused by the next run).

    ``observer`` (a :class:`MirrorObserver`) hears of heads, chunks, versions, passes and errors.
    """
    stop = stop or threading.Event()
    t0 = time.perf_counter()
    observer = observer or MirrorObserver()
    m = _Mirror(src, dst, config, stop, observer)
    try:
        while follow:  # an empty source (no publisher yet) or an unreachable one is waited for, not fatal
            try:
                if src.check():
                    break
                observer.on_waiting(f"{src.url} is not a weightsync store yet (it is empty)")
            except NotAStoreError:
                raise
            except StoreError as exc:
                m.result.errors += 1
                observer.on_error(exc)
            if stop.wait(config.interval):
                return m.result
        m.prepare()
        while True:
            try:
                m.run_pass()
            except _Stopped:
                break
            except (MirrorError, NotAStoreError):
                raise
            except (StoreError, SignatureError) as exc:
                if not follow:
                    raise
                m.result.errors += 1
                observer.on_error(exc)
            else:
                observer.on_pass(m.result)
            if not follow or stop.wait(config.interval):
                break
    finally:
        m.result.seconds = time.perf_counter() - t0
    return m.result
