"""lr 1e-5: ans's overheads by part, MB per step summed over pairs given (default all).
(Session 39; reads blocks in the layout before nibbles and carried bytes: run it with cced093's tree
on PYTHONPATH, e.g. a git worktree.)"""
import sys, os, glob
from pathlib import Path
ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]; sys.path.insert(0, str(ROOT / "benchmarks")); sys.path.insert(0, str(ROOT))
import numpy as np
from common import load_checkpoint
from weightsync.codec import ans, entropy
from weightsync.codec.entropy import NSYM
d = sorted(glob.glob(f"{ROOT}/benchmarks/.cache/moe-lr1e-05-*"))[0]
steps = sorted(os.listdir(d))
sel = [int(x) for x in sys.argv[1:]] or range(len(steps) - 1)
def varint(d, p):
    v = s = 0
    while True:
        b = d[p]; p += 1; v |= (b & 127) << s; s += 7
        if b < 128: return v, p
T = {}
def add(k, v): T[k] = T.get(k, 0) + v
for pi in sel:
    a, b = load_checkpoint(Path(d)/steps[pi]), load_checkpoint(Path(d)/steps[pi+1])
    for name in a:
        if a[name][0] != "BF16": continue
        o, n = a[name][1].view("<u2"), b[name][1].view("<u2")
        data, ch = ans.encode_block("BF16", o, n)
        if not ch: continue
        dd = bytes(data)
        add("total", len(data)); add("blocks", 1)
        K, L, V, G = dd[4] & 7, dd[4] >> 7, (dd[4] >> 4) & 1, dd[7]
        p = 8 + K - 1 + G - 1
        add("h.fixed", p)
        e, p2 = varint(dd, p); p0 = p
        p = p2
        if e and L:
            p += 1; x, p = varint(dd, p); p += x
        elif e:
            for _ in range(e): _, p = varint(dd, p)
            p += e
        add("exc", p - p0); add("exc.n", e)
        rs = []
        q = p
        for _ in range(K):
            nb, p = varint(dd, p); cb, p = varint(dd, p)
            if cb:
                kk = dd[p] >> 1; inv = dd[p] & 1
                r, p = varint(dd, p + 1); rs.append((r, kk, inv, nb, cb))
        add("h.buckets", p - q)
        gs = []
        for _ in range(G):
            q = p
            m, p = varint(dd, p)
            add("h.groups.m", p - q)
            if m:
                s = dd[p] & 31; q = p; p += 1
                fr = []
                for _ in range(s):
                    f, p = varint(dd, p); fr.append(f)
                add("h.tables", p - q); add("tables.n", 1)
                q = p
                e_g, p = varint(dd, p); a_g, p = varint(dd, p)
                add("h.groups.EA", p - q)
                gs.append((m, e_g, a_g, fr))
        add("header_end_check", 0)
        # Rice sections
        for r, kk, inv, nb, cb in rs:
            q = p
            l0, p = varint(dd, p); l1, p = varint(dd, p); l2, p = varint(dd, p)
            add("rice.lenvarints", p - q)
            add("rice.body", r - (p - q)); add("rice.sections", 1)
            p = q + r
        parsed = ans.Parsed("BF16", memoryview(data), o.size, o.dtype, "t")
        # ideal rice bits per bucket (same k): gaps from bitmaps
        for bb in range(parsed.K):
            nb = int(parsed.nb[bb])
            if not nb: continue
            w = parsed.words[parsed.wbase[bb]: parsed.wbase[bb] + (nb + 63)//64]
            bits = np.unpackbits(w.view(np.uint8), bitorder="little")[:nb].astype(bool)
            c = int(bits.sum())
            if not c: continue
            inv = 2 * c > nb
            pos = np.flatnonzero(~bits if inv else bits)
            g = np.diff(np.concatenate([[-1], pos])) - 1
            kk = [x for x in rs if x[3] == nb and x[4] == c][0][1]
            add("rice.codebits/8", float(np.where((g >> kk) < 32, (g >> kk) + 1 + kk, 64).sum()) / 8)
            pr = c / nb
            add("pos.h2/8", float(-(c*np.log2(pr) + (nb-c)*np.log2(1-pr))) / 8 if 0 < c < nb else 0)
        for gi, (m, e_g, a_g, fr) in enumerate(gs):
            S = 32 if (V and m >= 1 << 15) else 4
            add("rans.states", 4 * S); add("rans.words", a_g - 4 * S); add("esc", e_g)
            dg = parsed.diffs[parsed.dstart[gi]:parsed.dstart[gi+1]].astype(np.int16).astype(np.int64)
            z = (dg << 1) ^ (dg >> 63)
            t = np.minimum(z - 1, NSYM - 1)
            cnt = np.bincount(t, minlength=NSYM)
            f = np.array(fr + [0] * (NSYM - len(fr)))
            add("rans.ideal/8", float(-(cnt[cnt > 0] * np.log2(cnt[cnt > 0] / m)).sum()) / 8)
            add("rans.table/8", float(-(cnt[cnt > 0] * np.log2(f[cnt > 0] / 4096)).sum()) / 8)
            if S == 32: add("wide.n", 1)
nstep = len(sel)
for k, v in T.items():
    print(f"{k:22s} {v / nstep:14.1f}")
