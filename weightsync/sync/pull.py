"""Pulling a version into a local folder: plan, fetch verified chunks, rebuild in staging, install.

Every rebuilt segment and every file is checked against the manifest's xxh3 before the install;
the folder switches versions only through :func:`weightsync.local.install`. A folder nothing reads
(a subscriber's standby slot) may instead be refilled in place from another folder's version
(``base_dir``): :func:`weightsync.local.begin_refill` and ``finish_refill``.
Memory: at most ``inflight_bytes`` of segments being rebuilt (at least one: about 3x the largest
tensor, with the small ones handed to the same worker before it), plus ``fetch_concurrency``
chunks while downloading.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import xxhash

from weightsync.codec.streams import SLICE_BYTES
from weightsync.errors import (
    BaseMismatchError,
    ChecksumError,
    NotFoundError,
    SignatureError,
    UsageError,
    VersionError,
    WeightsyncError,
)
from weightsync.format.keys import version_key
from weightsync.format.manifest import Manifest
from weightsync.local.base import LocalVersion
from weightsync.local.install import (
    begin_refill,
    finish_refill,
    install,
    open_in_place,
    prepare_folder,
    spool_dir,
    staging_dir,
)
from weightsync.local.lock import FolderLock, claim
from weightsync.local.state import Times, read_state, unchanged_files
from weightsync.local.verify import verify_folder
from weightsync.store.repo import Repo, StoreLike, open_repo
from weightsync.sync.lazy import LazyReads, Reads, plan_reads
from weightsync.sync.observer import Observer, Operation, observer_of
from weightsync.sync.pipeline import default_threads
from weightsync.sync.plan import FilePlan, Plan, plan_pull
from weightsync.sync.rebuild import Payloads, TensorJob, build_segments
from weightsync.sync.transfer import clear_spool, fetch_chunks


@dataclass(frozen=True)
class PullConfig:
    """The bounds of a pull: chunk fetches in flight, decode threads, bytes in flight; whether the
    installed files are fsynced; how chunks the store has not copied yet are read
    (:class:`~weightsync.sync.lazy.LazyReads`: rebuilt, or from a fallback store); whether a
    rollback may undo the deltas of the versions it leaves (``backward``, where their codecs are
    invertible; False plans only from keyframes and the bytes kept, as benchmarks compare)."""

    fetch_concurrency: int = 32
    decode_threads: int = field(default_factory=default_threads)
    inflight_bytes: int = 256 << 20
    fsync: bool = True
    lazy: LazyReads = field(default_factory=LazyReads)
    backward: bool = True

    def __post_init__(self) -> None:
        if self.fetch_concurrency < 1 or self.decode_threads < 1 or self.inflight_bytes < 1:
            raise UsageError("concurrency and memory limits must be positive")


@dataclass
class PullResult:
    """What a pull did: the version now held, the one the folder held before (None: none), bytes
    fetched (``fallback_bytes`` of them from the fallback store), files written and kept, seconds
    per phase; ``rebuilt_from``: the keyframe a rebuild started at, past keyframes the store does
    not hold whole (None: none)."""

    version: int
    from_version: int | None
    fetched_bytes: int
    written_files: int
    kept_files: int
    seconds: dict[str, float]
    fallback_bytes: int = 0
    rebuilt_from: int | None = None


def resolve_version(repo: Repo, version: int | str | None) -> int:
    """The version ``version`` names in ``repo`` (``latest``/None: the head); :class:`VersionError`
    if there is none, :class:`UsageError` if it is not a version."""
    head = repo.head_version()
    if head is None:
        raise VersionError(f"{repo.url} has no versions yet")
    if version in (None, "latest"):
        return head
    try:
        v = int(version)
    except (TypeError, ValueError):
        raise UsageError(f"version must be an integer or 'latest', not {version!r}") from None
    if v > head:
        raise VersionError(f"version {v} does not exist in {repo.url} (head is {head})")
    repo.manifest(v)  # raises VersionError if missing
    return v


def _write_files(
    plan: Plan,
    payloads: Payloads,
    base: LocalVersion | None,
    root: Path,
    cfg: PullConfig,
    op: Operation,
    in_place: bool = False,
) -> dict[str, Times]:
    """Rebuild every file that changed into ``root`` (the staging area, or the folder itself when
    refilling in place); returns their paths, each with its times as written."""
    todo = [f for f in plan.files if not f.keep]
    jobs = [TensorJob(f.entry.path, r) for f in todo for r in f.recipes]
    op.phase("write", sum(j.recipe.segment.nbytes for j in jobs))
    results = build_segments(jobs, payloads, base, threads=cfg.decode_threads, inflight_bytes=cfg.inflight_bytes, op=op)
    written = {}
    try:
        for fp in todo:
            written[fp.entry.path] = _write_one(fp, results, root, cfg, in_place)
            op.progress(fp.entry.size)
    finally:
        results.close()  # stop the workers now if a file failed
    return written


def _write_one(fp: FilePlan, results, root: Path, cfg: PullConfig, in_place: bool) -> Times:
    dest = root / fp.entry.path
    dest.parent.mkdir(parents=True, exist_ok=True)
    hasher = xxhash.xxh3_128()
    with open_in_place(dest) if in_place else open(dest, "wb") as f:
        for _ in fp.recipes:
            _, data = next(results)
            for a in range(0, len(data), SLICE_BYTES):  # hash each slice, then write it from cache
                piece = data[a : a + SLICE_BYTES]
                hasher.update(piece)
                f.write(piece)
        f.truncate()
        f.flush()
        if cfg.fsync:
            os.fsync(f.fileno())
        size = f.tell()
        st = os.fstat(f.fileno())
    if size != fp.entry.size:
        raise ChecksumError(
            fp.entry.path,
            str(fp.entry.size),
            str(size),
            f"size mismatch for {fp.entry.path}: expected {fp.entry.size} bytes, got {size}",
        )
    if hasher.hexdigest() != fp.entry.xxh3:
        raise ChecksumError(fp.entry.path, fp.entry.xxh3, hasher.hexdigest())
    return st.st_mtime_ns, st.st_ctime_ns


def _local_manifest(repo: Repo, version: int | None) -> Manifest | None:
    if version is None:
        return None
    try:
        return repo.manifest(version)
    except (VersionError, SignatureError):
        return None  # collected by gc, or refused: only whole unchanged files can be reused


def pull(
    store: StoreLike,
    out_dir: str | os.PathLike[str],
    version: int | str | None = "latest",
    *,
    config: PullConfig | None = None,
    observer: Observer | None = None,
    base_dir: str | os.PathLike[str] | None = None,
    lock: FolderLock | None = None,
    **legacy: Callable | None,
) -> PullResult:
    """Make ``out_dir`` hold ``version`` byte for byte, applying only deltas where it can.

    The delta base is the version ``out_dir`` holds, and the update is atomic (built in staging,
    installed through a journal). With ``base_dir``, a folder holding some version (the slot being
    served), the base is read from there instead and ``out_dir`` is *refilled in place*: its files
    are overwritten where they are, which costs the page cache far less than new files, but
    ``out_dir`` claims no version until the refill ends (a kill leaves it to be refilled again).
    Only for a folder weightsync owns whole and nothing reads, like a subscriber's standby slot.

    One writer per folder: the pull holds ``out_dir``'s lock (:class:`weightsync.local.lock.FolderLock`)
    throughout, or runs under ``lock``, a lock on it that the caller holds.

    ``observer`` (:class:`weightsync.sync.observer.Observer`) sees the ``"write"`` phase and the
    downloads, and may cancel the pull (before the install) from its ``check``. The older
    ``progress=`` (``progress(done, total)``, bytes written) and ``on_bytes=`` (bytes downloaded)
    callables are still accepted, for one release, in its place.
    """
    repo, config = open_repo(store), config or PullConfig()
    observer = observer_of(observer, legacy)
    with claim(Path(out_dir), lock, "weightsync pull"):
        try:
            return _pull(repo, Path(out_dir), version, config, observer, base_dir)
        except OSError as exc:
            if exc.filename is not None or exc.errno not in _FULL:
                raise
            raise WeightsyncError(  # a write's error names no file: name the folder it fills
                f"{out_dir}: {exc.strerror} while writing a version into it"
            ) from exc


_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # write errors that name no file


def _pull(repo: Repo, out: Path, version, config: PullConfig, observer: Observer | None, base_dir) -> PullResult:
    base = out if base_dir is None else Path(base_dir)
    if base_dir is not None:
        b, o = os.path.realpath(base), os.path.realpath(out)
        if b == o or b.startswith(o + os.sep) or o.startswith(b + os.sep):
            raise UsageError(f"cannot refill {out} in place from {base}: the folders overlap")
        if read_state(base) is None:
            raise UsageError(f"{base} holds no weightsync version to refill {out} from")
    repo.require()
    target_version = resolve_version(repo, version)
    state = prepare_folder(out, owned=base_dir is not None)
    base_state = state if base_dir is None else read_state(base)
    op = Operation(observer)
    target = repo.manifest(target_version)
    keep = unchanged_files(out, state, target)
    if state is not None and state.version == target_version and len(keep) == len(target.files):
        result = PullResult(target_version, state.version, 0, 0, len(keep), {"total": op.elapsed()})
        op.done(result.seconds)
        return result
    local = _local_manifest(repo, None if base_state is None else base_state.version)
    read: set[int] = set()  # versions whose payloads the plans read

    def run(
        back_to: int | None, local: Manifest | None, keep: Mapping[str, Times], backward: bool = True
    ) -> PullResult:
        # a rollback: the versions from the target to the local one, whose deltas may be undone
        ahead = []
        if backward and config.backward and local is not None and local.version > target_version:
            ahead = repo.descent(target_version, local.version)

        def make(chain: list[Manifest], avoid: frozenset[str], use_avoided: bool):
            plan = plan_pull(chain, local, keep, avoid, use_avoided, ahead)
            return plan, [r for f in plan.files for r in f.recipes]

        plan, reads = plan_reads(repo, target_version, make, back_to=back_to, lazy=config.lazy)
        read.update(s.version for f in plan.files for r in f.recipes for s in r.steps)
        return _pull_plan(repo, out, base, plan, reads, base_state, config, op, keep)

    back_to = None if base_state is None else base_state.version
    try:
        try:
            return run(back_to, local, keep)
        except ChecksumError:
            if not _spool_used(out):
                raise
            # a spooled chunk went bad after it was checked (the disk, or a hand in .weightsync):
            # drop every spooled copy and fetch again, once; a second failure is the store's
            clear_spool(spool_dir(out))
            return run(back_to, local, keep)
    except BaseMismatchError:
        # the base folder was modified behind our back: rebuild from the keyframe without local bytes
        return run(None, None, {})
    except NotFoundError:
        if all(repo.store.head(version_key(v)) is not None for v in read):
            raise  # the store lost an object of a live version: report it, do not route around it
        # versions between the local one and the target's keyframe (or the target and a newer
        # local one) were collected while we planned: the target's own chain (which gc keeps) serves
        return run(None, local, keep, backward=False)


def _pull_plan(
    repo,
    out: Path,
    base: Path,
    plan: Plan,
    reads: Reads,
    base_state,
    cfg: PullConfig,
    op: Operation,
    kept: Mapping[str, Times],
) -> PullResult:
    seconds = {}
    in_place = base != out
    chunks = fetch_chunks(repo, plan.chunks, spool_dir(out), cfg.fetch_concurrency, op, reads)
    payloads = Payloads(repo.url, chunks, reads)
    seconds["fetch"] = op.elapsed()
    local = None if plan.local_version is None else LocalVersion(base, repo.manifest(plan.local_version))
    if in_place:
        begin_refill(out, plan.manifest, repo.url, cfg.fsync)
    try:
        written = _write_files(plan, payloads, local, out if in_place else staging_dir(out), cfg, op, in_place)
    finally:
        payloads.close()
        if local:
            local.close()
    seconds["build"] = op.elapsed() - seconds["fetch"]
    if in_place:
        finish_refill(out, plan.manifest, repo.url, {**kept, **written}, cfg.fsync)
    else:
        install(out, plan.manifest, repo.url, written, cfg.fsync, kept)
    clear_spool(spool_dir(out))
    seconds["total"] = op.elapsed()
    kept = sum(f.keep for f in plan.files)
    result = PullResult(
        plan.manifest.version,
        None if base_state is None else base_state.version,
        plan.fetch_bytes,
        len(written),
        kept,
        seconds,
        sum(c.fetch_bytes for c in plan.chunks if c.chunk.id in reads.from_fallback),
        reads.rebuilt_from,
    )
    op.done(seconds)
    return result


def _spool_used(out: Path) -> bool:
    spool = spool_dir(out)
    return any(p.name != ".tmp" and not p.name.startswith(".tmp-") for p in spool.iterdir())


def verify(store: StoreLike, directory: str | os.PathLike, version: int | str | None = "latest") -> int:
    """Raise unless ``directory`` holds ``version`` byte for byte; returns the version checked.
    Strictly read-only: a folder whose install was interrupted is reported, not finished.
    :class:`ChecksumError`: the folder does not hold the version (``weightsync verify`` exits 1);
    any other error: it could not be checked (exit 3)."""
    repo = open_repo(store)
    repo.require()
    v = resolve_version(repo, version)
    verify_folder(Path(directory), repo.manifest(v))
    return v
