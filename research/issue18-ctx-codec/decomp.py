import sys, itertools
sys.path.insert(0, '/work/wt/codec/benchmarks'); sys.path.insert(0, '/work/wt/codec')
import numpy as np, common
def nl(c):
    c = np.asarray(c, np.float64); c = c[c > 0]; return float((c * np.log2(c)).sum())
def H(c): return nl([np.sum(c)]) - nl(c)
def hb(n, k): return nl([n]) - nl([k, n - k])
for lr in (1e-6, 1e-5):
    dirs = common.cache_dirs(f"moe-lr{lr:g}", lr=lr, steps=6)
    for a, b in list(itertools.pairwise(dirs))[1:2]:
        old, new = common.load_checkpoint(a), common.load_checkpoint(b)
        T = dict(bound=0, m0=0, me=0, mprev=0, v0=0, ve=0, vzz_e=0, n=0, k=0, vcoarse=0, mcoarse=0)
        sizes=[]
        for name, (dt, buf) in new.items():
            o = old[name][1].view(np.uint16); nw = buf.view(np.uint16)
            d = nw - o; ch = d != 0; n = o.size; k = int(ch.sum())
            sizes.append(n)
            if k == 0: continue
            e = ((o >> 7) & 0xFF).astype(np.int64)
            _, dc = np.unique(d[ch], return_counts=True)
            T['bound'] += H(np.append(dc, n - k)); T['n'] += n; T['k'] += k
            T['m0'] += hb(n, k)
            per = np.bincount(e, minlength=256); cp = np.bincount(e[ch], minlength=256)
            T['me'] += sum(hb(per[i], cp[i]) for i in np.flatnonzero(per))
            prev = np.concatenate([[False], ch[:-1]])
            T['mprev'] += sum(hb((prev == p).sum(), (ch & (prev == p)).sum()) for p in (0, 1))
            T['v0'] += H(dc)
            keys = e[ch] * 65536 + d[ch]
            _, jc = np.unique(keys, return_counts=True)
            T['ve'] += H(jc) - H(np.bincount(e[ch]))  # H(d|e) among changed
            # coarse: relative exponent: e - max e in tensor? bucket e into 8 groups by quantiles
            ec = np.minimum(np.maximum(e[ch] - 100, 0), 40)
            keys = ec * 65536 + d[ch]; _, jc = np.unique(keys, return_counts=True)
            T['vcoarse'] += H(jc) - H(np.bincount(ec))
        B = T['bound']
        print(f"lr {lr:g} n={T['n']} k={T['k']} ({T['k']/T['n']:.2%}) tensors {len(sizes)} median {int(np.median(sizes))} max {max(sizes)}")
        for kk in ('m0','me','mprev','v0','ve','vcoarse'):
            print(f"   {kk}: {T[kk]/B:.3f} of bound")
        print(f"   ideal pos0+val_e: {(T['m0']+T['ve'])/B:.3f}; pos_e+val_e: {(T['me']+T['ve'])/B:.3f}; pos_e+val0 {(T['me']+T['v0'])/B:.3f}")
