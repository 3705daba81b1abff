"""Planning a pull (pure): for every segment of the target version, the cheapest way to rebuild it.

A segment is rebuilt from one of:
- ``copy``: the local folder already holds identical bytes (same path and name, same checksum);
- ``local``: the local version's bytes plus the deltas after it, when the local version lies on
  the target's chain;
- ``full``: the last full encoding on the chain plus the deltas after it;
- ``back``: the local version's bytes with the deltas between the target and it undone, newest
  first, when the local version descends from the target (a rollback) and every one of those
  deltas is of an invertible codec (``ans``, ``sparse``, ``dense``; not ``ac``).
The cheapest in fetched bytes wins; ties go to local bytes. Files whose local copy already equals
the target are kept as they are.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from weightsync.codec import registry
from weightsync.errors import FormatError, LazyChunksError
from weightsync.format.manifest import ChunkRef, FileEntry, Manifest, Payload, Segment


@dataclass(frozen=True)
class ChunkRange:
    """Bytes [offset, offset + length) of a chunk: where (part of) a payload lies."""

    chunk: ChunkRef
    offset: int
    length: int


@dataclass(frozen=True)
class Step:
    """One payload to decode: a full encoding, or a delta to apply to the bytes so far; ``backward``:
    a delta of ``version`` to undo (the bytes so far are ``version``'s, the result its parent's)."""

    version: int
    codec: str
    size: int
    xxh3: str
    ranges: tuple[ChunkRange, ...]
    sha256: str = ""  # signed versions: checked too (XXH3 is no cryptographic digest)
    backward: bool = False
    reverse: Step | None = None  # backward: the payload's reverse payload, where it has one (a step of its own)

    @property
    def all_ranges(self) -> tuple[ChunkRange, ...]:
        """The chunk ranges the step reads: its payload's, then its reverse payload's."""
        return self.ranges if self.reverse is None else self.ranges + self.reverse.ranges

    @property
    def fetch_bytes(self) -> int:
        """Payload bytes the step reads (its reverse payload's too)."""
        return self.size + (0 if self.reverse is None else self.reverse.size)


@dataclass(frozen=True)
class Recipe:
    """How to rebuild one segment of the version pulled: from ``base`` (the local version's segment
    at the same path, or None), apply ``steps`` in order (a full encoding first when there is no
    usable base; deltas of newer versions undone, newest first, when the local version is newer).
    No steps: the base already holds the segment's bytes."""

    segment: Segment
    base: Segment | None  # a segment of the local version's file at the same path
    steps: tuple[Step, ...]

    @property
    def fetch_bytes(self) -> int:
        """Payload bytes the steps read."""
        return sum(s.fetch_bytes for s in self.steps)


@dataclass(frozen=True)
class FilePlan:
    """One file of the version pulled: kept as it is, or rebuilt segment by segment from ``recipes``."""

    entry: FileEntry
    keep: bool  # the local file already equals the target: nothing to do
    recipes: tuple[Recipe, ...]


@dataclass(frozen=True)
class ChunkNeed:
    """The byte ranges of one chunk that a plan reads, merged and sorted."""

    chunk: ChunkRef
    ranges: tuple[tuple[int, int], ...]  # (offset, length)

    @property
    def needed_bytes(self) -> int:
        """Bytes of the chunk the plan reads."""
        return sum(n for _, n in self.ranges)

    def whole(self, threshold: float = 0.75) -> bool:
        """Fetch the whole chunk (and verify its id) rather than ranges of it."""
        return self.needed_bytes >= threshold * self.chunk.size

    @property
    def fetch_bytes(self) -> int:
        """Bytes fetched for the chunk: all of it when :meth:`whole`, else the ranges."""
        return self.chunk.size if self.whole() else self.needed_bytes


def merge_ranges(ranges: list[tuple[int, int]], gap: int = 0) -> tuple[tuple[int, int], ...]:
    """Sort (offset, length) ranges and merge those that overlap or lie within ``gap`` bytes."""
    out: list[list[int]] = []
    for off, n in sorted(ranges):
        if out and off <= out[-1][0] + out[-1][1] + gap:
            out[-1][1] = max(out[-1][1], off + n - out[-1][0])
        else:
            out.append([off, n])
    return tuple((o, n) for o, n in out)


RANGE_GAP = 64 << 10  # ranges of a chunk closer than this are fetched as one


def chunk_needs(recipes: Iterable[Recipe], gap: int = RANGE_GAP) -> tuple[ChunkNeed, ...]:
    """The byte ranges of each chunk that ``recipes`` read payloads from, merged (:func:`merge_ranges`),
    in the order the chunks are first met: what a pull, a partial pull or a sink fetches."""
    chunks: dict[str, ChunkRef] = {}
    ranges: dict[str, list[tuple[int, int]]] = {}
    for r in recipes:
        for step in r.steps:
            for rng in step.all_ranges:
                chunks[rng.chunk.id] = rng.chunk
                ranges.setdefault(rng.chunk.id, []).append((rng.offset, rng.length))
    return tuple(ChunkNeed(c, merge_ranges(ranges[cid], gap)) for cid, c in chunks.items())


@dataclass(frozen=True)
class Plan:
    """A pull, planned: the manifest pulled, the version the folder held (None: nothing usable), what
    to do per file, and which chunk ranges to fetch."""

    manifest: Manifest
    local_version: int | None
    files: tuple[FilePlan, ...]
    chunks: tuple[ChunkNeed, ...]

    @property
    def fetch_bytes(self) -> int:
        """Bytes the pull fetches from the store."""
        return sum(c.fetch_bytes for c in self.chunks)

    @property
    def payload_bytes(self) -> int:
        """Payload bytes the recipes read (without the merged ranges' gaps or whole chunks)."""
        return sum(r.fetch_bytes for f in self.files for r in f.recipes)


def _step(m: Manifest, codec: str, p: Payload, backward: bool = False) -> Step:
    """The step reading ``p``; run ``backward``, its reverse payload too (a forward one never reads it)."""
    ranges = tuple(ChunkRange(m.chunks[part.chunk], part.offset, part.length) for part in p.parts)
    reverse = _step(m, codec, p.reverse) if backward and p.reverse is not None else None
    return Step(m.version, codec, p.size, p.xxh3, ranges, p.sha256, backward, reverse)


def _find(m: Manifest, path: str, key: tuple[str, str]) -> Segment | None:
    f = m.file(path)
    return None if f is None else f.segment(key)


def _avoids(r: Recipe, avoid: frozenset[str]) -> bool:
    """Whether ``r`` reads none of the chunks in ``avoid``."""
    return not avoid or all(rng.chunk.id not in avoid for s in r.steps for rng in s.all_ranges)


def _invertible(codec: str) -> bool:
    """Whether deltas of ``codec`` can be undone (:attr:`weightsync.codec.abc.Codec.invertible`)."""
    try:
        impl = registry.get(codec)
    except KeyError:
        return False
    return impl.invertible and impl.needs_base


def check_ahead(target: Manifest, ahead: Sequence[Manifest], local: Manifest | None) -> None:
    """Raise :class:`FormatError` unless ``ahead`` runs from a child of ``target`` to ``local``, each
    manifest the parent of the next (or is empty)."""
    if not ahead:
        return
    if local is None or ahead[-1].version != local.version:
        raise FormatError("the versions after the target must end at the local version")
    for a, b in zip((target, *ahead), ahead):
        if b.parent != a.version:
            raise FormatError(f"version {b.version} does not follow version {a.version}")


def _undo(target_m: Manifest, ahead: Sequence[Manifest], path: str, target: Segment) -> Recipe | None:
    """The ``back`` candidate: ``ahead[-1]``'s segment (the local version's) with the delta that
    each version of ``ahead`` carries against its parent undone, newest first (a keyframe's own
    ``delta``; ``same`` costs nothing). None unless every version holds the segment at one size and
    dtype and every such delta is of an invertible codec."""
    steps: list[Step] = []
    for i in range(len(ahead) - 1, -1, -1):
        m = ahead[i]
        seg = _find(m, path, target.key)
        prev = _find(ahead[i - 1], path, target.key) if i else target
        if seg is None or prev is None or (seg.nbytes, seg.dtype) != (prev.nbytes, prev.dtype):
            return None
        enc = seg.delta if seg.codec == "full" else seg
        if enc is None:
            return None  # re-encoded in full without a delta: no way back
        if enc.codec != "same":
            if enc.payload is None or not _invertible(enc.codec):
                return None
            steps.append(_step(m, enc.codec, enc.payload, backward=True))
    if not steps:
        return None  # nothing to undo yet the bytes differ: the manifests disagree, plan from the chain
    return Recipe(target, _find(ahead[-1], path, target.key), tuple(steps))


def plan_segment(
    chain: list[Manifest],
    path: str,
    target: Segment,
    local: Manifest | None,
    avoid: frozenset[str] = frozenset(),
    use_avoided: bool = False,
    ahead: Sequence[Manifest] = (),
) -> Recipe:
    """The cheapest recipe for ``target`` (a segment of ``chain[-1]``) given the local version.

    Walks the chain backwards collecting deltas. The first full encoding met gives the ``full``
    candidate; a keyframe's segment may also carry a delta from its parent, which lets the walk go
    on to an older local version.

    ``ahead``: when the local version descends from the target (a rollback), the manifests from
    the target's child to the local version, each the parent of the next (:func:`check_ahead`);
    they give the ``back`` candidate (:func:`_undo`) where every delta on the way is invertible.

    ``avoid``: chunks this store notes as not copied yet (docs/FORMAT.md section 1, lazy chunks).
    A recipe reading none of them wins over any that reads one; a full encoding that reads one is
    walked past through the keyframe's delta, to an older full encoding of the chain (a rebuild) or
    to the local version. When every recipe reads one: the cheapest of them with ``use_avoided``
    (its avoided chunks read elsewhere), else :class:`LazyChunksError`.
    """
    if local is not None:
        same = _find(local, path, target.key)
        if same is not None and same.xxh3 == target.xxh3 and same.nbytes == target.nbytes:
            return Recipe(target, same, ())
    deltas: list[Step] = []
    candidates: list[Recipe] = []
    full_found = False  # a full encoding that avoids ``avoid``
    cur = target
    for i in range(len(chain) - 1, -1, -1):
        m = chain[i]
        if local is not None and m.version == local.version:
            candidates.append(Recipe(target, cur, tuple(reversed(deltas))))  # the folder holds ``cur``
            break
        if cur.codec == "full":
            if not full_found:
                full = Recipe(target, None, (_step(m, "full", cur.payload), *reversed(deltas)))
                candidates.append(full)
                full_found = _avoids(full, avoid)
            if cur.delta is None or (local is None and full_found):
                break
            if cur.delta.codec != "same":
                deltas.append(_step(m, cur.delta.codec, cur.delta.payload))
        elif cur.codec != "same":
            deltas.append(_step(m, cur.codec, cur.payload))
        prev = _find(chain[i - 1], path, cur.key) if i else None
        if prev is None or prev.nbytes != cur.nbytes:
            if i and not candidates:
                raise FormatError(f"version {m.version}: {path}: {cur.name or cur.role} is a delta without a base")
            break
        cur = prev
    if not candidates:
        raise FormatError(f"{path}: {target.name or target.role} has no full encoding on its chain")
    if ahead and local is not None:
        check_ahead(chain[-1], ahead, local)
        back = _undo(chain[-1], ahead, path, target)
        if back is not None:
            candidates.append(back)
    usable = [r for r in candidates if _avoids(r, avoid)] or (candidates if use_avoided else [])
    if not usable:
        best = min(candidates, key=lambda r: r.fetch_bytes)
        noted = frozenset(rng.chunk.id for s in best.steps for rng in s.all_ranges) & avoid
        raise LazyChunksError(
            f"{path}: {target.name or target.role}: every recipe reads chunks noted as not copied yet",
            chain[-1].version,
            noted,
        )
    return min(usable, key=lambda r: (r.fetch_bytes, r.base is None))  # ties: local bytes first


def plan_pull(
    chain: list[Manifest],
    local: Manifest | None,
    keep: set[str] = frozenset(),
    avoid: frozenset[str] = frozenset(),
    use_avoided: bool = False,
    ahead: Sequence[Manifest] = (),
) -> Plan:
    """Plan rebuilding ``chain[-1]`` from the keyframe ``chain[0]`` and the local version.

    ``chain`` runs from a keyframe (or from the local version, when that is an ancestor of the
    target) to the target, each manifest the parent of the next. ``local`` is
    the version the folder holds (None for an empty folder); ``keep`` lists paths whose local file
    already equals the target's. ``avoid``, ``use_avoided`` and ``ahead`` (the versions from the
    target to a newer local version, for a rollback by undoing deltas): as :func:`plan_segment`'s.
    """
    if not chain or not (chain[0].keyframe or (local is not None and chain[0].version == local.version)):
        raise FormatError("a pull chain must start at a keyframe or at the local version")
    for a, b in zip(chain, chain[1:]):
        if b.parent != a.version:
            raise FormatError(f"version {b.version} does not follow version {a.version}")
    check_ahead(chain[-1], ahead, local)
    target = chain[-1]
    files: list[FilePlan] = []
    for entry in target.files:
        if entry.path in keep:
            files.append(FilePlan(entry, True, ()))
            continue
        files.append(
            FilePlan(
                entry,
                False,
                tuple(plan_segment(chain, entry.path, s, local, avoid, use_avoided, ahead) for s in entry.segments),
            )
        )
    needs = chunk_needs(r for f in files for r in f.recipes)
    return Plan(target, None if local is None else local.version, tuple(files), needs)
