"""Regional mirrors: copy versions from one store into another in the store's commit order (chunks
verified, then a lazy-chunks note, then the manifest, then its signatures, then the head), so that
one cross-region transfer serves a region (docs/DESIGN.md: pipelining, sharding, lazy keyframes,
memory). A source repo with trusted keys makes the mirror commit only versions one of them signed
(docs/FORMAT.md section 7).

Chunks are copied as soon as they are named (parts of versions above the source head, manifests
above the destination head), many at once, by a pool of workers (:class:`_Copier`); one thread
polls the heads and commits versions strictly in order once their chunks are there."""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from weightsync.errors import (
    AlreadyExistsError,
    ChecksumError,
    FormatError,
    NotAStoreError,
    NotFoundError,
    PreconditionFailedError,
    SignatureError,
    StoreError,
    UsageError,
    VersionError,
    WeightsyncError,
)
from weightsync.format.keys import (
    HEAD_KEY,
    LAZY_PREFIX,
    PARTS_PREFIX,
    VERSIONS_PREFIX,
    chunk_key,
    parse_lazy_key,
    parse_part_key,
    parse_version_key,
    signature_key,
    version_key,
)
from weightsync.format.manifest import (
    ChunkRef,
    Manifest,
    head_to_json,
    lazy_candidates,
    manifest_from_json,
    part_from_json,
)
from weightsync.store.repo import Repo

log = logging.getLogger("weightsync.mirror")

KEYFRAME_PAYLOADS = ("eager", "lazy", "never")


class MirrorError(NotAStoreError):
    """The destination is not a mirror of the source (other lineage, or ahead of it)."""


@dataclass(frozen=True)
class MirrorConfig:
    """How a mirror process copies (docs/DESIGN.md, ``weightsync.sync.mirror``).

    ``concurrency``: chunk copies (and, for a committer, existence checks) in flight; memory is
    ``concurrency`` x chunk size (64 x 16 MiB = 1 GiB). ``interval``: seconds between polls of the
    source head. ``keyframe_payloads``: ``eager`` (a keyframe's full payloads before its head
    moves), ``lazy`` (after, at a lower priority than the next versions' chunks) or ``never``.
    ``shard``/``shards``: copy only the chunks whose id falls in shard ``shard`` of ``shards``
    (:func:`shard_of`). ``commit``: write notes, manifests, signatures and the head (a process
    without it only copies chunks). ``parts``: also copy the chunks named by parts of multi-rank
    publishes above the source head. ``refresh_seconds``: a chunk this process stored or checked
    longer ago than this is checked (and touched) again before a version that needs it commits,
    so a regional gc (whose grace period must exceed it) cannot have collected it meanwhile."""

    concurrency: int = 64
    interval: float = 1.0
    keyframe_payloads: str = "lazy"
    shard: int = 0
    shards: int = 1
    commit: bool = True
    parts: bool = True
    refresh_seconds: float = 300.0

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise UsageError(f"mirror concurrency must be at least 1, got {self.concurrency}")
        if not self.interval > 0:
            raise UsageError(f"--interval must be a number of seconds > 0, not {self.interval:g}")
        if self.keyframe_payloads not in KEYFRAME_PAYLOADS:
            raise UsageError(
                f"keyframe payloads must be one of {', '.join(KEYFRAME_PAYLOADS)}, got {self.keyframe_payloads!r}"
            )
        if not 1 <= self.shards <= 4096 or not 0 <= self.shard < self.shards:
            raise UsageError(f"mirror shard must be I/N with 0 <= I < N <= 4096, got {self.shard}/{self.shards}")
        if not self.refresh_seconds > 0:
            raise UsageError(f"mirror refresh must be positive, got {self.refresh_seconds}")


def parse_shard(text: str) -> tuple[int, int]:
    """``"I/N"`` -> ``(I, N)`` (``--shard``); :class:`UsageError` otherwise."""
    try:
        i, n = (int(x) for x in text.strip().split("/"))
    except ValueError:
        raise UsageError(f"--shard wants I/N (e.g. 0/4), got {text!r}") from None
    if not 1 <= n <= 4096 or not 0 <= i < n:
        raise UsageError(f"--shard {text}: wants 0 <= I < N <= 4096")
    return i, n


def shard_of(chunk_id: str, shards: int) -> int:
    """The shard of a chunk: its id's first 32 bits modulo ``shards`` (ids are XXH3 hashes: uniform)."""
    return int(chunk_id[:8], 16) % shards


@dataclass
class MirrorResult:
    """What a mirror run did: versions copied or already there, chunks copied or touched, bytes,
    lazily held keyframes, the heads seen, failed polls, seconds."""

    copied_versions: list[int] = field(default_factory=list)  # manifest written here, head moved to it
    skipped_versions: list[int] = field(default_factory=list)  # manifest already there, identical
    lazy_versions: list[int] = field(default_factory=list)  # committed with a lazy-chunks note (by us)
    completed_versions: list[int] = field(default_factory=list)  # notes cleared: the lazy chunks arrived
    copied_chunks: int = 0  # chunk totals: counted as each chunk is done, in failed polls too
    copied_bytes: int = 0
    skipped_chunks: int = 0  # already at the destination (touched, not copied)
    head: int | None = None  # the destination head when the mirror returned
    source_head: int | None = None  # the source head read by the last poll
    passes: int = 0  # polls
    errors: int = 0  # failed polls while following (each retried at the next poll)
    seconds: float = 0.0


@dataclass(frozen=True)
class MirrorStatus:
    """The link's state after a poll or a commit: heads (None: none yet), source versions above the
    destination head, since when (Unix time; None: caught up) a source head above the destination's
    has been seen, chunk copies and checks in flight, lazy chunks not yet at the destination."""

    source_head: int | None
    destination_head: int | None
    lag_versions: int
    behind_since: float | None
    in_flight: int
    lazy_pending: int


class MirrorObserver:
    """What a mirror reports as it runs (metrics, logs, health); every hook does nothing until a
    subclass overrides it. Each is called in the mirror's thread, except :meth:`on_chunk`."""

    def on_heads(self, source: int | None, destination: int | None) -> None:
        """A poll read both heads (None: no head yet)."""

    def on_chunk(self, copied: bool, nbytes: int) -> None:
        """A chunk is done: copied, or found already there (``copied`` False). Called from the
        copying threads, one call at a time, also in a poll that fails later (the result's chunk
        totals move with it)."""

    def on_version(self, version: int, chunks: int, nbytes: int, seconds: float = 0.0) -> None:
        """This mirror wrote ``version``'s manifest and the destination head is at (or past) it; the
        chunks and bytes it copied first for that version, and the seconds from when it first saw
        the version to its head."""

    def on_status(self, status: MirrorStatus) -> None:
        """The link's lag, copies in flight and lazy chunks pending, after each poll and commit."""

    def on_pass(self, result: MirrorResult) -> None:
        """A poll succeeded; ``result`` holds the running totals (``result.head``: the destination head)."""

    def on_error(self, exc: StoreError | SignatureError) -> None:
        """A poll failed with a store error, or stopped at a version the trusted keys did not sign,
        and will be retried at the next poll (``follow`` only)."""

    def on_waiting(self, reason: str) -> None:
        """Nothing to mirror yet (the source is not a weightsync store: it is empty); the mirror looks
        again at every poll (``follow`` only)."""


class _Stopped(Exception):
    pass


# --- the copier: a pool of workers over a priority queue of chunks ------------------------------------
QUEUED, RUNNING, DONE, MISSING, FAILED = "queued", "running", "done", "missing", "failed"


class _Entry:
    """One chunk this process copies (own shard) or checks (another shard's; a committer only)."""

    __slots__ = ("ref", "check", "status", "when", "round", "error", "prio", "owner", "copied")

    def __init__(self, ref: ChunkRef, check: bool, owner: int):
        self.ref, self.check, self.owner = ref, check, owner
        self.status, self.when, self.round, self.error, self.prio, self.copied = QUEUED, 0.0, 0, None, None, None


class _Copier:
    """``concurrency`` worker threads taking chunks by priority: ``(0, version)`` for chunks a version
    waits on, ``(1, version)`` for lazy ones (at most a quarter of the workers, and only while no
    needed chunk is queued or copied: on a link, bytes in flight share its bandwidth). A copy is
    :meth:`Repo.store_chunk` (the source read, size and XXH3 verified, only if the destination lacks
    it; a present one touched); a check is a HEAD at the destination (touched if older than
    ``refresh_seconds``). Results stay valid for ``refresh_seconds``; missing and failed ones are
    tried again after :meth:`new_round`."""

    def __init__(self, src: Repo, dst: Repo, cfg: MirrorConfig, counted):
        self.src, self.dst, self.cfg, self._counted = src, dst, cfg, counted
        self._cv = threading.Condition()
        self._heaps: tuple[list, list] = ([], [])  # needed, lazy
        self._entries: dict[str, _Entry] = {}
        self._seq = itertools.count()
        self._round = 0
        self._events = 0
        self._running = [0, 0]
        self._lazy_cap = max(1, cfg.concurrency // 4)
        self._closed = False
        self._store_now: float | None = None
        self._threads: list[threading.Thread] = []

    # --- the mirror thread's side ---
    def want(self, ref: ChunkRef, version: int, *, lazy: bool = False, check: bool = False) -> str:
        """The state of ``ref`` at the destination, queueing a copy (or a check) unless one is done,
        fresh, queued or running, or was found missing or failed in this round."""
        prio = (1 if lazy else 0, version)
        with self._cv:
            e = self._entries.get(ref.id)
            now = time.monotonic()
            stale = e is not None and (
                (e.status == DONE and now - e.when > self.cfg.refresh_seconds)
                or (e.status in (MISSING, FAILED) and e.round < self._round)
            )
            if e is None or stale:
                old, e = e, _Entry(ref, check, version if e is None else e.owner)
                e.error = None if old is None else old.error  # kept until a try succeeds
                self._entries[ref.id] = e
                self._push(e, prio)
            elif e.status == QUEUED and (prio < e.prio or (e.check and not check)):
                e.check = e.check and check  # a copy supersedes a check
                self._push(e, prio)  # the older heap item is skipped when popped
            return e.status

    def _push(self, e: _Entry, prio: tuple[int, int]) -> None:
        e.status, e.prio = QUEUED, prio
        heapq.heappush(self._heaps[prio[0]], (prio, next(self._seq), e))
        if not self._threads:
            self._start()
        self._cv.notify()

    def error(self, chunk_id: str) -> Exception | None:
        """Why the chunk failed, if its last try did and none runs now."""
        e = self._entries.get(chunk_id)
        return e.error if e is not None and e.status == FAILED else None

    def failed_last(self, chunk_id: str) -> bool:
        """The chunk's last try failed (it may be queued or running again)."""
        e = self._entries.get(chunk_id)
        return e is not None and e.error is not None

    def forget(self, chunk_id: str) -> None:
        """Drop what is known of a chunk (a queued copy still runs)."""
        with self._cv:
            e = self._entries.get(chunk_id)
            if e is not None and e.status != RUNNING:
                self._entries.pop(chunk_id, None)
                e.status = DONE  # a heap item left behind is skipped

    def new_round(self) -> None:
        """A poll: missing and failed chunks are tried again when next wanted; every 64 polls, what
        is known of chunks that would be checked again anyway is dropped (memory stays bounded)."""
        with self._cv:
            self._round += 1
            self._store_now = None
            if self._round % 64 == 0:
                now = time.monotonic()
                for cid in [
                    cid
                    for cid, e in self._entries.items()
                    if (e.status == DONE and now - e.when > self.cfg.refresh_seconds)
                    or (e.status in (MISSING, FAILED) and e.round < self._round)
                ]:
                    del self._entries[cid]  # a heap item of it (none: it is not queued) would be skipped

    def wait(self, seen: int, timeout: float) -> int:
        """Wait until a chunk is done after event ``seen`` (or ``timeout``); the current event count."""
        with self._cv:
            self._cv.wait_for(lambda: self._events != seen or self._closed, timeout)
            return self._events

    @property
    def events(self) -> int:
        return self._events

    @property
    def in_flight(self) -> int:
        return self._running[0] + self._running[1]

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        for t in self._threads:
            t.join()

    # --- the workers ---
    def _start(self) -> None:
        for i in range(self.cfg.concurrency):
            t = threading.Thread(target=self._work, name=f"ws-mirror-{i}", daemon=True)
            t.start()
            self._threads.append(t)

    def _pick(self) -> tuple[int, _Entry] | None:
        for kind in (0, 1):
            heap = self._heaps[kind]
            while heap and (heap[0][2].status != QUEUED or heap[0][2].prio != heap[0][0]):
                heapq.heappop(heap)  # superseded by a higher priority, or forgotten
            # lazy copies only while no needed one runs: they would share the link's bandwidth
            if heap and (kind == 0 or (self._running[0] == 0 and self._running[1] < self._lazy_cap)):
                return kind, heapq.heappop(heap)[2]
        return None

    def _work(self) -> None:
        while True:
            with self._cv:
                while not self._closed and (picked := self._pick()) is None:
                    self._cv.wait()
                if self._closed:
                    return
                kind, e = picked
                e.status = RUNNING
                self._running[kind] += 1
            status, copied, error = DONE, None, None
            try:
                if e.check:
                    status = DONE if self._check(e.ref) else MISSING
                else:
                    ref = e.ref
                    copied = self.dst.store_chunk(
                        ref.id, ref.size, lambda r=ref: self.src.get_chunk(r.id, r.size), verify_existing=True
                    )
            except Exception as exc:  # noqa: BLE001 - kept for the mirror thread, which decides
                status, error = FAILED, exc
            if copied is not None:
                self._counted(e, copied)
            with self._cv:
                self._running[kind] -= 1
                if e.status == RUNNING:  # not forgotten meanwhile
                    e.status, e.when, e.round, e.error, e.copied = status, time.monotonic(), self._round, error, copied
                self._events += 1
                self._cv.notify_all()

    def absent(self, refs: list[ChunkRef]) -> list[str]:
        """The chunks of ``refs`` not at the destination with their size now (HEADs, in parallel)."""
        if not refs:
            return []
        store = self.dst.store
        with ThreadPoolExecutor(min(self.cfg.concurrency, len(refs)), thread_name_prefix="ws-mirror-look") as pool:
            sizes = list(pool.map(lambda r: store.head(chunk_key(r.id)), refs))
        return [r.id for r, size in zip(refs, sizes) if size != r.size]

    def _check(self, ref: ChunkRef) -> bool:
        """Another shard's chunk is at the destination with its size (touched if old)."""
        store = self.dst.store
        meta = store.head_meta(chunk_key(ref.id))
        if meta is None or meta.size != ref.size:
            return False
        if meta.last_modified is not None:
            if self._store_now is None:
                self._store_now = store.now()  # once a round: the store's clock
            if self._store_now - meta.last_modified > self.cfg.refresh_seconds:
                try:
                    store.touch(chunk_key(ref.id))
                except NotFoundError:
                    return False  # collected by gc since the HEAD
        return True


# --- one version on its way ----------------------------------------------------------------------------
@dataclass
class _Version:
    version: int
    data: bytes
    signatures: bytes | None
    manifest: Manifest
    refs: dict[str, ChunkRef]  # every chunk the manifest names, by id
    lazy: frozenset[str]  # left out before the head moves
    seen: float  # monotonic time it was first seen
    waiting: set[str] | None = None  # needed chunks not yet seen done (None: not looked at yet)
    chunks: int = 0  # copied first for this version
    nbytes: int = 0
    absent: frozenset[str] = frozenset()  # noted at the source itself (a lazy region): noted here too, never copied


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
        self._lock = threading.Lock()  # the totals and on_chunk
        self.copier = _Copier(src, dst, cfg, self._counted)
        self.pending: dict[int, _Version] = {}  # manifests above the destination head, by version
        self.listed_to = -1  # highest source version looked at
        self.listed: list[int] = []  # source versions above the destination head, from the last listing
        self.parts: dict[str, int] = {}  # part keys read (their chunks queued) -> version
        self.lazy_open: dict[int, dict[str, ChunkRef]] = {}  # committed with a note: chunks not yet confirmed
        self.lazy_noted: dict[int, dict[str, ChunkRef]] = {}  # ... and all the chunks its note names
        self.committed: set[int] = set()  # by this process
        self.src_head: int | None = None
        self.dst_head: int | None = None
        self._src_head: int | None = None  # the heads as last read, and their tags (conditional reads)
        self._src_etag: str | None = None
        self._src_moved = True  # the source head's tag changed at the last read
        self._lineage_etag: str | None = None  # the source's tag of the checked head's manifest
        self._dst_head_read: int | None = None
        self._dst_etag: str | None = None
        self.target: int | None = None  # one-shot: the source head of the first poll
        self.checked_head: int | None = None  # destination head whose lineage was checked
        self.first_seen: dict[int, float] = {}  # source head -> Unix time first seen
        self.refusal: SignatureError | None = None
        self.polls = 0
        self.follow = False

    def _own(self, chunk_id: str) -> bool:
        return self.cfg.shards == 1 or shard_of(chunk_id, self.cfg.shards) == self.cfg.shard

    def _counted(self, e: _Entry, copied: bool) -> None:
        """Count one chunk as it is done (the totals, its version's, ``on_chunk``); from a worker."""
        with self._lock:
            if copied:
                self.result.copied_chunks += 1
                self.result.copied_bytes += e.ref.size
                v = self.pending.get(e.owner)
                if v is not None:
                    v.chunks += 1
                    v.nbytes += e.ref.size
            else:
                self.result.skipped_chunks += 1
            self.observer.on_chunk(copied, e.ref.size)

    # --- setup and the source head ---
    def prepare(self) -> None:
        if self.src.url == self.dst.url:
            raise UsageError(f"mirror source and destination are the same store: {self.src.url}")
        self.src.require()
        if not self.dst.check():
            self.dst.init()  # the marker (create-only): any shard may be first

    def source_head(self) -> int | None:
        """The source head: the one read a poll makes of the source when nothing changed, a
        conditional GET (one small request without a body, a ``304`` on S3, while it is unchanged)."""
        got = self.src.head_if_changed(self._src_etag)
        self._src_moved = got is not None
        if got is not None:
            self._src_head, self._src_etag = got
        return self._src_head

    def destination_head(self) -> int | None:
        """The destination head, read conditionally as :meth:`source_head`."""
        got = self.dst.head_if_changed(self._dst_etag)
        if got is not None:
            self._dst_head_read, self._dst_etag = got
        return self._dst_head_read

    # --- a poll ---
    def poll(self, follow: bool) -> None:
        self.follow = follow
        self.result.passes += 1
        self.polls += 1
        self.copier.new_round()
        src_head = self.source_head()
        dst_head = self.destination_head()
        self._check_lineage(src_head, dst_head)
        if not follow:  # one-shot: up to the source head of the first poll
            self.target = src_head if self.target is None else self.target
            src_head = self.target
        self.src_head, self.result.source_head = src_head, src_head
        self._set_dst_head(dst_head)
        self.observer.on_heads(src_head, dst_head)
        if src_head is not None and (dst_head is None or src_head > dst_head):
            self.first_seen.setdefault(src_head, time.time())
        if self.polls == 1:
            self._load_notes()
        self.refusal = None
        self._discover(src_head)

    def poll_parts(self) -> None:
        """Queue the chunks of parts above the source head (after the poll's commits: the listing is
        a round trip that a version ready to commit need not wait for)."""
        if self.cfg.parts and self.follow:
            self._discover_parts(self.src_head)

    def _set_dst_head(self, head: int | None) -> None:
        self.dst_head = self.result.head = head
        if head is None:
            return
        for v in [v for v in self.pending if v <= head]:  # committed by another committer
            ver = self.pending.pop(v)
            if ver.lazy:
                self._opened(v, {i: ver.refs[i] for i in ver.lazy})
        for h in [h for h in self.first_seen if h <= head]:
            del self.first_seen[h]
        self.committed = {v for v in self.committed if v >= head}  # older ones: a HEAD tells

    def _check_lineage(self, src_head: int | None, dst_head: int | None) -> None:
        """The destination's head manifest is the source's (one conditional read once it was checked,
        again whenever the source head moves: a source rewritten by another run is refused)."""
        if dst_head is None:
            return
        if src_head is None or dst_head > src_head:
            raise MirrorError(
                f"{self.dst.url} is not a mirror of {self.src.url}: its head {dst_head} is ahead of the source "
                f"head {src_head}"
            )
        known = dst_head == self.checked_head
        if known and not self._src_moved:
            return
        try:
            got = self.src.store.get_if_changed(version_key(dst_head), self._lineage_etag if known else None)
        except NotFoundError:
            got = None  # collected at the source: nothing left to compare with
        if got is not None:
            self._same_manifest(dst_head, got[0])
            self._lineage_etag = got[1]
        self.checked_head = dst_head

    def _same_manifest(self, version: int, data: bytes) -> None:
        try:
            theirs = self.dst.store.get(version_key(version))
        except NotFoundError:
            raise MirrorError(
                f"{self.dst.url} is not a mirror of {self.src.url}: it has no manifest of version {version}"
            ) from None
        if theirs != data:
            raise MirrorError(f"{self.dst.url} is not a mirror of {self.src.url}: version {version} differs")

    def _discover(self, src_head: int | None) -> None:
        """Read (and verify) the source manifests above what is known, queue their chunks."""
        if src_head is None:
            return
        floor = max(self.listed_to, -1 if self.dst_head is None else self.dst_head)
        if src_head > floor:
            read: dict[int, tuple[bytes, bytes | None, Manifest]] = {}
            try:  # the head's manifest first: when its parent is known, no listing is needed
                data, signatures = self.src.read_version(src_head)
                what = f"{self.src.url}/{version_key(src_head)}"
                read[src_head] = data, signatures, manifest_from_json(data, what)
            except (VersionError, SignatureError):
                pass  # the loop below meets it again, in order
            parent = read[src_head][2].parent if src_head in read else src_head
            if parent is None or parent <= floor:  # the head is the only version above what is known
                self.listed = sorted({v for v in self.listed if v <= src_head} | {src_head})
            else:
                found = (parse_version_key(k) for k in self.src.store.list(VERSIONS_PREFIX))
                self.listed = sorted(v for v in found if v is not None and v <= src_head)
            for v in self.listed:
                if v <= floor or v in self.pending:
                    continue
                if self.stop.is_set():
                    raise _Stopped
                try:  # with trusted keys, checked before anything of the version is queued
                    data, signatures, m = read.pop(v) if v in read else (*self.src.read_version(v), None)
                except VersionError:
                    continue  # collected at the source since it was listed
                except SignatureError as exc:  # not copied; later versions go on, as a reader's would: a
                    # keyframe after it needs nothing of it, a delta on it is dropped (``_ready``)
                    self.refusal = exc  # the last: past it, every earlier one is passed too
                    continue
                m = m or manifest_from_json(data, f"{self.src.url}/{version_key(v)}")
                if m.version != v:
                    raise VersionError(f"{self.src.url}/{version_key(v)}: manifest claims version {m.version}")
                refs = {r.id: r for r in m.chunks}
                lazy = frozenset()
                if self.cfg.keyframe_payloads != "eager" and m.parent is not None and self._parent_coming(m.parent):
                    lazy = lazy_candidates(m)
                # a lazy region as the source lacks some chunks of its keyframes (notes exist for keyframes only)
                absent = self.src.lazy_chunks(v) & refs.keys() if m.keyframe else frozenset()
                self.pending[v] = _Version(v, data, signatures, m, refs, lazy | absent, time.monotonic(), absent=absent)
                self.listed_to = v
                for r in refs.values():
                    if r.id not in lazy | absent and self._own(r.id):
                        self.copier.want(r, v)
            if self.refusal is not None:  # read again at the next poll while the head has not passed it:
                self.listed_to = min(self.listed_to, self.refusal.version - 1)  # still refused, or mended
        self.listed = [v for v in self.listed if self.dst_head is None or v > self.dst_head]

    def _parent_coming(self, parent: int) -> bool:
        """The parent is at the destination, or will be committed before its child."""
        return parent in self.pending or parent in self.committed or self._dst_has(parent)

    def _dst_has(self, version: int) -> bool:
        if self.dst_head is None or version > self.dst_head:
            return False
        if self.dst.store.head(version_key(version)) is None:
            return False
        self.committed.add(version)  # remembered: no HEAD again
        return True

    def _discover_parts(self, src_head: int | None) -> None:
        """Queue the chunks of parts of versions above the source head (a multi-rank publish in
        progress). Parts are not signed: a hostile one costs bytes, never a commit."""
        live = set()
        for key in self.src.store.list(PARTS_PREFIX):
            parsed = parse_part_key(key)
            if parsed is None or (src_head is not None and parsed[0] <= src_head):
                continue
            live.add(key)
            if key in self.parts:
                continue
            self.parts[key] = parsed[0]
            try:
                part = part_from_json(self.src.store.get(key), f"{self.src.url}/{key}")
            except (NotFoundError, FormatError) as exc:  # gone, or damaged: its committer refuses it
                log.debug("mirror: skipping part %s: %s", key, exc)
                continue
            lazy = frozenset()  # a keyframe's full payloads: left for after its commit, as its manifest will say
            if self.cfg.keyframe_payloads != "eager" and part.parent is not None and self._parent_coming(part.parent):
                lazy = lazy_candidates(part)
            for r in part.chunks:
                if self._own(r.id) and r.id not in lazy:
                    self.copier.want(r, parsed[0])
        for key in [k for k in self.parts if k not in live]:
            del self.parts[key]

    def _load_notes(self) -> None:
        """Lazy notes at the destination (an earlier run's): their chunks are still to copy."""
        for key in self.dst.store.list(LAZY_PREFIX):
            v = parse_lazy_key(key)
            if v is None or self.dst_head is None or v > self.dst_head:
                continue  # a note above the head: its version is decided again when committed
            try:
                ids = self.dst.lazy_chunks(v)
                m = manifest_from_json(self.dst.store.get(version_key(v)), f"{self.dst.url}/{version_key(v)}")
            except (NotFoundError, FormatError) as exc:
                log.debug("mirror: skipping the note of version %d: %s", v, exc)
                continue
            refs = {r.id: r for r in m.chunks}
            self._opened(v, {i: refs[i] for i in ids if i in refs})

    def _opened(self, version: int, refs: dict[str, ChunkRef]) -> None:
        """``version`` is committed at the destination without ``refs``: copy them later (``lazy``)."""
        if self.cfg.keyframe_payloads == "never" or not refs:
            return  # the note stays; readers rebuild or read the source
        self.lazy_open[version], self.lazy_noted[version] = refs, dict(refs)
        for r in refs.values():
            if self._own(r.id):
                self.copier.want(r, version, lazy=True)

    # --- commits, in order ---
    def advance(self) -> None:
        """Commit every version whose chunks are there (a committer), in order; track lazy chunks."""
        while self.pending:
            v = min(self.pending)
            ver = self.pending[v]
            if not self._ready(ver):
                break
            if self.cfg.commit:
                self._commit(ver)
            else:
                break  # a shard waits for the committer's head (read at the next poll)
        self._advance_lazy()
        if self.refusal is not None and self.dst_head is not None and self.dst_head > self.refusal.version:
            self.refusal = None  # passed over: a later version that needs nothing of it is committed
        if self.refusal is not None and not self.pending:
            self._report()  # the lag gauges say the region is behind
            raise self.refusal

    def _needed(self, ver: _Version) -> list[str]:
        """The chunks of ``ver`` this process waits on: all but the lazy ones for a committer (another
        shard's are checked), its own shard's for a copier."""
        return [c for c in ver.refs if c not in ver.lazy and (self.cfg.commit or self._own(c))]

    def _ready(self, ver: _Version) -> bool:
        """Every chunk of ``ver`` but its lazy ones is at the destination (own shard: copied or
        touched by us; others': checked, committers only). Raises on a failed chunk, unless the
        source collected the version meanwhile (then it is dropped). Only the chunks not yet seen
        done are looked at, then all once more (none may have gone stale meanwhile)."""
        if not ver.manifest.keyframe and not self._parent_coming(ver.manifest.parent):
            del self.pending[ver.version]  # a delta from nothing here: the source's gc takes it next
            log.info(
                "mirror: version %d is not copied: its parent %d was collected at the source, or refused, "
                "before it got here",
                ver.version,
                ver.manifest.parent,
            )
            return False
        if ver.lazy - ver.absent and not self._parent_coming(ver.manifest.parent):
            ver.lazy, ver.waiting = ver.absent, None  # its parent did not make it here: copied whole
        if ver.waiting is None:
            ver.waiting = set(self._needed(ver))
        for final in (False, True):
            for cid in list(ver.waiting if not final else self._needed(ver)):
                own = self._own(cid)
                status = self.copier.want(ver.refs[cid], ver.version, check=not own)
                if status == FAILED:
                    exc = self.copier.error(cid)
                    if isinstance(exc, NotFoundError) and self.src.store.head(version_key(ver.version)) is None:
                        del self.pending[ver.version]  # collected at the source while we copied it
                        log.info("mirror: version %d was collected at the source while it was copied", ver.version)
                        return False
                    raise exc
                if status == DONE:
                    ver.waiting.discard(cid)
                else:
                    ver.waiting.add(cid)
            if ver.waiting:
                return False
        if not self.cfg.commit:
            return True  # a shard waits for the committer, which looks once more itself
        # a last look right before the commit: a regional gc with a short grace may have collected
        # chunks copied ahead while they were unreferenced here (one HEAD each, in parallel)
        gone = self.copier.absent([ver.refs[c] for c in self._needed(ver)])
        for cid in gone:
            log.warning(
                "mirror: version %d: chunk %s vanished from %s before the commit; copying it again",
                ver.version,
                cid,
                self.dst.url,
            )
            self.copier.forget(cid)
            self.copier.want(ver.refs[cid], ver.version, check=not self._own(cid))
        ver.waiting = set(gone)
        return not gone

    def _commit(self, ver: _Version) -> None:
        v, key = ver.version, version_key(ver.version)
        if ver.lazy:  # before the manifest: no reader sees the version without its note
            self.dst.note_lazy_chunks(v, ver.lazy)
        else:
            self.dst.clear_lazy_chunks(v)  # a note an earlier run left: every chunk is there now
        try:
            self.dst.store.put(key, ver.data, mode="create")
            written = True
        except AlreadyExistsError:  # an interrupted earlier run, or another committer
            self._same_manifest(v, ver.data)
            written = False
        if ver.signatures is not None:  # before the head: a reader that trusts keys finds them with the version
            self.dst.store.put(signature_key(v), ver.signatures, mode="overwrite")
        self.committed.add(v)
        self._move_head(v)  # the version leaves `pending` (and its lazy chunks are queued) with the head
        if self.checked_head != self.dst_head:  # our own manifest: the lineage holds (its source tag unknown)
            self.checked_head, self._lineage_etag = self.dst_head, None
        self._report()
        if written:  # counted once the head is there: a head move that fails leaves it to the next poll
            self.result.copied_versions.append(v)
            if ver.lazy:
                self.result.lazy_versions.append(v)
            self.observer.on_version(v, ver.chunks, ver.nbytes, time.monotonic() - ver.seen)
        else:
            self.result.skipped_versions.append(v)

    def _move_head(self, version: int) -> None:
        """Move the destination head forward to ``version``; never backward."""
        for _ in range(100):
            current, etag = self.dst.head()
            if current is not None and current >= version:
                self._set_dst_head(current)
                return
            try:
                self.dst.store.put_if_match(HEAD_KEY, head_to_json(version), etag)
            except PreconditionFailedError:
                continue
            if self.dst.head_on_collected(version, current):  # a regional gc took it while this mirror stalled
                self.committed.discard(version)
                self._set_dst_head(current)
                raise VersionError(
                    f"version {version} of {self.dst.url} was collected by gc before the head moved to it (the "
                    f"mirror stalled longer than gc's grace period); the head is back at {current}; copied again next"
                )
            self._set_dst_head(version)
            return
        raise VersionError(f"could not move the head of {self.dst.url} to {version}: too much contention")

    def _advance_lazy(self) -> None:
        """Lazy chunks still to copy (or, for a committer, to check), by version; a committer clears
        a version's note once all are there."""
        if self.cfg.keyframe_payloads == "never":
            return
        for v in sorted(self.lazy_open):
            refs = self.lazy_open[v]
            for r in list(refs.values()):
                own = self._own(r.id)
                if not own and not self.cfg.commit:
                    del refs[r.id]  # another shard's
                    continue
                status = self.copier.want(r, v, lazy=True, check=not own)
                if status == DONE:
                    del refs[r.id]  # referenced by a committed manifest: gc keeps it
                elif status == FAILED:
                    exc = self.copier.error(r.id)
                    if isinstance(exc, ChecksumError) or (not self.follow and not isinstance(exc, NotFoundError)):
                        raise exc
                    if isinstance(exc, NotFoundError):  # the source collected it: readers rebuild it
                        log.info("mirror: version %d: lazy chunk %s is gone from the source", v, r.id)
                        self.copier.forget(r.id)
                        del self.lazy_open[v], self.lazy_noted[v]
                        break
            else:
                if not refs:
                    if self.cfg.commit and self._lazy_gone(v):
                        continue  # copied again first
                    if self.cfg.commit:
                        self.dst.clear_lazy_chunks(v)
                        self.result.completed_versions.append(v)
                    del self.lazy_open[v], self.lazy_noted[v]

    def _lazy_gone(self, v: int) -> bool:
        """A last look before a note is cleared (its chunks were seen done up to ``refresh_seconds``
        ago, and a regional gc with a short grace may have collected one since, unreferenced by the
        manifest as far as it knew): those gone are copied again, and the note stays until then."""
        noted = self.lazy_noted[v]
        gone = self.copier.absent(list(noted.values()))
        for cid in gone:
            log.warning("mirror: version %d: lazy chunk %s vanished from %s; copying it again", v, cid, self.dst.url)
            self.copier.forget(cid)
            self.lazy_open[v][cid] = noted[cid]
            self.copier.want(noted[cid], v, lazy=True, check=not self._own(cid))
        return bool(gone)

    # --- the loop's bookkeeping ---
    def status(self) -> MirrorStatus:
        behind = [t for h, t in self.first_seen.items() if self.dst_head is None or h > self.dst_head]
        lag = len([v for v in self.listed if self.dst_head is None or v > self.dst_head])
        if self.src_head is not None and lag == 0 and (self.dst_head is None or self.src_head > self.dst_head):
            lag = 1  # the listing has not caught up with the head yet
        lazy = sum(len(refs) for refs in self.lazy_open.values())
        return MirrorStatus(
            self.src_head, self.dst_head, lag, min(behind) if behind else None, self.copier.in_flight, lazy
        )

    def _report(self) -> None:
        self.observer.on_status(self.status())

    def failing(self) -> bool:
        """A chunk a version waits on failed at its last try."""
        return any(self.copier.failed_last(c) for ver in self.pending.values() for c in (ver.waiting or ()))

    def finished(self) -> bool:
        """One-shot: every version up to the target committed (by us or a committer), and the lazy
        chunks copied (``lazy``), or, for a shard that does not commit, its own chunks copied."""
        if self.refusal is not None:
            return False
        if self.cfg.commit and self.pending:
            return False
        if not self.cfg.commit:
            for ver in self.pending.values():
                if ver.waiting is None:
                    ver.waiting = set(self._needed(ver))
                ver.waiting -= {c for c in ver.waiting if self.copier.want(ver.refs[c], ver.version) == DONE}
                if ver.waiting:
                    return False
        if self.cfg.shards == 1:
            return not self.lazy_open  # the notes cleared too
        return all(  # another shard's lazy chunks are that shard's business (a following committer clears notes)
            self.copier.want(r, v, lazy=True) == DONE
            for v, refs in self.lazy_open.items()
            for r in refs.values()
            if self._own(r.id)
        )


def mirror(
    src: Repo,
    dst: Repo,
    follow: bool = False,
    config: MirrorConfig = MirrorConfig(),
    stop: threading.Event | None = None,
    observer: MirrorObserver | None = None,
) -> MirrorResult:
    """Copy ``src``'s versions into ``dst`` (see the module docstring and docs/DESIGN.md).

    Without ``follow``, copies every version up to the source head read first (and, with
    ``keyframe_payloads="lazy"``, the lazily held full payloads) and returns. With ``follow``,
    polls the source head every ``config.interval`` seconds until ``stop`` is set (an empty or
    unreachable source is waited for: ``observer.on_waiting``, ``on_error``); a poll that fails
    with a store error (network, throttling), or stops at a version ``src``'s trusted keys did not
    sign (the versions before it are committed, nothing of it), is reported to
    ``observer.on_error`` and retried at the next poll, while integrity errors (checksums, a
    destination that is not a mirror) end the mirror. Setting ``stop`` ends it between chunks; the
    versions being copied are left uncommitted (their chunks are reused by the next run).
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
        _loop(m, follow)
    finally:
        m.copier.close()
        m.result.seconds = time.perf_counter() - t0
    return m.result


def _loop(m: _Mirror, follow: bool) -> None:
    """Poll, then commit as chunks land until the next poll is due; one-shot: until finished."""
    cfg, stop, observer = m.cfg, m.stop, m.observer
    while not stop.is_set():
        due = time.monotonic() + cfg.interval
        try:
            m.poll(follow)
            m.advance()
            m.poll_parts()
            m._report()
            seen = m.copier.events
            while not stop.is_set() and (follow or not m.finished()):
                left = due - time.monotonic()
                if left <= 0:
                    break
                seen = m.copier.wait(seen, left)
                m.advance()
                m._report()
        except _Stopped:
            return
        except (MirrorError, NotAStoreError, ChecksumError, FormatError):
            raise
        except (StoreError, SignatureError) as exc:
            if not follow:
                raise
            m.result.errors += 1
            observer.on_error(exc)
        except WeightsyncError:
            raise
        else:
            if not m.failing():  # a chunk a version waits on that failed, and was not retried yet: no success
                observer.on_pass(m.result)
            if not follow and m.finished():
                return
        if follow:
            stop.wait(max(0.0, due - time.monotonic()))
