"""Per step: exception bytes vs. 2 bytes per rANS state of the block (values' and nibble sections).
(Session 39: python probe_s39_cap.py; LR=1e-06 for the other trajectory.)"""
import sys, os, glob
from pathlib import Path
ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]; sys.path.insert(0, str(ROOT / "benchmarks")); sys.path.insert(0, str(ROOT))
import numpy as np
from common import load_checkpoint
from weightsync.codec import ans
lr = os.environ.get("LR", "1e-05")
d = sorted(glob.glob(f"{ROOT}/benchmarks/.cache/moe-lr{lr}-*"))[0]
steps = sorted(os.listdir(d))
def varint(d, p):
    v = s = 0
    while True:
        b = d[p]; p += 1; v |= (b & 127) << s; s += 7
        if b < 128: return v, p
T = dict(total=0, exc=0, cap=0, save=0, blocks=0)
for pi in range(len(steps) - 1):
    a, b = load_checkpoint(Path(d)/steps[pi]), load_checkpoint(Path(d)/steps[pi+1])
    for name in a:
        if a[name][0] != "BF16": continue
        o, n = a[name][1].view("<u2"), b[name][1].view("<u2")
        data, ch = ans.encode_block("BF16", o, n)
        if not ch: continue
        dd = bytes(data); K, V, N, G = dd[4] & 7, dd[4] & 0x10, dd[4] & 0x20, dd[7]
        p = 8 + K - 1 + G - 1
        e, p = varint(dd, p); x = 0
        if e and dd[4] & 0x80:
            p += 1; x, p = varint(dd, p); p += x
        states = 0; tot = 0
        for _ in range(K):
            nb, p = varint(dd, p); cb, p = varint(dd, p)
            if cb:
                if dd[p] == 62: p += 1; tot += ans.run_symbols(nb)
                else: _, p = varint(dd, p + 1)
        if N:
            _, p = varint(dd, p); states += 32 if (V and tot >= ans.WIDE_MIN) else 4
        for _ in range(G):
            m, p = varint(dd, p)
            if m:
                s = dd[p] & 31; p += 1
                for _ in range(s): _, p = varint(dd, p)
                _, p = varint(dd, p); _, p = varint(dd, p)
                states += 32 if (V and m >= 1 << 15) else 4
        T["total"] += len(data); T["exc"] += x; T["cap"] += 2 * states; T["save"] += min(x, 2 * states); T["blocks"] += 1
ns = len(steps) - 1
print({k: round(v / ns) for k, v in T.items()}, "save %.2f%%" % (100 * T["save"] / T["total"]))
