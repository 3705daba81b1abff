"""Publishing a checkpoint directory as a new version: diff against the parent, encode, upload, commit.

Memory: at most ``inflight_bytes`` (256 MiB) of segments being read and encoded at once, but always
at least one segment (its new and old bytes and its payload: about 2x the largest tensor, with the
small ones handed to the same worker before it), plus the
uploader's bound (``upload_concurrency * chunk_bytes`` = 32 x 16 MiB = 512 MiB by default).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import xxhash

from weightsync.codec.payload import CodecConfig, EncodedTensor, encode_tensor
from weightsync.errors import BaseMismatchError, NotFoundError, UsageError, VersionError, WeightsyncError
from weightsync.format.chunking import DEFAULT_CHUNK_BYTES, ChunkPacker
from weightsync.format.dtypes import itemsize
from weightsync.format.keys import HEAD_KEY, MAX_VERSION, STATE_DIR, chunk_key
from weightsync.format.manifest import ChunkRef, Delta, FileEntry, Manifest, Payload, Segment
from weightsync.format.safetensors import SourceSegment
from weightsync.local.base import LocalVersion, adopt
from weightsync.local.checkpoint import (
    SourceFile,
    check_header,
    check_still_as_scanned,
    check_unchanged,
    open_sources,
    read_range,
    scan_checkpoint,
    still_as_scanned,
)
from weightsync.local.install import clear_folder
from weightsync.local.lock import FolderLock, claim
from weightsync.local.scratch import ScratchDir
from weightsync.local.state import holds, read_state, version_holder
from weightsync.store import same_store
from weightsync.store.repo import Repo, StoreLike, open_repo
from weightsync.store.signing import Keyring, SigningKey
from weightsync.sync.observer import Observer, Operation, observer_of
from weightsync.sync.pipeline import TASK_BYTES, default_threads, ordered_map
from weightsync.sync.pull import PullConfig, pull
from weightsync.sync.transfer import Uploader

REFRESH_AFTER = 900.0  # seconds: see PublishConfig.refresh_after
log = logging.getLogger("weightsync.publish")


@dataclass(frozen=True)
class PublishConfig:
    """How a version is cut and coded (codec settings, chunk size, keyframe interval, files to
    ignore), the bounds of publishing it (upload streams, encode threads, bytes in flight), and the
    key that signs what is committed (None: versions are not signed)."""

    codec: CodecConfig = field(default_factory=CodecConfig)
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    keyframe_interval: int = 20
    upload_concurrency: int = 32  # ~32 streams of ~100 MB/s fill a 25 Gb/s link
    encode_threads: int = field(default_factory=default_threads)
    inflight_bytes: int = 256 << 20
    ignore: tuple[str, ...] = ()  # globs of relative paths not to publish (e.g. "COMPLETE")
    # chunks stored longer ago than this are touched again right before the commit (or part), so
    # that gc's grace (default 3600 s) need only cover the commit, not the whole publish
    refresh_after: float = REFRESH_AFTER
    sources: list[SourceFile] = field(default_factory=list)  # the checkpoint's files as read (to check before a commit)
    # signs each version committed with this config (docs/FORMAT.md section 7); None: unsigned
    signing_key: SigningKey | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.keyframe_interval < 1:
            raise UsageError("keyframe interval must be at least 1")
        if self.chunk_bytes < 1024:
            raise UsageError("chunk size must be at least 1 KiB")
        if self.upload_concurrency < 1 or self.encode_threads < 1 or self.inflight_bytes < 1:
            raise UsageError("concurrency and memory limits must be positive")
        if not self.refresh_after >= 0:
            raise UsageError("refresh_after must be a number of seconds >= 0")


@dataclass
class PublishResult:
    """What a publish committed: the version, its parent, keyframe flag, bytes of the files and of the
    payloads, bytes uploaded (chunks the store already held are not), chunks, elements changed of
    all, and seconds per phase (``total`` from the start)."""

    version: int
    parent: int | None
    keyframe: bool
    raw_bytes: int
    payload_bytes: int
    uploaded_bytes: int
    chunks: int
    changed: int
    elements: int
    seconds: dict[str, float]

    @property
    def ratio(self) -> float:
        """Bytes of the files per byte of payload."""
        return self.raw_bytes / max(1, self.payload_bytes)

    @property
    def changed_fraction(self) -> float:
        """Fraction of the elements that changed from the parent."""
        return self.changed / max(1, self.elements)


@dataclass
class _Job:
    file: SourceFile
    seg: SourceSegment
    base_seg: Segment | None


class _Encoder:
    """Reads, diffs and encodes segments on a thread pool; results come back in file order."""

    def __init__(self, cfg: PublishConfig, base: LocalVersion | None, fds: dict[str, int], keyframe: bool):
        self.cfg, self.base, self.fds, self.keyframe = cfg, base, fds, keyframe
        self.seconds = {"read": 0.0, "diff": 0.0, "encode": 0.0}
        self._lock = threading.Lock()

    def _timed(self, phase: str, since: float) -> float:
        t1 = time.perf_counter()
        with self._lock:
            self.seconds[phase] += t1 - since
        return t1

    def run(self, job: _Job) -> tuple[np.ndarray, str, EncodedTensor, EncodedTensor | None]:
        """Returns the new bytes, their checksum, the encoding, and for keyframes the delta too."""
        t = time.perf_counter()
        new = read_range(self.fds[job.file.path], job.seg.begin, job.seg.end, job.file.path)
        if job.seg.role == "header":
            check_header(job.file, new)
        digest = xxhash.xxh3_128_hexdigest(new)
        t = self._timed("read", t)
        old = None
        if job.base_seg is not None:
            old = self.base.read(job.file.path, job.base_seg)
            t = self._timed("diff", t)
        delta = None
        if old is not None:
            same = job.base_seg.xxh3 == digest and np.array_equal(old, new)
            delta = EncodedTensor("same", b"", 0) if same else encode_tensor(job.seg.dtype, new, old, self.cfg.codec)
            del old  # a keyframe's full encoding does not need it: keep the peak at two tensors
        enc = encode_tensor(job.seg.dtype, new, None, self.cfg.codec) if self.keyframe or delta is None else delta
        self._timed("encode", t)
        return new, digest, enc, delta if self.keyframe else None

    def file_read(self, f: SourceFile) -> None:
        """Every segment of ``f`` was read: it must still be the file scanned (not written meanwhile)."""
        check_unchanged(self.fds[f.path], f)


def _jobs(files: list[SourceFile], parent: Manifest | None) -> list[_Job]:
    jobs = []
    for f in files:
        pf = None if parent is None else parent.file(f.path)
        for seg in f.segments:
            base = None
            if pf is not None:
                base = pf.segment(seg.key)
                if base is not None and (base.dtype, base.shape) != (seg.dtype, seg.shape):
                    base = None  # changed shape or dtype: encode in full
            jobs.append(_Job(f, seg, base))
    return jobs


class _Assembler:
    """Consumes encoded segments in file order: file checksums, chunk packing, manifest entries."""

    def __init__(self, cfg: PublishConfig, uploader: Uploader):
        self.packer = ChunkPacker(cfg.chunk_bytes)
        self.delta_packer = ChunkPacker(cfg.chunk_bytes, self.packer.refs)  # keyframe deltas apart
        self.reverse_packer = ChunkPacker(cfg.chunk_bytes, self.packer.refs)  # apart: a pull forward never reads them
        self.uploader = uploader
        self.files: list[FileEntry] = []
        self.changed = self.elements = 0
        self._segs: list[Segment] = []
        self._hasher = xxhash.xxh3_128()
        self._digests = cfg.signing_key is not None  # a signed version names its payloads by SHA-256 too

    def _pack(self, enc: EncodedTensor, packer: ChunkPacker) -> Payload | None:
        if enc.codec == "same":
            return None
        reverse = None
        if enc.reverse:
            reverse = self._payload(enc.reverse, self.reverse_packer)
        return self._payload(enc.payload, packer, reverse)

    def _payload(self, data: bytes | bytearray, packer: ChunkPacker, reverse: Payload | None = None) -> Payload:
        parts, _ = packer.add(data, self.uploader.submit)
        sha = hashlib.sha256(data).hexdigest() if self._digests else ""
        return Payload(len(data), xxhash.xxh3_128_hexdigest(data), parts, sha, reverse)

    def add(self, job: _Job, new: np.ndarray, digest: str, enc: EncodedTensor, delta: EncodedTensor | None) -> None:
        self._hasher.update(new)
        payload = self._pack(enc, self.packer)
        alt = None if delta is None else Delta(delta.codec, delta.changed, self._pack(delta, self.delta_packer))
        s = job.seg
        self._segs.append(
            Segment(s.role, s.name, s.dtype, s.shape, s.begin, s.end, digest, enc.codec, enc.changed, payload, alt)
        )
        if s.role == "tensor":
            self.changed += enc.changed if delta is None else delta.changed
            self.elements += s.nbytes // itemsize(s.dtype)
        if s is job.file.segments[-1]:
            f = job.file
            self.files.append(FileEntry(f.path, f.kind, f.size, self._hasher.hexdigest(), tuple(self._segs)))
            self._segs, self._hasher = [], xxhash.xxh3_128()

    def finish(self) -> None:
        for chunk in self.packer.finish() + self.delta_packer.finish() + self.reverse_packer.finish():
            self.uploader.submit(chunk)

    def packer_refs(self) -> tuple[ChunkRef, ...]:
        return tuple(self.packer.refs)


def _encode_all(jobs: list[_Job], encoder: _Encoder, out: _Assembler, cfg: PublishConfig, op: Operation) -> None:
    """Encode every job on the pool, keeping at most ``inflight_bytes`` of work in memory."""
    op.phase("encode", sum(j.seg.nbytes for j in jobs))
    weight = lambda j: 3 * j.seg.nbytes  # noqa: E731  new, old and working arrays
    file_read = getattr(encoder, "file_read", None)
    for job, result in ordered_map(encoder.run, jobs, weight, cfg.inflight_bytes, cfg.encode_threads, 3 * TASK_BYTES):
        if file_read is not None and job.seg is job.file.segments[-1]:
            file_read(job.file)  # results come in order: every segment of the file has been read
        out.add(job, *result)
        op.progress(job.seg.nbytes)
    out.finish()


def _base_for(repo: Repo, parent: Manifest, base_dir: Path | None, cache_dir: Path, cfg_pull, lock) -> LocalVersion:
    """A verified-on-read view of the parent version: ``base_dir`` if given, else the cache folder,
    brought to the parent version by a pull when it holds something else. ``repo`` may show only
    some files of each version (a rank's view, :mod:`weightsync.sync.parts`): the cache then holds those."""
    if base_dir is not None:
        return LocalVersion(base_dir, parent)
    state = read_state(cache_dir) if cache_dir.exists() else None
    needed = {f.path for f in repo.manifest(parent.version).files}
    ours = state is not None and same_store(state.store, repo.url)
    if not ours or state.version != parent.version or not needed <= set(state.files):
        with claim(cache_dir, lock, "weightsync publish (its delta-base cache)") as held:
            if state is not None and not ours:
                clear_folder(cache_dir)
            try:
                pull(repo, cache_dir, parent.version, config=cfg_pull, lock=held)
            except OSError as exc:  # one that names no folder (pull names it for a full disk); nothing is stored yet
                raise WeightsyncError(
                    f"could not bring the delta-base cache {cache_dir} to version {parent.version}: "
                    f"{exc.strerror or exc}; fix that folder, or publish with another --cache-dir or --no-cache"
                ) from exc
    return LocalVersion(cache_dir, parent)


@dataclass(frozen=True)
class NewVersion:
    """The version about to be published and what it builds on, decided from the head alone (so
    every rank of a multi-rank publish decides alike): ``etag`` is the head's tag when read.
    ``untrusted_parent``: the parent (the head) is not signed by the publisher's key; the version
    is then a keyframe that names it (lineage) but holds no deltas from it and never reads it."""

    version: int
    parent: Manifest | None
    keyframe: bool
    etag: str | None
    untrusted_parent: bool = False

    @property
    def base(self) -> Manifest | None:
        """The version whose bytes the new one is encoded against (its deltas), if any."""
        return None if self.untrusted_parent else self.parent

    @property
    def chain_length(self) -> int:
        """Deltas since the last keyframe, this version included (0 for a keyframe)."""
        return 0 if self.keyframe else self.parent.chain_length + 1


def next_version(repo: Repo, head: int | None, version: int | None) -> int:
    """The version to publish above ``head``: ``version``, else head + 1 (0 on an empty store).
    Refuses, before anything is written, a number the format does not allow (docs/FORMAT.md:
    0..10^18; readers, gc and the publisher would reject the store for good) or one not above the head."""
    if version is None:
        if head is not None and head >= MAX_VERSION:
            raise VersionError(
                f"the head of {repo.url} is version {head}, the largest the format allows "
                f"({MAX_VERSION}): no version can follow it"
            )
        return 0 if head is None else head + 1
    if not 0 <= version <= MAX_VERSION:
        raise UsageError(f"version must be an integer in 0..{MAX_VERSION} (docs/FORMAT.md), not {version}")
    if head is not None and version <= head:
        exists = version in repo.versions()
        raise VersionError(
            f"version {version} {'already exists' if exists else f'is not after the head version {head}'} in {repo.url}"
        )
    return version


def plan_version(repo: Repo, version: int | None, config: PublishConfig) -> NewVersion:
    """Create the store if it is empty; read the head once; the next version (:func:`next_version`:
    default head + 1, 0 on an empty store) and whether it is a keyframe (the first version, or the
    chain would reach ``keyframe_interval``).

    A signing publisher (``config.signing_key``) builds only on a head its key (or a key ``repo``
    trusts) signed: after an unsigned or foreign head (signing just switched on, a rotated key, a
    version someone else wrote) the new version is a keyframe with no deltas from it
    (``untrusted_parent``), which readers that trust the key can use at once (a delta on that head
    would be refused with it)."""
    if version is not None and not 0 <= version <= MAX_VERSION:
        next_version(repo, None, version)  # refused before the store is created
    if not repo.check():
        repo.init()
    head, etag = repo.head()
    version = next_version(repo, head, version)
    parent, untrusted = None, False
    if head is not None:
        key, also = config.signing_key, () if repo.trusted_keys is None else repo.trusted_keys.keys
        if key is not None and (why := repo.refusal(head, Keyring((key.public(), *also)))) is not None:
            untrusted = True
            log.warning("version %d is published as a keyframe with no deltas from the head: %s", version, why)
        parent = (repo.trusting(None) if untrusted else repo).manifest(head)
    keyframe = untrusted or parent is None or parent.chain_length + 1 >= config.keyframe_interval
    return NewVersion(version, parent, keyframe, etag, untrusted)


def publish(
    checkpoint_dir: str | os.PathLike[str],
    store: StoreLike,
    version: int | None = None,
    *,
    config: PublishConfig | None = None,
    base_dir: str | os.PathLike[str] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    observer: Observer | None = None,
    **legacy: Callable | None,
) -> PublishResult:
    """Publish ``checkpoint_dir`` as ``version`` (default: head + 1; 0 on an empty store) into
    ``store`` (a URL, :class:`Store` or :class:`Repo`).

    A delta needs the parent's bytes: ``base_dir`` (a folder holding exactly the parent version,
    e.g. the previous checkpoint) or else ``cache_dir``, a folder weightsync keeps at the head
    version (pulled from the store when it is behind). Without either, a temporary folder is used.

    ``observer`` (:class:`weightsync.sync.observer.Observer`) sees the ``"encode"`` phase and the
    uploads, and may cancel the publish (before its commit) from its ``check``. The older
    ``progress=`` (``progress(done, total)``, bytes encoded) and ``on_bytes=`` (bytes uploaded)
    callables are still accepted, for one release, in its place.
    """
    repo, config = open_repo(store), config or PublishConfig()
    observer = observer_of(observer, legacy)
    src = Path(checkpoint_dir)
    check_apart(repo, src)
    scan = lambda: scan_checkpoint(src, config.ignore, store_folder(repo))  # noqa: E731
    files = scan()  # validate the input before anything is written
    new = plan_version(repo, version, config)
    with cache_claim(cache_dir, src) as lock:  # one publish at a time on a cache folder
        op = Operation(observer)
        enc = encode_folder(repo, files, scan, new, config, DeltaBase(base_dir, cache_dir, lock=lock), op)
        check_still_as_scanned(enc.sources, scan)  # the version is one state of the folder
        result, manifest = commit_encoded(repo, new, enc, op, config.signing_key)
        if cache_dir is not None and still_as_scanned(files):  # else the cache is brought up by a pull when needed
            cache_version(Path(cache_dir), manifest, src, repo.url, lock)
    op.done(result.seconds)
    return result


def cache_version(
    cache: Path, manifest: Manifest, src: Path, store_url: str, lock: FolderLock | None, done: str = "committed"
) -> None:
    """Bring the delta-base cache to the version just committed (or ``done``) from ``src``. The
    version is stored whatever happens here: a failure is a warning naming the cache. A write that
    failed (a full disk) in a cache this publish holds (``lock``) empties it (its space back), so
    that the next publish pulls its base into it, or says why not; a cache refused (not weightsync's,
    or another process's) is left as it is."""
    try:
        adopt(cache, manifest, src, store_url, lock=lock)
    except WeightsyncError as exc:
        log.warning(
            "version %d is %s, but the delta-base cache %s was left as it is: %s", manifest.version, done, cache, exc
        )
    except OSError as exc:
        emptied = lock is not None
        log.warning(
            "version %d is %s, but the delta-base cache %s could not take it (%s)%s",
            manifest.version,
            done,
            cache,
            exc.strerror or type(exc).__name__,  # (its file name is the source's)
            "; emptied it: the next publish pulls its base there" if emptied else "",
        )
        if emptied:
            with contextlib.suppress(OSError):
                clear_folder(cache)


def store_folder(repo: Repo) -> Path | None:
    """The folder of a ``file://`` store (None for others)."""
    head = repo.store.local_path(HEAD_KEY)
    return None if head is None else head.parent


def check_apart(repo: Repo, src: Path) -> None:
    """Refuse a ``file://`` store inside the checkpoint folder ``src`` (or the folder itself) before
    anything is written: its own chunks would appear in the checkpoint as it is published (every
    try fails, and leaves them there). One reached through a link in the checkpoint is refused by
    the scan (:func:`scan_checkpoint`'s ``outside``)."""
    folder = store_folder(repo)
    if folder is None:
        return
    root, ckpt = Path(os.path.realpath(folder)), Path(os.path.realpath(src))
    if root == ckpt or ckpt in root.parents or holds(src, root):  # (a bind mount of the checkpoint too)
        raise UsageError(f"the store {repo.url} is inside the checkpoint folder {src}; keep the store elsewhere")
    if holder := version_holder(root):
        raise UsageError(
            f"the store {repo.url} is inside {holder}, which holds a weightsync version (its next update removes "
            "the store); keep the store elsewhere"
        )


def cache_claim(cache_dir: str | os.PathLike[str] | None, src: Path) -> FolderLock | contextlib.nullcontext:
    """A lock on the publish cache for one publish (nothing to lock without a cache). A cache that
    overlaps the checkpoint folder ``src``, or lies inside a folder that holds a version (a pull's,
    or another cache), is refused before anything is written: the cache would become part of the
    checkpoint, or an entry that folder's next update refuses."""
    if cache_dir is None:
        return contextlib.nullcontext()
    cache, ckpt = Path(os.path.realpath(cache_dir)), Path(os.path.realpath(src))
    if cache == ckpt or ckpt in cache.parents or cache in ckpt.parents or holds(src, cache) or holds(cache, src):
        raise UsageError(f"the cache folder {cache_dir} and the checkpoint folder {src} overlap; choose another cache")
    if holder := next((d for d in cache.parents if (d / STATE_DIR).is_dir()), None):
        raise UsageError(
            f"the cache folder {cache_dir} is inside {holder}, which holds a weightsync version; choose another cache"
        )
    return FolderLock(Path(cache_dir), "weightsync publish (its delta-base cache)")


@dataclass(frozen=True)
class DeltaBase:
    """Where a publish finds the parent version's bytes: ``base_dir`` (a folder holding exactly the
    parent), else ``cache_dir`` (or a temporary folder) brought to the parent by a pull from
    ``repo`` (default: the store published to; a rank's view pulls its own files only). ``lock``:
    the caller's lock on ``cache_dir``, if it holds one."""

    base_dir: str | os.PathLike[str] | None = None
    cache_dir: str | os.PathLike[str] | None = None
    repo: Repo | None = None
    lock: FolderLock | None = None


def encode_folder(
    repo: Repo,
    files: list[SourceFile],
    rescan: Callable[[], list[SourceFile]],
    new: NewVersion,
    cfg: PublishConfig,
    base: DeltaBase,
    op: Operation,
) -> Encoded:
    """Encode ``files`` (of a checkpoint folder) against ``new.parent`` and upload their chunks;
    commits nothing. The parent's bytes come from ``base`` (:class:`DeltaBase`); a stale cache is
    rebuilt once, from the files ``rescan()`` returns (the clock of ``op`` then starts again)."""
    with contextlib.ExitStack() as stack:
        if base.cache_dir is not None:
            cache = Path(base.cache_dir)
        else:  # no cache: the parent is rebuilt in a scratch folder, removed after (or by the next start)
            scratch = stack.enter_context(ScratchDir("weightsync-base-", "weightsync publish (its scratch base)"))
            cache = scratch / "base"
        explicit = None if base.base_dir is None else Path(base.base_dir)
        try:
            return _encode_folder(repo, files, new, cfg, DeltaBase(explicit, cache, base.repo or repo, base.lock), op)
        except BaseMismatchError:
            if explicit is not None or base.cache_dir is None:
                raise
            with claim(cache, base.lock, "weightsync publish (its delta-base cache)"):
                clear_folder(cache)  # a stale cache: rebuild it from the store once
            op.restart()
            return _encode_folder(repo, rescan(), new, cfg, DeltaBase(None, cache, base.repo or repo, base.lock), op)


def _encode_folder(
    repo: Repo, files: list[SourceFile], new: NewVersion, cfg: PublishConfig, where: DeltaBase, op: Operation
) -> Encoded:
    """:func:`encode_folder` with ``where`` resolved: ``cache_dir`` a folder and ``repo`` set."""
    base = None
    if new.base is not None:  # deltas, and a keyframe's deltas for followers, need the parent's bytes
        cfg_pull = PullConfig(decode_threads=cfg.encode_threads)
        base = _base_for(where.repo, new.base, where.base_dir, where.cache_dir, cfg_pull, where.lock)
    fds: dict[str, int] = {}
    try:
        fds = open_sources(files)  # each opened once, checked to be the file scanned; every read goes through it
        encoder = _Encoder(cfg, base, fds, new.keyframe)
        enc = encode_and_upload(repo, files, new, encoder, cfg, op)
        enc.sources = list(files)
        return enc
    finally:
        for fd in fds.values():
            os.close(fd)
        if base is not None:
            base.close()


@dataclass
class Encoded:
    """Encoded and uploaded files, not yet committed: the body of a manifest (or of a rank's part)."""

    files: tuple[FileEntry, ...]
    chunks: tuple[ChunkRef, ...]
    changed: int
    elements: int
    uploaded_bytes: int
    seconds: dict[str, float]
    codec_config: dict = field(default_factory=dict)
    stored_at: dict[str, float] = field(default_factory=dict)  # chunk id -> monotonic time stored or touched
    refresh_after: float = REFRESH_AFTER

    def refresh(self, repo: Repo) -> set[str]:
        """Touch the chunks stored more than ``refresh_after`` seconds ago, right before they are
        committed (:mod:`weightsync.sync.gc` spares chunks younger than its grace). Raises
        :class:`VersionError`, committing nothing, if gc already took one. Returns their ids."""
        now, old = time.monotonic(), []
        for c in self.chunks:
            at = self.stored_at.get(c.id)
            if at is None or now - at > self.refresh_after:
                old.append(c)
        for c in old:
            try:
                repo.store.touch(chunk_key(c.id))
            except NotFoundError:
                raise VersionError(
                    f"chunk {c.id} of this publish was deleted before its commit (gc ran with a "
                    f"grace shorter than the publish); nothing was committed: publish again"
                ) from None
        return {c.id for c in old}

    def unchecked(self, touched: set[str]) -> list[str]:
        """The ids of the chunks a touch did not just check (the commit checks they are still stored)."""
        return [c.id for c in self.chunks if c.id not in touched]

    @property
    def stats(self) -> dict[str, int]:
        """The manifest's informational ``stats``."""
        return {"changed": self.changed, "elements": self.elements, "uploaded_bytes": self.uploaded_bytes}


def encode_and_upload(
    repo: Repo, files: list[SourceFile], new: NewVersion, encoder, cfg: PublishConfig, op: Operation
) -> Encoded:
    """Encode every segment with ``encoder`` (``run(job) -> (new, digest, encoding, keyframe
    delta)``) against ``new.parent``, pack the payloads into chunks and upload them; commits
    nothing."""
    uploader = Uploader(repo, cfg.upload_concurrency, op)
    out = _Assembler(cfg, uploader)
    try:
        _encode_all(_jobs(files, new.base), encoder, out, cfg, op)
        t_up = time.perf_counter()
        uploader.join()
        seconds = dict(encoder.seconds, upload=time.perf_counter() - t_up)
    finally:
        uploader.close()
    return Encoded(
        tuple(out.files),
        out.packer_refs(),
        out.changed,
        out.elements,
        uploader.uploaded_bytes,
        seconds,
        asdict(cfg.codec),
        dict(uploader.stored_at),
        cfg.refresh_after,
    )


def commit_encoded(
    repo: Repo, new: NewVersion, enc: Encoded, op: Operation, signing_key: SigningKey | None = None
) -> tuple[PublishResult, Manifest]:
    """The manifest of ``enc`` as version ``new.version``, committed (manifest, its signatures with
    ``signing_key``, then the head from ``new.etag``); ``seconds["total"]`` runs from the start of ``op``."""
    manifest = Manifest(
        version=new.version,
        parent=None if new.parent is None else new.parent.version,
        keyframe=new.keyframe,
        chain_length=new.chain_length,
        files=enc.files,
        chunks=enc.chunks,
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        codec_config=enc.codec_config,
        stats=enc.stats,
    )
    seconds = dict(enc.seconds)
    t_c = time.perf_counter()
    touched = enc.refresh(repo)
    repo.commit(manifest, new.etag, signing_key, enc.unchecked(touched))
    seconds["commit"] = time.perf_counter() - t_c
    seconds["total"] = op.elapsed()
    result = PublishResult(
        new.version,
        manifest.parent,
        new.keyframe,
        manifest.raw_bytes,
        manifest.payload_bytes,
        enc.uploaded_bytes,
        len(manifest.chunks),
        enc.changed,
        enc.elements,
        seconds,
    )
    return result, manifest


def encode_and_commit(
    repo: Repo, files: list[SourceFile], new: NewVersion, encoder, cfg: PublishConfig, op: Operation
) -> tuple[PublishResult, Manifest]:
    """Encode every segment with ``encoder``, pack and upload the chunks, then commit the manifest:
    :func:`encode_and_upload` then :func:`commit_encoded`, for publishing from known changes
    (:mod:`weightsync.torch.hostpatch`), which decides its new version itself; signed with
    ``cfg.signing_key``."""
    enc = encode_and_upload(repo, files, new, encoder, cfg, op)
    result = commit_encoded(repo, new, enc, op, cfg.signing_key)
    op.done(result[0].seconds)
    return result
