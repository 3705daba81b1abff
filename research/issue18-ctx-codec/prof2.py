import sys, time; sys.path.insert(0,'/tmp/issue18'); sys.path.insert(0,'/work/wt/codec/benchmarks'); sys.path.insert(0,'/work/wt/codec')
import numpy as np, xxhash, common, ctx, run
for lr in (1e-6, 1e-5):
    dirs = common.cache_dirs(f"moe-lr{lr:g}", lr=lr, steps=6)
    old, new = common.load_checkpoint(dirs[1]), common.load_checkpoint(dirs[2])
    nm = 'lm_head.weight'
    o = old[nm][1].view(np.uint16); nw = new[nm][1].view(np.uint16); n = o.size
    data, k = ctx.encode_core(o, nw, 7, 0xFF, 8, 16)
    K, shift, thr, inv, nch, ncod, roff, zoff, ranks, zz = ctx.decode_streams(data, n, 16)
    lim = np.zeros(K, o.dtype); lim[:K - 1] = thr << 7; lim[K - 1] = 0x7FFF
    out = np.empty_like(o)
    def phaseB(copy, hash_):
        cnt = np.zeros(K, np.int64); ri = roff[:K].copy(); zi = zoff[:K].copy()
        step = 1 << 18; h = xxhash.xxh3_128()
        for a in range(0, n, step):
            e = min(n, a + step)
            ctx.apply_slice(o, out, a, e, lim, K, inv, nch, ncod, roff, zoff, ranks, zz, cnt, ri, zi, copy)
            if hash_: h.update(out[a:e])
    def T(label, f, *a):
        f(*a); t = time.perf_counter()
        for _ in range(5): f(*a)
        print(f"  lr {lr:g} {label}: {o.nbytes / ((time.perf_counter() - t) / 5) / 1e9:.2f} GB/s", flush=True)
    T('memcpy', np.copyto, out, o)
    T('memcpy+xxh3 sliced', lambda: [ (np.copyto(out[a:a+(1<<18)], o[a:a+(1<<18)]), xxhash.xxh3_128(out[a:a+(1<<18)])) for a in range(0, n, 1 << 18)])
    np.copyto(out, o); T('phase B patch only (no copy/hash, wrong result)', phaseB, False, False)
    T('phase B copy+patch+hash', phaseB, True, True)
    T('phase A streams', ctx.decode_streams, data, n, 16)
    print('  K', K, 'thr', thr, 'inv', inv, 'changes/bucket', nch)
