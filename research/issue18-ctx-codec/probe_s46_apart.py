"""lr 1e-5 (or the lr given): per pair, ans bytes, ac bytes, and what moving the exception list out of
the block and carrying the Rice sections' first bytes in the states would take off (session 46; reads blocks
in the layout before flag A: run it with 09094e4's tree, before 91a2edc, e.g. a git worktree).

    python probe_s46_apart.py 1e-05
"""
import sys, os, glob
from pathlib import Path
ROOT = Path(__file__).resolve().parents[2]; sys.path.insert(0, str(ROOT / "benchmarks")); sys.path.insert(0, str(ROOT))
import numpy as np
from common import load_checkpoint
from weightsync.codec import ans, arith
lr = sys.argv[1] if len(sys.argv) > 1 else "1e-05"
d = sorted(glob.glob(f"{ROOT}/benchmarks/.cache/moe-lr{lr}-*"))[0]
steps = sorted(os.listdir(d))
def varint(b, p):
    v = s = 0
    while True:
        x = b[p]; p += 1; v |= (x & 127) << s; s += 7
        if x < 128: return v, p
RB=[0]
def parse(b):
    RB[0]=0
    f = b[4]; L, C, N, V, K = f >> 7, (f >> 6) & 1, (f >> 5) & 1, (f >> 4) & 1, f & 7
    G = b[7]; p = 8 + K - 1 + G - 1
    p0 = p
    e, p = varint(b, p); X = 0
    if L:
        p += 1; X, p = varint(b, p)
        if not C: p += X
    hdr_list = p - p0
    nibsyms = 0; T = 0
    for _ in range(K):
        nb, p = varint(b, p); cb, p = varint(b, p)
        if cb:
            k = b[p]; p += 1
            if N and k == 62: nibsyms += 32 * -(-nb // 128)
            else:
                r, p = varint(b, p); RB[0] += r
    if N:
        _, p = varint(b, p); T += 32 if (V and nibsyms >= 1 << 15) else 4
    for _ in range(G):
        m, p = varint(b, p)
        if m:
            s = b[p] & 31; p += 1
            for _ in range(s): _, p = varint(b, p)
            _, p = varint(b, p); _, p = varint(b, p)
            T += 32 if (V and m >= 1 << 15) else 4
    H = min(X, 2 * T) if C else 0
    return e, X, H, hdr_list, T, min(RB[0], 2*T)
for pi in range(len(steps) - 1):
    a, bb = load_checkpoint(Path(d)/steps[pi]), load_checkpoint(Path(d)/steps[pi+1])
    tot = tac = lst = exc = carried = 0; states = 0; rc = 0
    for name in a:
        if a[name][0] != "BF16": continue
        o, n = a[name][1].view("<u2").ravel(), bb[name][1].view("<u2").ravel()
        data, ch = ans.encode_block("BF16", o, n)
        if not ch: continue
        tot += len(data)
        e, X, H, hl, T, RC = parse(data); rc += RC
        exc += e; lst += hl + (X - H if True else 0) if not (data[4] >> 6) & 1 else hl + X - H
        carried += H; states += T
        tac += len(arith.encode_block("BF16", o, n)[0]) if hasattr(arith, "encode_block") else 0
    print(f"pair {pi}: ans {tot} ac {tac} ans/ac {tot/tac-1:+.2%}  list(fwd cost) {lst} ({lst/tot:.2%}) carried {carried} exc {exc} states {states}  without list {(tot-lst)/tac-1:+.2%} rice-carry {rc} -> {(tot-lst-rc)/tac-1:+.2%}", flush=True)
