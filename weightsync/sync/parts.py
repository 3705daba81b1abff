"""One version published by several processes: each rank publishes a part (:func:`publish_part`),
a committer checks and merges them into an ordinary manifest (:func:`commit_parts`). Which files
a rank owns: :func:`assign_files` (docs/FORMAT.md section 6; docs/DESIGN.md)."""

from __future__ import annotations

import json
import logging
import random
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path

import xxhash

from weightsync.errors import (
    AlreadyExistsError,
    CheckpointError,
    FormatError,
    NotFoundError,
    StoreError,
    UsageError,
    VersionError,
    WeightsyncError,
)
from weightsync.format.keys import (
    MAX_VERSION,
    MAX_WORLD,
    check_path,
    parse_part_key,
    part_key,
    parts_prefix,
    refused_key,
)
from weightsync.format.manifest import (
    ChunkRef,
    Delta,
    FileEntry,
    Manifest,
    PartManifest,
    Payload,
    Piece,
    Segment,
    check_paths_disjoint,
    no_gc,
    part_from_json,
    part_to_json,
)
from weightsync.local.checkpoint import SourceFile, check_still_as_scanned, scan_checkpoint, still_as_scanned
from weightsync.store.repo import Repo, check_signable
from weightsync.store.signing import Keyring, SigningKey
from weightsync.sync.observer import Observer, Operation
from weightsync.sync.publish import (
    DeltaBase,
    Encoded,
    NewVersion,
    PublishConfig,
    PublishResult,
    cache_claim,
    cache_version,
    check_apart,
    encode_folder,
    plan_version,
    store_folder,
)

log = logging.getLogger("weightsync.parts")


def check_world(rank: int | None, world: int) -> None:
    """Raise :class:`UsageError` unless ``world`` is a world size and ``rank`` a rank of it."""
    if not 1 <= world <= MAX_WORLD:
        raise UsageError(f"world size must be in 1..{MAX_WORLD}, not {world}")
    if rank is not None and not 0 <= rank < world:
        raise UsageError(f"rank must be in 0..{world - 1} for a world of {world}, not {rank}")


def assign_files(paths: Iterable[str], rank: int, world: int) -> list[str]:
    """The default owner rule (module docstring): safetensors files round-robin by sorted path,
    every other file to rank 0. Pure; every rank computes the same split from the same listing."""
    check_world(rank, world)
    paths = sorted(paths)
    shards = [p for p in paths if p.endswith(".safetensors")]
    mine = {p for i, p in enumerate(shards) if i % world == rank}
    if rank == 0:
        mine.update(p for p in paths if not p.endswith(".safetensors"))
    return sorted(mine)


class RankView(Repo):
    """The store as one rank sees it: every manifest shows only ``paths``, so pulling a version
    through it fetches and rebuilds just those files (a rank's delta base)."""

    def __init__(self, repo: Repo, paths: Iterable[str]):
        super().__init__(repo.store)
        self._inner, self._paths = repo, frozenset(paths)

    def manifest(self, version: int) -> Manifest:
        """The manifest of ``version`` with this rank's files only."""
        m = self._inner.manifest(version)
        return replace(m, files=tuple(f for f in m.files if f.path in self._paths))


# --- the rank side ---------------------------------------------------------------------------------
@dataclass
class PartResult(PublishResult):
    """What a rank published: the :class:`PublishResult` figures of its files, and which part."""

    rank: int = 0
    world: int = 1
    files: list[str] = field(default_factory=list)
    existed: bool = False  # the same part was already stored (a retry, or a rank run again): nothing written


def same_part(a: PartManifest, b: PartManifest) -> bool:
    """Two parts describe the same bytes from the same parent (``created`` and ``stats`` aside:
    a rank run again uploads nothing and finishes later)."""
    key = lambda p: (p.version, p.parent, p.world, p.rank, p.keyframe, p.chain_length, p.files, p.chunks)  # noqa: E731
    return key(a) == key(b)


def _select(files: list[SourceFile], rank: int, world: int, only: list[str] | None, src: Path) -> list[SourceFile]:
    by_path = {f.path: f for f in files}
    if only is None:
        return [by_path[p] for p in assign_files(by_path, rank, world)]
    wanted = []
    for p in only:
        try:
            p = check_path(p[2:] if p.startswith("./") else p)
        except FormatError as exc:
            raise UsageError(f"--files: {exc}") from None
        if p not in by_path:
            raise CheckpointError(f"{src}: no file {p!r} to publish (paths are relative to the checkpoint folder)")
        wanted.append(p)
    if len(set(wanted)) != len(wanted):
        raise UsageError("--files names a file twice")
    return [by_path[p] for p in sorted(wanted)]


def publish_part(
    checkpoint_dir: str | Path,
    repo: Repo,
    rank: int,
    world: int,
    files: list[str] | None = None,
    version: int | None = None,
    config: PublishConfig = PublishConfig(),
    base_dir: str | Path | None = None,
    cache_dir: str | Path | None = None,
    observer: Observer | None = None,
) -> PartResult:
    """Publish rank ``rank`` of ``world``'s files of ``checkpoint_dir`` as its part of ``version``
    (default: head + 1). ``files``: relative paths this rank owns (default :func:`assign_files`).
    The version is not visible until :func:`commit_parts` has merged all ``world`` parts.
    ``observer``: as :func:`weightsync.sync.publish.publish`'s (cancels before the part is written)."""
    check_world(rank, world)
    src = Path(checkpoint_dir)
    check_apart(repo, src)
    scan = lambda: _select(scan_checkpoint(src, config.ignore, store_folder(repo)), rank, world, files, src)  # noqa: E731
    mine = scan()  # validate the input before anything is written
    new = plan_version(repo, version, config)
    parent = None if new.parent is None else new.parent.version
    view = RankView(repo, [f.path for f in mine])
    with cache_claim(cache_dir, src) as lock:  # one publish at a time on a cache folder
        op = Operation(observer)
        enc = encode_folder(repo, mine, scan, new, config, DeltaBase(base_dir, cache_dir, view, lock), op)
        check_still_as_scanned(enc.sources, scan)  # the part is one state of the rank's files
        result, part = store_part(repo, new, enc, rank, world, op)
        if cache_dir is not None and still_as_scanned(mine):  # the rank's next delta base, should it be committed
            as_version = Manifest(part.version, parent, part.keyframe, part.chain_length, part.files, part.chunks)
            cache_version(Path(cache_dir), as_version, src, repo.url, lock, f"stored as rank {rank}'s part")
    op.done(result.seconds)
    return result


def store_part(
    repo: Repo, new: NewVersion, enc: Encoded, rank: int, world: int, op: Operation
) -> tuple[PartResult, PartManifest]:
    """Write rank ``rank`` of ``world``'s part of ``new.version`` from its encoded and uploaded
    files ``enc`` (:func:`weightsync.sync.publish.encode_folder`, or any encoder through
    :func:`weightsync.sync.publish.encode_and_upload`, e.g. from a device diff's changes): re-read
    the head and refuse (:class:`VersionError`, nothing written) if it moved from ``new.parent``,
    touch the chunks stored long ago, then create the part (create-only; an identical stored part
    is success, and so is a head that moved to ``new.version`` merged from that identical part:
    a rank run again after its part, committed meanwhile). ``seconds["total"]`` runs from the
    start of ``op``."""
    check_world(rank, world)
    parent = None if new.parent is None else new.parent.version
    head = repo.head_version()
    part = PartManifest(
        new.version,
        parent,
        world,
        rank,
        new.keyframe,
        new.chain_length,
        enc.files,
        enc.chunks,
        datetime.now(timezone.utc).isoformat(timespec="seconds"),
        enc.codec_config,
        enc.stats,
    )
    t_w = time.perf_counter()
    if head != parent:
        if head != new.version or not _merged_already(repo, part):
            raise VersionError(
                f"the head of {repo.url} moved from {parent} to {head} while rank {rank} encoded version "
                f"{new.version}; its part was not written (publish again on the new head)"
            )
        existed = True
    else:
        enc.refresh(repo)
        existed = _write_part(repo, part)
    seconds = dict(enc.seconds, part=time.perf_counter() - t_w, total=op.elapsed())
    payload = sum(s.payload.size for f in part.files for s in f.segments if s.payload)
    result = PartResult(
        part.version,
        parent,
        part.keyframe,
        sum(f.size for f in part.files),
        payload,
        enc.uploaded_bytes,
        len(part.chunks),
        enc.changed,
        enc.elements,
        seconds,
        rank=rank,
        world=world,
        files=[f.path for f in part.files],
        existed=existed,
    )
    return result, part


def _merged_already(repo: Repo, part: PartManifest) -> bool:
    """``part`` is stored as it is and the committed version holds its files with its checksums."""
    key = part_key(part.version, part.rank, part.world)
    try:
        stored = part_from_json(repo.store.get(key), f"{repo.url}/{key}")
        committed = repo.manifest(part.version)
    except (NotFoundError, FormatError, VersionError):
        return False
    have = {f.path: (f.size, f.xxh3) for f in committed.files}
    return same_part(stored, part) and all(have.get(f.path) == (f.size, f.xxh3) for f in part.files)


def _write_part(repo: Repo, part: PartManifest) -> bool:
    """Create the part's key; True if an identical part was there already."""
    key = part_key(part.version, part.rank, part.world)
    try:
        repo.store.put(key, part_to_json(part), mode="create")
        return False
    except AlreadyExistsError:
        pass
    try:
        stored = part_from_json(repo.store.get(key), f"{repo.url}/{key}")
    except FormatError as exc:
        raise VersionError(f"{repo.url}/{key} already exists and is damaged ({exc})") from None
    if not same_part(stored, part):
        raise VersionError(
            f"{repo.url}/{key} already holds a different part (version {part.version} is not committed "
            "yet, or was abandoned): wait for its commit, publish as another --version, or let gc "
            "remove the abandoned parts"
        )
    return True


# --- merging (pure) --------------------------------------------------------------------------------
def merge_parts(parts: list[PartManifest], parent: Manifest | None, allow_removed: bool = False) -> Manifest:
    """The manifest of the version the ``parts`` make up, on top of ``parent`` (the current head
    manifest, None on an empty store). Raises :class:`VersionError` for a set that does not make
    one version: a rank missing or twice, mixed worlds, versions, parents, keyframe flags or
    chains, a parent that is not the head, a file in two parts, and unless ``allow_removed`` a
    file of the parent that no part has (a rank's file list came up short: committing would
    serve a checkpoint without it)."""
    if not parts:
        raise VersionError("no parts to merge")
    p0 = parts[0]
    version, world = p0.version, p0.world
    what = f"parts of version {version}"
    for name in ("version", "world", "keyframe", "chain_length", "parent"):
        values = sorted({getattr(p, name) for p in parts}, key=repr)
        if len(values) > 1:
            raise VersionError(f"{what} disagree on {name}: {', '.join(map(repr, values))}")
    ranks = sorted(p.rank for p in parts)
    if ranks != list(range(world)):
        dup = sorted({r for r in ranks if ranks.count(r) > 1})
        missing = sorted(set(range(world)) - set(ranks))
        raise VersionError(f"{what}: expected ranks 0..{world - 1} once each (missing {missing}, repeated {dup})")
    head = None if parent is None else parent.version
    if p0.parent != head:
        raise VersionError(
            f"{what} were built on version {p0.parent} but the head is {head}: a stale parent, "
            "refused (publish the parts again on the new head)"
        )
    if parent is not None and version <= parent.version:
        raise VersionError(f"{what}: version {version} is not after the head version {parent.version}")
    chain = 0 if p0.keyframe else None if parent is None else parent.chain_length + 1
    if p0.chain_length != chain:
        raise VersionError(f"{what}: chain length {p0.chain_length} does not follow the head's ({chain} expected)")
    parts = sorted(parts, key=lambda p: p.rank)
    owner: dict[str, int] = {}
    for p in parts:
        for f in p.files:
            if f.path in owner:
                raise VersionError(f"{what}: file {f.path!r} is in the parts of ranks {owner[f.path]} and {p.rank}")
            owner[f.path] = p.rank
    try:
        check_paths_disjoint(list(owner), what)
    except FormatError as exc:
        raise VersionError(str(exc)) from None
    if parent is not None and not allow_removed and (gone := sorted({f.path for f in parent.files} - owner.keys())):
        shown = ", ".join(gone[:5]) + (f" and {len(gone) - 5} more" if len(gone) > 5 else "")
        raise VersionError(
            f"{what}: no rank published {shown} of version {parent.version}; nothing committed. "
            f"Parts are create-only: publish every rank again as version {version + 1} with the "
            "missing files, or commit with --allow-removed-files if the checkpoint dropped them"
        )
    chunks: list[ChunkRef] = []
    index: dict[ChunkRef, int] = {}
    files: list[FileEntry] = []
    with no_gc():  # tens of thousands of segments rebuilt: see format.no_gc
        for p in parts:  # chunk lists concatenated in rank order, a chunk stored by two ranks listed once
            remap = []
            for c in p.chunks:
                if c not in index:
                    index[c] = len(chunks)
                    chunks.append(c)
                remap.append(index[c])
            files.extend(_renumber(f, remap) for f in p.files)
    stats: dict[str, int] = {}
    for p in parts:
        for k, v in p.stats.items():
            if type(v) is int:
                stats[k] = stats.get(k, 0) + v
    return Manifest(
        version,
        p0.parent,
        p0.keyframe,
        p0.chain_length,
        tuple(sorted(files, key=lambda f: f.path)),
        tuple(chunks),
        max(p.created for p in parts),
        dict(p0.codec_config),
        stats,
    )


def _renumber(f: FileEntry, remap: list[int]) -> FileEntry:
    if all(i == j for i, j in enumerate(remap)):
        return f  # rank order puts the first part's chunks first: nothing to renumber

    def pay(p: Payload | None) -> Payload | None:
        return (
            None
            if p is None
            else Payload(
                p.size,
                p.xxh3,
                tuple(Piece(remap[x.chunk], x.offset, x.length) for x in p.parts),
                p.sha256,
                pay(p.reverse),
            )
        )

    def seg(s: Segment) -> Segment:
        delta = None if s.delta is None else Delta(s.delta.codec, s.delta.changed, pay(s.delta.payload))
        return Segment(
            s.role, s.name, s.dtype, s.shape, s.begin, s.end, s.xxh3, s.codec, s.changed, pay(s.payload), delta
        )

    return FileEntry(f.path, f.kind, f.size, f.xxh3, tuple(seg(s) for s in f.segments))


# --- the committer ---------------------------------------------------------------------------------
@dataclass
class CommitResult:
    """What committing a multi-rank version did: the version, parent, keyframe flag, world, the totals
    of its parts (files, bytes, chunks, elements changed), seconds, and whether another committer
    had already committed it from the same parts."""

    version: int
    parent: int | None
    keyframe: bool
    world: int
    files: int
    raw_bytes: int
    payload_bytes: int
    uploaded_bytes: int
    chunks: int
    changed: int
    elements: int
    seconds: float
    already: bool  # another committer had committed the same version from the same parts


def commit_parts(
    repo: Repo,
    version: int,
    world: int,
    timeout: float = 600.0,
    poll: float = 0.25,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    allow_removed: bool = False,
    signing_key: SigningKey | None = None,
) -> CommitResult:
    """Wait (at most ``timeout`` seconds, polling up to every ``poll``) until all ``world`` parts of
    ``version`` are stored, merge them (:func:`merge_parts`) and commit the version (an empty
    location counts as a store whose ranks have not started). Nothing is committed unless every
    part is there and they agree. A part that is damaged, names another world size, or was built
    on a parent that is no longer the head fails at once, and so does a set that leaves out a file
    of the head unless ``allow_removed``. Two committers may race: one commits, the other finds the
    same version committed and succeeds too. ``signing_key`` signs the version committed
    (docs/FORMAT.md section 7; ranks' parts are never signed: readers never read them); a head it
    did not sign does not bind the parts to its files (the ranks made a keyframe, see
    :func:`weightsync.sync.publish.plan_version`). A refusal that concerns the parts themselves (a
    stale parent, a damaged part, parts that do not merge, or parts without the SHA-256 digests
    that ``signing_key`` needs) or a key beside them (of another world) of a version above the head
    is stored for the ranks waiting on the commit (:func:`read_refusal`) before it is raised; a
    timeout, or a store that refuses the commit, is not."""
    check_world(None, world)
    if not 0 <= version <= MAX_VERSION:
        raise UsageError(f"version must be an integer in 0..{MAX_VERSION} (docs/FORMAT.md), not {version}")
    t0, deadline, delay = clock(), clock() + timeout, min(0.05, poll)
    parts: dict[int, PartManifest] = {}
    parent: Manifest | None = None
    exists = False  # the first rank may not have created the store yet
    while True:
        exists = exists or repo.check()
        head, etag = repo.head() if exists else (None, None)
        if head is not None and head >= version:
            return _result(_already(repo, version, world, head), world, clock() - t0, True)
        if exists:  # the head manifest read as the parts arrive: off the critical path
            parent = None if head is None else repo.manifest(head)
        with _refusing(repo, version, world, parts):
            stray = _read_new(repo, version, world, parts) if exists else None
            newer = False  # a part built on a head this committer has not seen yet: look again
            for p in parts.values():
                if p.parent != head:
                    if p.parent is not None and (head is None or p.parent > head):
                        newer = True
                        continue
                    raise VersionError(
                        f"rank {p.rank}'s part of version {version} was built on version {p.parent} but the "
                        f"head is {head}: a stale parent, refused; nothing committed"
                    )
        if stray is not None:  # a key beside the parts, not the parts: a rank it does not name may still come
            with _refusing(repo, version, world, parts, unnamed_ranks=False):
                raise stray
        if len(parts) == world and not newer:
            break
        if clock() >= deadline and newer:
            raise VersionError(
                f"version {version}: its parts were built on a head above {head}, and {repo.url} still "
                f"showed {head} after {timeout:g}s; nothing committed"
            )
        if clock() >= deadline:
            missing = sorted(set(range(world)) - set(parts))
            shown = ", ".join(map(str, missing[:10])) + (", ..." if len(missing) > 10 else "")
            raise VersionError(
                f"version {version}: {len(parts)} of {world} parts stored after {timeout:g}s (missing "
                f"rank{'s' if len(missing) > 1 else ''} {shown}); nothing committed"
            )
        sleep(max(0.0, min(delay, deadline - clock())))
        delay = min(2 * delay, poll)
    if signing_key is not None and parent is not None and not allow_removed:  # whose file list binds the ranks?
        allow_removed = repo.refusal(parent.version, Keyring((signing_key.public(),))) is not None
    with _refusing(repo, version, world, parts):
        manifest = merge_parts(list(parts.values()), parent, allow_removed)
    if signing_key is not None:  # parts made without SHA-256 digests: no use waiting for them either
        with _refusing(repo, version, world, parts, also=(UsageError,)):
            check_signable(manifest)
    fresh = {c.id for c in manifest.chunks} - ({c.id for c in parent.chunks} if parent is not None else set())
    try:
        repo.commit(manifest, etag, signing_key, fresh)  # the ranks' new chunks are checked before the head
    except VersionError as exc:
        if getattr(exc, "committed_broken", False):
            raise
        now = repo.head_version()
        if now is None or now < version:
            raise
        return _result(_already(repo, version, world, now), world, clock() - t0, True)
    return _result(manifest, world, clock() - t0, False)


JOB_READS_PER_SECOND = 1000.0
"""About how many reads a second the waiting ranks of one job make together, at most (:func:`rank_poll`)."""


def rank_poll(poll: float, world: int, rng: random.Random | None = None) -> float:
    """The next wait, in seconds, of a rank polling for its version's commit: ``poll``, stretched to
    ``world / JOB_READS_PER_SECOND`` so that a large job's ranks stay well below what a store serves
    (S3: about 5,500 GETs a second per prefix; 2,048 ranks polling every 0.25 s would ask 8,192), and
    drawn from 0.5-1.5 times that so that ranks whose parts landed together do not poll in step."""
    return max(poll, world / JOB_READS_PER_SECOND) * (rng or random).uniform(0.5, 1.5)


def part_digest(part: PartManifest) -> str:
    """What makes two parts the same part (:func:`same_part`: ``created``, ``stats`` and
    ``codec_config`` aside), as XXH3-128 hex: how a refusal names the parts it refused."""
    return xxhash.xxh3_128_hexdigest(part_to_json(replace(part, created="", stats={}, codec_config={})))


@contextmanager
def _refusing(
    repo: Repo,
    version: int,
    world: int,
    parts: dict[int, PartManifest],
    *,
    unnamed_ranks: bool = True,
    also: tuple[type[Exception], ...] = (),
) -> Iterator[None]:
    """Store a refusal (:class:`VersionError` or :class:`FormatError` raised inside, or one of
    ``also``) of ``version`` with the parts read so far, for the ranks waiting on its commit
    (docs/FORMAT.md section 6); none where no part of this world was read (a committer told the
    wrong world changes nothing) or the head reached ``version`` meanwhile. ``unnamed_ranks``: the
    refusal concerns the parts it names, so it holds for a rank whose part came after them too.
    A refusal whose lowest or highest named part is gone once stored (gc collected the parts
    meanwhile) is deleted again. A store that fails to take it is logged: the refusal is raised all the same."""
    try:
        yield
    except (VersionError, FormatError, *also) as exc:
        if parts and _above_head(repo, version):
            doc = {
                "format": "weightsync.refused",
                "format_version": 1,
                "version": version,
                "world": world,
                "parts": {str(r): part_digest(p) for r, p in sorted(parts.items())},
                "unnamed_ranks": unnamed_ranks,
                "reason": str(exc)[:4000],
                "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            }
            key = refused_key(version, world)
            try:
                repo.store.put(key, json.dumps(doc, sort_keys=True).encode())
                stored = True
            except Exception as err:  # noqa: BLE001 - the refusal itself is what the caller must see
                log.warning("%s: could not store the refusal of version %d: %s", repo.url, version, err)
                stored = False
            try:  # gc deleted the parts after this read them: a refusal left would name parts written again
                if stored and any(
                    repo.store.head(part_key(version, r, world)) is None for r in {min(parts), max(parts)}
                ):
                    repo.store.delete(key)
            except Exception as err:  # noqa: BLE001
                log.warning(
                    "%s: stored the refusal of version %d; could not check whether gc collected its parts: %s",
                    repo.url,
                    version,
                    err,
                )
        raise


def _above_head(repo: Repo, version: int) -> bool:
    """``version`` is still above the head (another committer may have committed it meanwhile)."""
    try:
        head = repo.head_version()
    except (StoreError, FormatError):
        return False
    return head is None or head < version


def read_refusal(repo: Repo, part: PartManifest) -> str | None:
    """Why a committer refused ``part``'s version (stored by :func:`commit_parts`), or None if no
    refusal of its version and world holds for it. The refused parts stay until gc removes them (it
    removes the refusal first), and no other part of that version, rank and world can be created
    meanwhile, so the version cannot be committed from them: a rank whose part was refused may stop
    waiting for its commit (a committer with other options, ``allow_removed`` or no signing key,
    could still commit it). So may a rank whose part the refusal does not name (it came after the
    committer gave up) where the refusal concerns the parts it names (``unnamed_ranks``, not a key
    beside them) and the part of the lowest rank it names is read back as named: the version is
    not committed from these parts either. A refusal that does not parse, or names this rank's part
    by another digest, holds for no part."""
    key = refused_key(part.version, part.world)
    try:
        doc = json.loads(repo.store.get(key))
    except NotFoundError:
        return None
    except ValueError:
        return None
    if not isinstance(doc, dict) or doc.get("version") != part.version or doc.get("world") != part.world:
        return None
    named = doc.get("parts")
    if not isinstance(named, dict) or not named:
        return None
    reason = str(doc.get("reason", "no reason given"))
    mine = named.get(str(part.rank))
    if mine is not None:
        return reason if mine == part_digest(part) else None
    if doc.get("unnamed_ranks") is not True or not _still_named(repo, part, named):
        return None
    return f"{reason} (a refusal of the parts it names, which rank {part.rank}'s cannot be committed without)"


def _still_named(repo: Repo, part: PartManifest, named: dict) -> bool:
    """The store still holds the refused part of the lowest rank ``named`` (rank -> digest) names."""
    ranks = sorted((int(r), r) for r in named if len(r) <= 5 and r.isascii() and r.isdigit() and int(r) < part.world)
    if not ranks:
        return False
    rank, name = ranks[0]
    key = part_key(part.version, rank, part.world)
    try:
        other = part_from_json(repo.store.get(key), f"{repo.url}/{key}")
    except (NotFoundError, FormatError):
        return False
    return named[name] == part_digest(other)


def _read_new(repo: Repo, version: int, world: int, parts: dict[int, PartManifest]) -> WeightsyncError | None:
    """Read and check the parts of ``version`` stored since the last call (into ``parts``); then
    return the refusal of a key of another world or rank, if there is one, once this world's parts
    are read (a refusal names them)."""
    new, bad = [], None
    for key in repo.store.list(parts_prefix(version)):
        parsed = parse_part_key(key)
        if parsed is None:
            continue
        v, rank, w = parsed
        if w != world:
            bad = bad or VersionError(f"{repo.url}/{key}: a part for a world of {w}, not {world}; nothing committed")
        elif rank >= world:
            bad = bad or FormatError(f"{repo.url}/{key}: rank {rank} of a world of {w}")
        elif v == version and rank not in parts:
            new.append((key, rank))

    def read(kr: tuple[str, int]) -> PartManifest:
        key, rank = kr
        p = part_from_json(repo.store.get(key), f"{repo.url}/{key}")
        if (p.version, p.rank, p.world) != (version, rank, world):
            raise FormatError(f"{repo.url}/{key}: holds rank {p.rank} of {p.world}, version {p.version}")
        return p

    if new:
        with ThreadPoolExecutor(min(16, len(new)), thread_name_prefix="ws-parts") as pool:
            for (_, rank), p in zip(new, pool.map(read, new)):
                parts[rank] = p
    return bad


def _already(repo: Repo, version: int, world: int, head: int) -> Manifest:
    """The head reached ``version``: the stored version, if it is the one the parts make up."""
    try:
        stored = repo.manifest(version)
    except VersionError:
        raise VersionError(f"version {version} is not after the head version {head} in {repo.url}") from None
    parts: dict[int, PartManifest] = {}
    try:
        if (stray := _read_new(repo, version, world, parts)) is not None:
            raise stray
    except NotFoundError:
        pass  # collected between the listing and the read
    if len(parts) < world:
        raise VersionError(
            f"version {version} is already committed in {repo.url} and its parts are not all stored "
            "any more (collected by gc?): cannot tell whether it was merged from them"
        )
    parent = None if stored.parent is None else repo.manifest(stored.parent)
    try:
        merged = merge_parts(list(parts.values()), parent, allow_removed=True)  # whoever committed decided that
    except VersionError as exc:
        raise VersionError(
            f"version {version} already exists in {repo.url}, not merged from its parts ({exc})"
        ) from None
    same = lambda m: (m.parent, m.keyframe, m.files, m.chunks)  # noqa: E731
    if same(merged) != same(stored):
        raise VersionError(f"version {version} already exists in {repo.url} and differs from its parts")
    return stored


def _result(m: Manifest, world: int, seconds: float, already: bool) -> CommitResult:
    s = m.stats
    return CommitResult(
        m.version,
        m.parent,
        m.keyframe,
        world,
        len(m.files),
        m.raw_bytes,
        m.payload_bytes,
        s.get("uploaded_bytes", 0),
        len(m.chunks),
        s.get("changed", 0),
        s.get("elements", 0),
        seconds,
        already,
    )


__all__ = [
    "CommitResult",
    "PartResult",
    "RankView",
    "assign_files",
    "commit_parts",
    "merge_parts",
    "publish_part",
    "same_part",
    "store_part",
]
