"""Ideal sizes of bucketed (exponent-threshold) context schemes vs the bounds."""
import sys, itertools
sys.path.insert(0, '/work/wt/codec/benchmarks'); sys.path.insert(0, '/work/wt/codec')
import numpy as np
import common

def nlog2n(c):
    c = np.asarray(c, np.float64); c = c[c > 0]; return float((c * np.log2(c)).sum())

def H_bits(counts):
    n = np.sum(counts); return nlog2n([n]) - nlog2n(counts)

def rice_bits(gaps, k):
    return int(np.sum((gaps >> k) + 1 + k))

def best_rice(gaps):
    if gaps.size == 0: return 0, 0
    return min((rice_bits(gaps, k), k) for k in range(0, 20))

def pairs(lr):
    dirs = common.cache_dirs(f"moe-lr{lr:g}", lr=lr, steps=6)
    return list(itertools.pairwise(dirs))

def tensor_costs(o, n, K):
    d = (n - o).astype(np.uint16)
    e = ((o >> 7) & 0xFF).astype(np.int64)
    ch = d != 0
    zz = (d.view(np.int16).astype(np.int32)); zz = np.where(zz >= 0, 2 * zz, -2 * zz - 1)
    # zeroth bound
    _, dc = np.unique(d[ch], return_counts=True)
    b0 = H_bits(np.append(dc, (~ch).sum()))
    # exp bound
    per = np.bincount(e, minlength=256); chper = np.bincount(e[ch], minlength=256)
    keys = e[ch] * 65536 + d[ch]
    _, jc = np.unique(keys, return_counts=True)
    bexp = nlog2n(per) - nlog2n(np.concatenate([jc, per - chper]))
    # thresholds: greedy optimal by DP over exponent values present, maximise mask info only
    ex = np.flatnonzero(per)
    # DP: partition ex (sorted) into K contiguous groups minimising sum n_g H(p_g)
    P = per[ex].astype(np.float64); C = chper[ex].astype(np.float64)
    cp, cc = np.concatenate([[0], np.cumsum(P)]), np.concatenate([[0], np.cumsum(C)])
    m = len(ex)
    def cost(a, b):
        nn, kk = cp[b] - cp[a], cc[b] - cc[a]
        return nlog2n([nn]) - nlog2n([kk, nn - kk])
    INF = 1e30
    dp = np.full((K + 1, m + 1), INF); dp[0, 0] = 0; arg = np.zeros((K + 1, m + 1), int)
    for g in range(1, K + 1):
        for b in range(1, m + 1):
            for a in range(g - 1, b):
                v = dp[g - 1, a] + cost(a, b)
                if v < dp[g, b]: dp[g, b] = v; arg[g, b] = a
    g = min(K, m); cuts = [m]
    b = m
    for gg in range(g, 0, -1):
        a = arg[gg, b]; cuts.append(a); b = a
    cuts = sorted(set(cuts))
    thr = [ex[c] for c in cuts[1:-1]]  # bucket = number of thresholds <= e
    bk = np.searchsorted(np.array(thr, np.int64), e, side='right') if thr else np.zeros_like(e)
    mask_ideal = 0.0; mask_rice = 0; val_ideal = 0.0; val_simple = 0
    for k in range(len(cuts) - 1):
        sel = bk == k
        chk = ch[sel]
        nk, ck = sel.sum(), chk.sum()
        mask_ideal += nlog2n([nk]) - nlog2n([ck, nk - ck])
        if ck:
            pos = np.flatnonzero(chk); gaps = np.diff(pos, prepend=-1) - 1
            mask_rice += best_rice(gaps)[0]
            z = zz[sel][chk]
            _, vc = np.unique(z, return_counts=True); val_ideal += H_bits(vc)
            # simple: sign bit + big-flag gaps (rice) + big magnitude EG0 (m-2) 
            mag = np.abs(d[sel][chk].view(np.int16).astype(np.int32))
            big = mag > 1
            bg = np.flatnonzero(big); 
            val_simple += ck  # signs
            if bg.size:
                val_simple += best_rice(np.diff(bg, prepend=-1) - 1)[0]
                mm = mag[big] - 2
                val_simple += best_rice(mm)[0]
    return b0, bexp, mask_ideal, val_ideal, mask_rice, val_simple

for lr in (1e-6, 1e-5):
    for K in (1, 2, 3, 4, 6):
        tot = np.zeros(6)
        for a, b in pairs(lr)[:5]:
            old, new = common.load_checkpoint(a), common.load_checkpoint(b)
            for name, (dt, buf) in new.items():
                o = old[name][1].view(np.uint16); nn = buf.view(np.uint16)
                if np.array_equal(o, nn): continue
                tot += tensor_costs(o, nn, K)
        b0, bexp, mi, vi, mr, vs = tot / 8
        print(f"lr {lr:g} K={K}: bound {b0/5e6:.3f}MB exp {bexp/b0:.3f} | ideal {(mi+vi)/b0:.3f} (mask {mi/b0:.3f} val {vi/b0:.3f}) | rice {(mr+vs)/b0:.3f} (mask {mr/b0:.3f} val {vs/b0:.3f})", flush=True)
