"""Prototype: each bucket's positions as nibbles of its bitmap, static rANS with a table derived from
its density (no table bytes), against its Rice section. lr 1e-5 pairs given (default all).
(Session 39; reads blocks in the layout before nibbles and carried bytes: run it with cced093's tree
on PYTHONPATH, e.g. a git worktree.)"""
import sys, os, glob, time
from pathlib import Path
ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]; sys.path.insert(0, str(ROOT / "benchmarks")); sys.path.insert(0, str(ROOT))
import numpy as np, numba
from common import load_checkpoint
from weightsync.codec import ans, entropy, lanes
lr = os.environ.get("LR", "1e-05")
d = sorted(glob.glob(f"{ROOT}/benchmarks/.cache/moe-lr{lr}-*"))[0]
steps = sorted(os.listdir(d))
sel = [int(x) for x in sys.argv[1:]] or range(len(steps) - 1)
def varint(d, p):
    v = s = 0
    while True:
        b = d[p]; p += 1; v |= (b & 127) << s; s += 7
        if b < 128: return v, p
POP = np.array([bin(i).count("1") for i in range(16)])
def table(c, n):
    q = min(4095, max(1, (c * 4096 + n // 2) // n))
    w = np.array([q ** int(POP[t]) * (4096 - q) ** (4 - int(POP[t])) for t in range(16)], dtype=object)
    f = np.array([max(1, int(x) >> 36) for x in w], np.int64)
    big = 0 if q <= 2048 else 15
    f[big] = 0; f[big] = 4096 - f.sum()
    assert f.min() >= 1
    return f
out = np.empty(1 << 24, np.uint8)
T = dict(total=0, rice=0, nib=0, best=0, best_dens=0, nbuck=0)
bands = {}
items = []
for pi in sel:
    a, b = load_checkpoint(Path(d)/steps[pi]), load_checkpoint(Path(d)/steps[pi+1])
    for name in a:
        if a[name][0] != "BF16": continue
        o, n = a[name][1].view("<u2"), b[name][1].view("<u2")
        data, ch = ans.encode_block("BF16", o, n)
        if not ch: continue
        T["total"] += len(data)
        p = ans.Parsed("BF16", memoryview(data), o.size, o.dtype, "t")
        # Rice section lengths from the header
        dd = bytes(data); K, L_, G = dd[4] & 7, dd[4] >> 7, dd[7]
        pp = 8 + K - 1 + G - 1
        e, pp = varint(dd, pp)
        if e and L_:
            pp += 1; x, pp = varint(dd, pp); pp += x
        elif e:
            for _ in range(e): _, pp = varint(dd, pp)
            pp += e
        R = []
        for _ in range(K):
            nb_, pp = varint(dd, pp); cb, pp = varint(dd, pp)
            r = 0
            if cb: r, pp = varint(dd, pp + 1)
            R.append(r)
        for bb in range(p.K):
            nb = int(p.nb[bb])
            if not nb: continue
            w = p.words[p.wbase[bb]: p.wbase[bb] + (nb + 63)//64].copy()
            if nb & 63: w[-1] &= np.uint64((1 << (nb & 63)) - 1)
            c = int(np.unpackbits(w.view(np.uint8)).sum())
            if not c: continue
            by = w.view(np.uint8)[: (nb + 7) // 8]
            nibs = np.empty(2 * by.size, np.uint8); nibs[0::2] = by & 15; nibs[1::2] = by >> 4
            nibs = nibs[: (nb + 3) // 4]
            f = table(c, nb)
            sp = np.concatenate([nibs, np.zeros(8, np.uint8)])
            m = nibs.size
            if m >= lanes.WIDE_MIN: L = lanes.rans_encode_wide(sp, m, f, out, True)
            else: L = entropy.rans_encode(sp, m, f, out)
            h = np.bincount(nibs, minlength=16); hz = h[h > 0]
            ideal = float(-(hz * np.log2(hz / m)).sum()) / 8
            ff = np.zeros(16, np.int64); entropy.normalise(h.astype(np.int64), ff)
            Lx = (lanes.rans_encode_wide(sp, m, ff, out, True) if m >= lanes.WIDE_MIN else entropy.rans_encode(sp, m, ff, out)) + 20
            der = float(-(h[h>0] * np.log2(f[h>0] / 4096)).sum()) / 8
            items.append((c / nb, c, nb, m, L, R[bb], ideal, der, Lx))
# Rice lengths: re-derive by encoding the gaps as the package does
print("collected", len(items))

it = np.array(items, np.float64)
dens, L, R = it[:, 0], it[:, 4], it[:, 5]
ns = len(sel)
print("total/step %.0f rice %.0f nib %.0f best %.0f -> saving %.0f (%.2f%%)" % (T["total"]/ns, R.sum()/ns, L.sum()/ns, np.minimum(L, R).sum()/ns, (R - np.minimum(L, R)).sum()/ns, 100*(R - np.minimum(L, R)).sum()/T["total"]))
for lo, hi in ((0, 1/64), (1/64, 1/32), (1/32, 1/16), (1/16, 1/8), (1/8, 1/4), (1/4, 1.01)):
    m = (dens >= lo) & (dens < hi)
    print("density [%.4f,%.4f): buckets %4d syms/step %10.0f gaps/step %10.0f rice %10.0f nib %10.0f (%.3f)" % (lo, hi, m.sum(), it[m, 3].sum()/ns, np.minimum(it[m,1], it[m,2]-it[m,1]).sum()/ns, R[m].sum()/ns, L[m].sum()/ns, L[m].sum()/max(1,R[m].sum())))

print("derived-table model cost %.0f ideal empirical %.0f explicit (+20B table) %.0f best-of-3 %.0f" % (it[:, 7].sum()/ns, it[:, 6].sum()/ns, it[:, 8].sum()/ns, np.minimum(np.minimum(L, R), it[:, 8]).sum()/ns))
wide = it[:, 3] >= lanes.WIDE_MIN
ch = dens >= 1/16
print("dense buckets/step", ch.sum()/ns, "wide among them", (ch & wide).sum()/ns)
print("overhead L-model: wide %.0f narrow %.0f" % ((L - it[:, 7])[ch & wide].sum()/ns, (L - it[:, 7])[ch & ~wide].sum()/ns))
print("rule >=1/16: saving %.0f (%.2f%%)" % ((R - L)[ch].sum()/ns, 100*(R - L)[ch].sum()/T["total"]))
