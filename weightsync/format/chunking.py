"""Packing encoded payloads into bounded, content-addressed chunks (pure, no I/O).

Small payloads share a chunk (few requests per version); a payload larger than the chunk size is
split over several chunks. Packing depends only on the sequence of payloads, so re-publishing the
same version yields the same chunk ids and a resumed upload skips what is already stored.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import xxhash

from weightsync.errors import UsageError
from weightsync.format.manifest import ChunkRef, Piece

DEFAULT_CHUNK_BYTES = 16 << 20


def chunk_id(data: bytes | memoryview) -> str:
    """A chunk's id: the XXH3-128 of its bytes, hex."""
    return xxhash.xxh3_128_hexdigest(data)


@dataclass(frozen=True)
class SealedChunk:
    """A full (or final) chunk ready to upload: its index in the version's chunk list, id and bytes."""

    index: int
    id: str
    data: bytes


class ChunkPacker:
    """Feed payloads with :meth:`add`; collect sealed chunks as they fill; :meth:`finish` at the end.

    Memory: holds at most one open chunk (``chunk_bytes``) plus the payload being added.
    Several packers may share one ``refs`` list (one chunk index space) while keeping their payloads
    in separate chunks, e.g. a keyframe's full payloads apart from its deltas, so that a reader
    needing only one kind fetches only those chunks. A chunk's index is reserved when it is opened.
    """

    def __init__(self, chunk_bytes: int = DEFAULT_CHUNK_BYTES, refs: list[ChunkRef | None] | None = None):
        if chunk_bytes < 1:
            raise UsageError("chunk size must be positive")
        self.chunk_bytes = chunk_bytes
        self.refs: list[ChunkRef | None] = [] if refs is None else refs
        self._open: list[bytes] = []
        self._open_size = 0
        self._index = -1

    def _seal(self) -> SealedChunk | None:
        if not self._open_size:
            return None
        data = b"".join(self._open)
        sealed = SealedChunk(self._index, chunk_id(data), data)
        self.refs[self._index] = ChunkRef(sealed.id, len(data))
        self._open, self._open_size, self._index = [], 0, -1
        return sealed

    def add(
        self, payload: bytes | memoryview, emit: Callable[[SealedChunk], None] | None = None
    ) -> tuple[tuple[Piece, ...], list[SealedChunk]]:
        """Place ``payload``; returns its parts and the chunks that this sealed.

        With ``emit``, each chunk is handed over as soon as it seals (and not returned), so a large
        payload is never held twice; ``emit`` may block to apply back-pressure.
        """
        sealed: list[SealedChunk] = []
        view = memoryview(payload)
        room = self.chunk_bytes - self._open_size
        if len(view) > room and len(view) <= self.chunk_bytes:
            sealed.append(self._seal())  # keep a small payload whole in a fresh chunk
        parts = []
        while len(view):
            if self._index < 0:
                self._index = len(self.refs)
                self.refs.append(None)
            take = min(len(view), self.chunk_bytes - self._open_size)
            parts.append(Piece(self._index, self._open_size, take))
            self._open.append(bytes(view[:take]))
            self._open_size += take
            view = view[take:]
            if self._open_size == self.chunk_bytes:
                sealed.append(self._seal())
            if emit is not None:
                for chunk in sealed:
                    if chunk is not None:
                        emit(chunk)
                sealed.clear()
        return tuple(parts), [s for s in sealed if s is not None]

    def finish(self) -> list[SealedChunk]:
        """Seal the open chunk, if any: the last chunk of this packer."""
        last = self._seal()
        return [last] if last else []
