import sys, time; sys.path.insert(0,'/tmp/issue18'); sys.path.insert(0,'/work/wt/codec/benchmarks'); sys.path.insert(0,'/work/wt/codec')
import numpy as np, xxhash, common, ctx, run
lr = float(sys.argv[1])
dirs = common.cache_dirs(f"moe-lr{lr:g}", lr=lr, steps=6)
old, new = common.load_checkpoint(dirs[1]), common.load_checkpoint(dirs[2])
names = sorted(new, key=lambda n: -new[n][1].size)
print(len(names), [new[n][1].size for n in names[:3]], new[names[-1]][1].size)
for nm in (names[0], names[5]):
    o = old[nm][1].view(np.uint16); nw = new[nm][1].view(np.uint16)
    def T(label, f, *a):
        f(*a); t = time.perf_counter()
        for _ in range(5): r = f(*a)
        print(f"  {label}: {o.nbytes / ((time.perf_counter() - t) / 5) / 1e9:.2f} GB/s"); return r
    print(nm, o.size, np.mean(o != nw))
    T('memcpy', np.copyto, np.empty_like(o), o)
    thr, K = T('thresholds', ctx.choose_thresholds, o, nw, 7, 0xFF, 8)
    lim = np.zeros(K, o.dtype); lim[:K - 1] = thr << 7; lim[K - 1] = 0x7FFF
    b = np.empty(o.size + 1, np.uint8); r = np.empty(o.size + 1, np.int64); z = np.empty(o.size + 1, np.uint64)
    T('scan', ctx.scan, o, nw, lim, K, b, r, z)
    data, k = T('encode total', ctx.encode_core, o, nw, 7, 0xFF, 8, 16)
    T('decode streams', ctx.decode_streams, data, o.size, 16)
    out = np.empty_like(o)
    T('decode total', run.decode, data, o, out, xxhash.xxh3_128())
