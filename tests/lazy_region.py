"""A regional store as a lazy mirror leaves it (docs/FORMAT.md section 1, lazy chunks), built
directly on a copy of the source: for each keyframe named, the chunks only its full payloads use
are noted in ``lazy/<N>.json`` and removed. Works on any store (file, S3)."""

from __future__ import annotations

from weightsync.errors import NotFoundError
from weightsync.format.keys import chunk_key, version_key
from weightsync.store.repo import Repo


def full_only_chunks(repo: Repo, version: int) -> frozenset[str]:
    """The chunks of ``version`` that only its full payloads use: none of its deltas, no other version."""
    m = repo.manifest(version)
    full: set[str] = set()
    other: set[str] = set()
    for f in m.files:
        for s in f.segments:
            if s.codec == "full" and s.payload is not None:
                full |= {m.chunks[p.chunk].id for p in s.payload.parts}
            elif s.payload is not None:
                other |= {m.chunks[p.chunk].id for p in s.payload.parts}
            if s.delta is not None and s.delta.payload is not None:
                other |= {m.chunks[p.chunk].id for p in s.delta.payload.parts}
    for v in repo.versions():
        if v != version:
            other |= {c.id for c in repo.manifest(v).chunks}
    return frozenset(full - other)


def copy_version(src: Repo, dst: Repo, version: int, lazy: bool) -> frozenset[str]:
    """Copy ``version`` from ``src`` into ``dst`` as a lazy mirror does: with ``lazy``, note the
    chunks only its full payloads use and leave them out; then the other chunks, the manifest and
    the head. Returns the chunks left out."""
    dst.init()
    left = full_only_chunks(src, version) if lazy else frozenset()
    if left:
        dst.note_lazy_chunks(version, left)
    for ref in src.manifest(version).chunks:
        if ref.id not in left:
            dst.store_chunk(ref.id, ref.size, lambda ref=ref: src.get_chunk(ref.id, ref.size))
    data, _ = src.read_version(version, signatures=False)
    dst.store.put(version_key(version), data, mode="create")
    dst.set_head(version)
    return left


def make_lazy(repo: Repo, versions) -> dict[int, frozenset[str]]:
    """Note and remove the full-payload-only chunks of each of ``versions`` (keyframes); returns them."""
    out = {v: full_only_chunks(repo, v) for v in versions}
    for v, ids in out.items():
        assert ids, f"version {v} has no chunk of its own full payloads"
        repo.note_lazy_chunks(v, ids)
        for c in ids:
            try:
                repo.store.delete(chunk_key(c))
            except NotFoundError:
                pass
    return out


def stored_bytes(repo: Repo, prefix: str = "chunks/") -> int:
    """Bytes of the chunks ``repo`` holds."""
    return sum(o.size for o in repo.store.list_meta(prefix))
