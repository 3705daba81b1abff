"""Codec ``ans`` decoded by torch operations on the tensor's own device (docs/SCALE.md P7): a GPU
receives a block's few bytes instead of the changed elements, and the pass over every element runs
there as prefix sums and gathers (:func:`weightsync.codec.ans.decode_reference` is the same in
numpy, and what this is tested against on the CPU; benchmarks/gpu.sh runs the tests on CUDA).

A block's streams (its Rice and rANS sections, a few nanoseconds per change) are decoded on the
host by :class:`~weightsync.codec.ans.Parsed`; the device then, per element:

1. takes the old value's exponent field and, by the block's thresholds, its bucket and value group;
2. numbers the members of each bucket in order (a prefix sum), which indexes the bucket's bitmap:
   the element changed if its bit is set;
3. numbers the changes of each value group in order (a prefix sum), which indexes the group's
   differences, added with wraparound in the element's width.

Not yet wired into a sink: :class:`~weightsync.torch.sink.TorchSink` patches device tensors from
changes decoded on the host.
"""

from __future__ import annotations

import numpy as np
import torch

from weightsync.codec.ans import Parsed
from weightsync.errors import FormatError, UsageError
from weightsync.format.dtypes import ITEMSIZE, UINT_VIEW
from weightsync.torch.dtypes import TORCH_INT

_WIDE = {1: torch.int32, 2: torch.int32, 4: torch.int64}  # room for a sum of two unsigned elements


def decode_block(dtype: str, block: bytes | memoryview, old: torch.Tensor, what: str = "block") -> torch.Tensor:
    """``old`` with ``block`` applied, as a new tensor on ``old``'s device. ``old``: the block's
    elements, 1-D, viewed as :data:`~weightsync.torch.dtypes.TORCH_INT` of ``dtype``'s width (e.g.
    ``weight.view(torch.int16).flatten()`` for BF16). Raises :class:`FormatError` where the CPU
    decoders do: a block that does not parse, or whose bucket or group sizes are not ``old``'s."""
    width = ITEMSIZE.get(dtype)
    if width not in _WIDE or old.dtype != TORCH_INT[width] or old.dim() != 1:
        raise UsageError(
            f"{what}: ans decodes a 1-D {TORCH_INT.get(width)} view of {dtype}, not {old.dtype} {tuple(old.shape)}"
        )
    if len(block) == 0:
        return old.clone()
    n = old.numel()
    p = Parsed(dtype, memoryview(block), n, np.dtype(UINT_VIEW[width]), what)
    dev = old.device
    wide = _WIDE[width]
    span = 1 << (8 * width)
    value = old.to(wide) & (span - 1)  # the unsigned bits
    exponent = (value >> p.shift) & p.fmask
    bucket = _context(exponent, p.thr, dev)
    group = _context(exponent, p.vthr, dev)
    words = torch.from_numpy(p.words.view(np.int64)).to(dev)
    changed = torch.zeros(n, dtype=torch.bool, device=dev)
    for b in range(p.K):
        members = torch.nonzero(bucket == b).squeeze(1)  # ascending: their ranks are 0, 1, ...
        if members.numel() != p.nb[b]:
            raise FormatError(f"{what}: ans block's bucket sizes do not match its base")
        bit = int(p.wbase[b]) * 64 + torch.arange(members.numel(), device=dev)
        hit = ((words[bit >> 6] >> (bit & 63)) & 1).bool()  # an arithmetic shift keeps bit 0 right
        changed[members[hit]] = True
    idx = torch.nonzero(changed).squeeze(1)
    gi = group[idx]
    didx = torch.empty_like(idx)
    for g in range(p.G):
        sel = torch.nonzero(gi == g).squeeze(1)
        if sel.numel() != p.dstart[g + 1] - p.dstart[g]:
            raise FormatError(f"{what}: ans block's value groups do not match its base")
        didx[sel] = int(p.dstart[g]) + torch.arange(sel.numel(), device=dev)
    diffs = torch.from_numpy(p.diffs.astype(np.int64)).to(dev)
    moved = (value[idx] + diffs[didx].to(wide)) & (span - 1)
    out = old.clone()
    if width > 1:  # back to the signed view's range
        moved = moved - (moved >= span // 2).to(wide) * span
    out[idx] = moved.to(old.dtype)
    return out


def _context(exponent: torch.Tensor, thresholds: np.ndarray, dev: torch.device) -> torch.Tensor:
    """The number of ``thresholds`` (ascending) at or below each exponent: its bucket or group."""
    if thresholds.size == 0:
        return torch.zeros_like(exponent)
    return torch.bucketize(exponent, torch.as_tensor(thresholds, dtype=exponent.dtype, device=dev), right=True)
