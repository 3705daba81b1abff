"""What coding `ans`'s escapes otherwise could take off each step pair (session 42), per value group
against their Exp-Golomb codes of the best order: their empirical entropy (no table: a bound), and a
second 16-symbol rANS level ("two": min(v, 15) entropy-coded with a 16-byte table, v >= 15 in
Exp-Golomb; "twob": 32 symbols, 32 bytes), the better of it and today's per group. lr 1e-5 unless
LR=1e-06:

    python research/issue18-ctx-codec/probe_s42_escapes.py 0 1 2 3 4
"""

import os
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT)]
from common import load_checkpoint  # noqa: E402

from weightsync.codec import ans  # noqa: E402

lr = os.environ.get("LR", "1e-05")
root = sorted((ROOT / "benchmarks/.cache").glob(f"moe-lr{lr}-*"))[0]
steps = sorted(p for p in root.iterdir() if p.name.startswith("step"))


def entropy(m):
    _, cc = np.unique(m, return_counts=True)
    return -(cc * np.log2(cc / cc.sum())).sum()


def exp_golomb(v):
    return min((2 * np.floor(np.log2((v >> h) + 1)) + 1 + h).sum() for h in range(8)) if v.size else 0


for pair in map(int, sys.argv[1:]):
    a, b = load_checkpoint(steps[pair]), load_checkpoint(steps[pair + 1])
    T = dict(total=0, eg=0, ent=0, two=0, twob=0)
    for name, (dtype, buf) in a.items():
        if dtype != "BF16":
            continue
        o, n = buf.view("<u2"), b[name][1].view("<u2")
        data, ch = ans.encode_block("BF16", o, n)
        T["total"] += len(data)
        if not ch:
            continue
        p = ans.Parsed("BF16", memoryview(data), o.size, o.dtype, name)
        for g in range(p.G):
            d = p.diffs[p.dstart[g] : p.dstart[g + 1]].astype(np.int16).astype(np.int64)
            z = (d << 1) ^ (d >> 63)
            v = z[z >= 16] - 16
            if not v.size:
                continue
            today = exp_golomb(v) / 8
            T["eg"] += today
            T["ent"] += entropy(v) / 8
            for cap, key in ((15, "two"), (31, "twob")):
                T[key] += min(today, (entropy(np.minimum(v, cap)) + exp_golomb(v[v >= cap] - cap)) / 8 + cap + 1)
    gains = " ".join(f"{k} {100 * (T[k] - T['eg']) / T['total']:.3f}%" for k in ("ent", "two", "twob"))
    print(pair, {k: round(x) for k, x in T.items()}, gains)
