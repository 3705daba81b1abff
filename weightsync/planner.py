"""Planning a pull (pure): for every segment of the target version, the cheapest way to rebuild it.

A segment is rebuilt from one of:
- ``copy``: the local folder already holds identical bytes (same path and name, same checksum);
- ``local``: the local version's bytes plus the deltas after it, when the local version lies on
  the target's chain;
- ``full``: the last full encoding on the chain plus the deltas after it.
The cheapest in fetched bytes wins; ties go to local bytes. Files whose local copy already equals
the target are kept as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import FormatError
from .format import ChunkRef, FileEntry, Manifest, Payload, Segment


@dataclass(frozen=True)
class ChunkRange:
    chunk: ChunkRef
    offset: int
    length: int


@dataclass(frozen=True)
class Step:
    """One payload to decode: a full encoding, or a delta to apply to the bytes so far."""

    version: int
    codec: str
    size: int
    xxh3: str
    ranges: tuple[ChunkRange, ...]


@dataclass(frozen=True)
class Recipe:
    target: Segment
    base: Segment | None  # a segment of the local version's file at the same path
    steps: tuple[Step, ...]

    @property
    def fetch_bytes(self) -> int:
        return sum(s.size for s in self.steps)


@dataclass(frozen=True)
class FilePlan:
    entry: FileEntry
    keep: bool  # the local file already equals the target: nothing to do
    recipes: tuple[Recipe, ...]


@dataclass(frozen=True)
class Plan:
    target: Manifest
    local_version: int | None
    files: tuple[FilePlan, ...]
    chunks: tuple[ChunkRef, ...]

    @property
    def fetch_bytes(self) -> int:
        return sum(c.size for c in self.chunks)

    @property
    def payload_bytes(self) -> int:
        return sum(r.fetch_bytes for f in self.files for r in f.recipes)


def _step(m: Manifest, seg: Segment) -> Step:
    p: Payload = seg.payload
    ranges = tuple(ChunkRange(m.chunks[part.chunk], part.offset, part.length) for part in p.parts)
    return Step(m.version, seg.codec, p.size, p.xxh3, ranges)


def _find(m: Manifest, path: str, key: tuple[str, str]) -> Segment | None:
    f = m.file(path)
    return None if f is None else next((s for s in f.segments if s.key == key), None)


def plan_segment(chain: list[Manifest], path: str, target: Segment, local: Manifest | None) -> Recipe:
    """The cheapest recipe for ``target`` (a segment of ``chain[-1]``) given the local version."""
    if local is not None:
        same = _find(local, path, target.key)
        if same is not None and same.xxh3 == target.xxh3 and same.nbytes == target.nbytes:
            return Recipe(target, same, ())
    deltas: list[Step] = []
    via_local: Recipe | None = None
    cur = target
    for i in range(len(chain) - 1, -1, -1):
        m = chain[i]
        if local is not None and m.version == local.version:
            via_local = Recipe(target, cur, tuple(reversed(deltas)))  # the folder holds ``cur``
        if cur.codec == "full":
            via_full = Recipe(target, None, (_step(m, cur), *reversed(deltas)))
            if via_local is not None and via_local.fetch_bytes <= via_full.fetch_bytes:
                return via_local
            return via_full
        if cur.codec != "same":
            deltas.append(_step(m, cur))
        if i == 0:
            break
        prev = _find(chain[i - 1], path, cur.key)
        if prev is None or prev.nbytes != cur.nbytes:
            raise FormatError(f"version {m.version}: {path}: {cur.name or cur.role} is a delta without a base")
        cur = prev
    if via_local is not None:
        return via_local
    raise FormatError(f"{path}: {target.name or target.role} has no full encoding on its chain")


def plan_pull(chain: list[Manifest], local: Manifest | None, keep: set[str] = frozenset()) -> Plan:
    """Plan rebuilding ``chain[-1]`` from the keyframe ``chain[0]`` and the local version.

    ``chain`` runs from a keyframe to the target, each manifest the parent of the next. ``local`` is
    the version the folder holds (None for an empty folder); ``keep`` lists paths whose local file
    already equals the target's.
    """
    if not chain or not chain[0].keyframe:
        raise FormatError("a pull chain must start at a keyframe")
    for a, b in zip(chain, chain[1:]):
        if b.parent != a.version:
            raise FormatError(f"version {b.version} does not follow version {a.version}")
    target = chain[-1]
    files, chunks = [], {}
    for entry in target.files:
        if entry.path in keep:
            files.append(FilePlan(entry, True, ()))
            continue
        recipes = tuple(plan_segment(chain, entry.path, s, local) for s in entry.segments)
        for r in recipes:
            for step in r.steps:
                for rng in step.ranges:
                    chunks[rng.chunk.id] = rng.chunk
        files.append(FilePlan(entry, False, recipes))
    return Plan(target, None if local is None else local.version, tuple(files), tuple(chunks.values()))
