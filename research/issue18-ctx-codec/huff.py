"""Sizes of: K exponent-interval buckets; per bucket gap symbols (log classes) and zz symbols, canonical Huffman
(length-limited), table costs included. vs bounds."""
import sys, itertools, heapq
sys.path.insert(0, '/work/wt/codec/benchmarks'); sys.path.insert(0, '/work/wt/codec')
import numpy as np, common

def nlog2n(c):
    c = np.asarray(c, np.float64); c = c[c > 0]; return float((c * np.log2(c)).sum())
def H_bits(counts):
    return nlog2n([np.sum(counts)]) - nlog2n(counts)

def huff_lengths(counts, maxlen=15):
    counts = np.asarray(counts)
    nz = np.flatnonzero(counts)
    L = np.zeros(counts.size, int)
    if nz.size == 1: L[nz] = 1; return L
    h = [(int(counts[i]), i, (i,)) for i in nz]; heapq.heapify(h); cnt = 0
    while len(h) > 1:
        a = heapq.heappop(h); b = heapq.heappop(h)
        for s in a[2] + b[2]: L[s] += 1
        heapq.heappush(h, (a[0] + b[0], min(a[1], b[1]), a[2] + b[2]))
    while L.max() > maxlen:  # crude: scale counts
        counts = np.where(counts > 0, np.maximum(counts // 2, 1), 0); return huff_lengths(counts, maxlen)
    return L

def gap_sym(g):
    g = g.astype(np.int64)
    b = np.floor(np.log2(np.maximum(g, 1))).astype(np.int64)
    sym = np.where(g < 4, g, 2 * b + ((g >> np.maximum(b - 1, 0)) & 1))
    extra = np.where(g < 4, 0, b - 1)
    return sym, extra

def code_cost(sym, extra, nsym=64):
    c = np.bincount(sym, minlength=nsym)
    if sym.size == 0: return 0, 8, 0.0
    L = huff_lengths(c)
    table = 8 + 4 * (np.flatnonzero(c).max() + 1)
    return int((c * L).sum() + extra.sum()), table, H_bits(c) + extra.sum()

def thresholds(e, ch, K, sample=1):
    per = np.bincount(e[::sample], minlength=256); chper = np.bincount(e[::sample][ch[::sample]], minlength=256)
    ex = np.flatnonzero(per)
    P = per[ex].astype(float); C = chper[ex].astype(float)
    cp, cc = np.concatenate([[0], np.cumsum(P)]), np.concatenate([[0], np.cumsum(C)])
    m = len(ex)
    def cost(a, b):
        nn, kk = cp[b] - cp[a], cc[b] - cc[a]
        return nlog2n([nn]) - nlog2n([kk, nn - kk])
    dp = np.full((K + 1, m + 1), 1e30); dp[0, 0] = 0; arg = np.zeros((K + 1, m + 1), int)
    for g in range(1, K + 1):
        for b in range(1, m + 1):
            for a in range(g - 1, b):
                v = dp[g - 1, a] + cost(a, b)
                if v < dp[g, b]: dp[g, b] = v; arg[g, b] = a
    cuts = [m]; b = m
    for gg in range(min(K, m), 0, -1):
        b = arg[gg, b]; cuts.append(b)
    cuts = sorted(set(cuts))
    return np.array([ex[c] for c in cuts[1:-1]], np.int64)

def tensor(o, n, K, sample):
    d = (n - o); e = ((o >> 7) & 0xFF).astype(np.int64); ch = d != 0
    _, dc = np.unique(d[ch], return_counts=True); b0 = H_bits(np.append(dc, (~ch).sum()))
    thr = thresholds(e, ch, K, sample)
    bk = np.searchsorted(thr, e, side='right')
    tot = 32 + len(thr); ideal = 0; tab = 0
    for k in range(len(thr) + 1):
        sel = bk == k; chk = ch[sel]; nk = sel.sum(); ck = chk.sum()
        if ck == 0: tot += 4; continue
        inv = ck * 2 > nk
        pos = np.flatnonzero(~chk if inv else chk)
        gaps = np.diff(pos, prepend=-1) - 1
        # tail: gaps of positions; (last run implied by count)
        s, x = gap_sym(gaps); c1, t1, i1 = code_cost(s, x)
        z = d[sel][chk].view(np.int16).astype(np.int32); z = np.where(z >= 0, 2 * z, -2 * z - 1)
        zs = np.minimum(z, 31); xb = np.where(z >= 31, 16, 0)
        c2, t2, i2 = code_cost(zs, xb, 32)
        tot += c1 / 8 + c2 / 8 + t1 / 8 + t2 / 8 + 8; tab += (t1 + t2) / 8 + 8; ideal += (i1 + i2) / 8
    return b0 / 8, tot, tab, ideal

if __name__ == '__main__':
    for lr in (1e-6, 1e-5):
        dirs = common.cache_dirs(f"moe-lr{lr:g}", lr=lr, steps=6)
        for K in (4, 6, 8):
            res = []
            for a, b in itertools.pairwise(dirs):
                old, new = common.load_checkpoint(a), common.load_checkpoint(b)
                t = np.zeros(4)
                for name, (dt, buf) in new.items():
                    o = old[name][1].view(np.uint16); nn = buf.view(np.uint16)
                    if np.array_equal(o, nn): continue
                    t += tensor(o, nn, K, 16)
                res.append(t)
            print(f"lr {lr:g} K={K}: per pair huff/bound", [round(r[1] / r[0], 3) for r in res],
                  "tables/bound", round(sum(r[2] for r in res) / sum(r[0] for r in res), 3),
                  "ideal-static/bound", round(sum(r[3] for r in res) / sum(r[0] for r in res), 3), flush=True)
