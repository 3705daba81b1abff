import sys, itertools
sys.path.insert(0, '/work/wt/codec/benchmarks'); sys.path.insert(0, '/work/wt/codec')
import numpy as np, common
for lr in (1e-6, 1e-5):
    dirs = common.cache_dirs(f"moe-lr{lr:g}", lr=lr, steps=6)
    old, new = common.load_checkpoint(dirs[1]), common.load_checkpoint(dirs[2])
    zs, ss = [], []
    for name, (dt, buf) in new.items():
        o = old[name][1].view(np.uint16); n = buf.view(np.uint16)
        d = (n - o).view(np.int16).astype(np.int32); ch = d != 0
        zs.append(d[ch]); ss.append((o[ch] >> 15))
    d = np.concatenate(zs); s = np.concatenate(ss)
    v, c = np.unique(d, return_counts=True); top = np.argsort(-c)[:8]
    print(lr, d.size, [(int(v[i]), round(c[i]/d.size, 3)) for i in top])
    # sign of change relative to old sign: towards zero?
    toward = (np.sign(d) > 0) == (s == 1)  # for negative old (s=1) increasing u means more negative... 
    print(' frac uview-increase', np.mean(d > 0), 'frac d>0 given old negative', np.mean(d[s == 1] > 0), 'given positive', np.mean(d[s == 0] > 0))
