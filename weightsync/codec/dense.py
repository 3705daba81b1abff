"""Codec ``dense`` (id 3): every element's change, ``zstd(planes(zigzag(u_new - u_old)))``;
decoded as ``u_new = u_old + unzigzag(...)``. Chosen when most elements change and it is smaller."""

from __future__ import annotations

import numpy as np

from weightsync.codec.abc import Codec
from weightsync.codec.registry import register
from weightsync.codec.streams import compressor, decompress, from_planes, to_planes, unzigzag, zigzag


@register
class Dense(Codec):
    """``dense``: every element's wrapping difference, zigzagged, as byte planes, zstd-compressed (for
    blocks where most elements changed)."""

    id = 3
    name = "dense"
    invertible = True

    def encode(self, dtype, old, new, config):
        diff = new - old
        return compressor(config.level).compress(to_planes(zigzag(diff))), int(np.count_nonzero(diff))

    def decode(self, dtype, block, old, out, what, hasher=None):
        width = out.dtype.itemsize
        raw = decompress(block, out.size * width, what)
        np.add(old, unzigzag(from_planes(raw, width, out.size)), out=out)
        if hasher is not None:
            hasher.update(out)

    def decode_backward(self, dtype, block, new, out, what, hasher=None):
        """``u_old = u_new - unzigzag(...)``: every element's difference is stored."""
        width = out.dtype.itemsize
        raw = decompress(block, out.size * width, what)
        np.subtract(new, unzigzag(from_planes(raw, width, out.size)), out=out)
        if hasher is not None:
            hasher.update(out)
