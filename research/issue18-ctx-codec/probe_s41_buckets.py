"""lr 1e-5: how much of `ans`'s size gap to `ac` is the position buckets' resolution (session 41).

For each step pair given (default 4), over the BF16 tensors of 100,000 elements or more: the change
mask's entropy given the old exponent (all 256 values: what `ac`'s adaptive models approach), given
the best K contiguous exponent ranges (a dynamic program, K = 4, 8), given the ranges `ans`'s plan
chose, and the bytes and exceptions of the blocks. Run it with a tree on PYTHONPATH (e.g. a worktree
with MAX_K = BUCKETS = 8 in weightsync/codec/ans.py for the 8-bucket line).

    PYTHONPATH=. python research/issue18-ctx-codec/probe_s41_buckets.py 4
"""

import glob
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import load_checkpoint  # noqa: E402

from weightsync.codec import ans  # noqa: E402


def bits(c: float, n: float) -> float:
    """Empirical binary entropy of c ones among n, in bits."""
    if n == 0 or c == 0 or c == n:
        return 0.0
    p = c / n
    return -(c * np.log2(p) + (n - c) * np.log2(1 - p))


def best_ranges(cn: list[tuple[float, float]], k: int) -> float:
    """The least total entropy of the mask split into at most k contiguous exponent ranges."""
    c = np.cumsum([0] + [x[0] for x in cn])
    n = np.cumsum([0] + [x[1] for x in cn])
    m = len(cn)
    d = [0.0] + [float("inf")] * m
    best = float("inf")
    for _ in range(k):
        d = [min(d[i] + bits(c[j] - c[i], n[j] - n[i]) for i in range(j)) if j else float("inf") for j in range(m + 1)]
        best = min(best, d[m])
    return best


root = Path(sorted(glob.glob(f"{ROOT}/benchmarks/.cache/moe-lr1e-05-*"))[0])
for a in [int(x) for x in sys.argv[1:]] or [4]:
    old = load_checkpoint(root / f"step_{a:06d}")
    new = load_checkpoint(root / f"step_{a + 1:06d}")
    t = dict.fromkeys(("full", "best4", "best8", "plan", "bytes", "exceptions"), 0.0)
    for name, (dtype, buf) in new.items():
        o, x = old[name][1].view("<u2"), buf.view("<u2")
        if dtype != "BF16" or o.size < 100_000:
            continue
        changed = o != x
        e = (o >> 7) & 0xFF
        n = np.bincount(e, minlength=256)
        c = np.bincount(e, weights=changed, minlength=256)
        cn = [(c[i], n[i]) for i in range(256) if n[i]]
        t["full"] += sum(bits(*v) for v in cn)
        t["best4"] += best_ranges(cn, 4)
        t["best8"] += best_ranges(cn, 8)
        block, k = ans.encode_block("BF16", o, x)
        if not k:  # no change: an empty block
            continue
        parsed = ans.Parsed("BF16", memoryview(block), o.size, o.dtype, name)
        b = np.searchsorted(parsed.thr, e, side="right")
        t["plan"] += sum(bits(changed[b == k].sum(), (b == k).sum()) for k in range(parsed.K))
        t["bytes"] += len(block)
        t["exceptions"] += parsed.exc.size
    kb = {k: f"{v / 8e3:.1f} KB" for k, v in t.items() if k not in ("bytes", "exceptions")}
    print(
        f"pair {a}, MAX_K {ans.MAX_K}: mask entropy {kb}; blocks {t['bytes']:.0f} B, {t['exceptions']:.0f} exceptions"
    )
