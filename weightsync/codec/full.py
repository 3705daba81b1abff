"""Codec ``full`` (id 1): a block in full, without a base: ``zstd(planes(u_new))``, at
``full_level``. Keyframes, and segments whose parent is missing or differs in dtype or shape."""

from __future__ import annotations

from weightsync.codec.abc import Codec
from weightsync.codec.registry import register
from weightsync.codec.streams import compressor, decompress, from_planes, to_planes


@register
class Full(Codec):
    """``full``: the new bytes themselves as byte planes, zstd-compressed (keyframes; needs no base)."""

    id = 1
    name = "full"
    needs_base = False

    def encode(self, dtype, old, new, config):
        return compressor(config.full_level).compress(to_planes(new)), new.size

    def decode(self, dtype, block, old, out, what, hasher=None):
        width = out.dtype.itemsize
        from_planes(decompress(block, out.size * width, what), width, out.size, out=out)
        if hasher is not None:
            hasher.update(out)
