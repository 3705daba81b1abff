"""lr 1e-5: the exceptions of `ans` blocks, and what they would cost as one bit per candidate (session 41).

An exception is a changed element whose bucket or value group the change moved (the backward decoder
finds buckets from the new values). Most are "edge" exceptions: a move of one exponent, the new
value's mantissa 0 (came from below) or 0x7F (from above), next to a threshold. Every element whose
new value sits at such an edge is a candidate; the binary entropy of "is an exception" over the
candidates is what a bit per candidate would cost, against a position per exception today. Run it
with a tree on PYTHONPATH (MAX_K = BUCKETS = 8 in a worktree for the 8-bucket line):

    PYTHONPATH=. python research/issue18-ctx-codec/probe_s41_edges.py 4
"""

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import common  # noqa: E402

from weightsync.codec import ans  # noqa: E402

root = sorted((Path(__file__).resolve().parents[2] / "benchmarks/.cache").glob("moe-lr1e-05-*"))[0]
a = int(sys.argv[1])
old = common.load_checkpoint(root / f"step_{a:06d}")
new = common.load_checkpoint(root / f"step_{a + 1:06d}")


def bits(c, n):
    if n == 0 or c == 0 or c == n:
        return 0.0
    p = c / n
    return -(c * np.log2(p) + (n - c) * np.log2(1 - p))


T = dict(exc=0, listed=0, edge=0, cand=0, candbits=0.0, other=0, bytes=0)
for name, (dt, buf) in new.items():
    o = old[name][1].view("<u2")
    x = buf.view("<u2")
    if dt != "BF16":
        continue
    block, k = ans.encode_block("BF16", o, x)
    if not k:
        continue
    P = ans.Parsed("BF16", memoryview(block), o.size, o.dtype, name)
    T["bytes"] += len(block)
    T["listed"] += P.exc.size
    blut, glut = P.luts()
    ctx = blut * 16 + glut  # per exponent
    oi = o.astype(np.int64)
    xi = x.astype(np.int64)
    eo = (oi >> 7) & 0xFF
    en = (xi >> 7) & 0xFF
    mn = xi & 0x7F
    exc = ctx[eo] != ctx[en]
    T["exc"] += int(exc.sum())
    # candidates: new value at an edge whose neighbour exponent has another context
    up = np.append(ctx[1:] != ctx[:-1], False)  # ctx[e+1] != ctx[e]
    dn = np.insert(ctx[1:] != ctx[:-1], 0, False)  # ctx[e-1] != ctx[e]
    cand = ((mn == 0x7F) & up[en]) | ((mn == 0) & dn[en])
    # an exception is "edge" if it is a candidate and old exponent adjacent in the right direction
    edge = exc & cand & (np.abs(eo - en) == 1) & (((mn == 0) & (eo == en - 1)) | ((mn == 0x7F) & (eo == en + 1)))
    # also candidates that crossed? a candidate is 'positive' iff edge
    T["edge"] += int(edge.sum())
    T["cand"] += int(cand.sum())
    T["other"] += int((exc & ~edge).sum())
    T["candbits"] += bits(edge.sum(), cand.sum())
print(T, f"candbits {T['candbits'] / 8e3:.1f} KB, per edge exception {T['candbits'] / max(T['edge'], 1):.2f} bits")
