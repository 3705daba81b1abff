import sys, time, itertools; sys.path.insert(0,'/tmp/issue18'); sys.path.insert(0,'/work/wt/codec/benchmarks'); sys.path.insert(0,'/work/wt/codec')
import numpy as np, xxhash, common, ctx
from weightsync.codec.payload import encode_tensor, decode_tensor, CodecConfig
from weightsync.codec.streams import SLICE_BYTES
from huff import H_bits

def encode(o, nw, K=8):
    return ctx.encode_core(o, nw, 7, 0xFF, K, 16)

def decode(data, o, out, hasher):
    n = o.size
    K, shift, thr, inv, nch, ncod, roff, zoff, ranks, zz = ctx.decode_streams(data, n, 16)
    lim = np.zeros(K, o.dtype)
    for t in range(K - 1): lim[t] = thr[t] << shift
    lim[K - 1] = 0x7FFF
    cnt = np.zeros(K, np.int64); ri = roff[:K].copy(); zi = zoff[:K].copy()
    step = SLICE_BYTES // 2
    for a in range(0, n, step):
        e = min(n, a + step)
        ctx.apply_slice(o, out, a, e, lim, K, inv, nch, ncod, roff, zoff, ranks, zz, cnt, ri, zi, True)
        hasher.update(out[a:e])
    return out

def main(lrs=(1e-6, 1e-5), npairs=5, K=8):
    for lr in lrs:
        dirs = common.cache_dirs(f"moe-lr{lr:g}", lr=lr, steps=6)
        for a, b in list(itertools.pairwise(dirs))[:npairs]:
            old, new = common.load_checkpoint(a), common.load_checkpoint(b)
            names = sorted(new, key=lambda n: -new[n][1].size)
            bound = 0.0; size = 0; raw = 0; enc = {}
            for nm in names:
                o = old[nm][1].view(np.uint16); nw = new[nm][1].view(np.uint16)
                raw += o.nbytes
                d = nw - o; ch = d != 0
                if not ch.any(): continue
                _, dc = np.unique(d[ch], return_counts=True); bound += H_bits(np.append(dc, (~ch).sum())) / 8
                data, k = encode(o, nw, K); enc[nm] = data; size += data.size + 28 + 8
                out = np.empty_like(o)
                decode(data, o, out, xxhash.xxh3_128())
                assert np.array_equal(out, nw), nm
            outs = {nm: np.empty_like(new[nm][1]) for nm in names}
            def t_ctx_enc():
                for nm in names:
                    if nm in enc: encode(old[nm][1].view(np.uint16), new[nm][1].view(np.uint16), K)
            def t_ctx_dec():
                for nm in names:
                    if nm in enc: decode(enc[nm], old[nm][1].view(np.uint16), outs[nm].view(np.uint16), xxhash.xxh3_128())
            cfg = CodecConfig(entropy_coder=False)
            senc = {nm: encode_tensor('BF16', new[nm][1], old[nm][1], cfg) for nm in names}
            acfg = CodecConfig()
            aenc = {nm: encode_tensor('BF16', new[nm][1], old[nm][1], acfg) for nm in names}
            def t_sp_enc():
                for nm in names: encode_tensor('BF16', new[nm][1], old[nm][1], cfg)
            def t_sp_dec():
                for nm in names: decode_tensor('BF16', senc[nm].codec, senc[nm].payload, old[nm][1], new[nm][1].size, out=outs[nm], hasher=xxhash.xxh3_128())
            def t_memcpy():
                for nm in names: np.copyto(outs[nm], new[nm][1])
            def best(f, r=3):
                ts = []
                for _ in range(r):
                    t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
                return raw / min(ts) / 1e9
            mc = best(t_memcpy, 5)
            res = {k: best(f) for k, f in (('ctx enc', t_ctx_enc), ('ctx dec', t_ctx_dec), ('sparse enc', t_sp_enc), ('sparse dec', t_sp_dec))}
            asz = sum(len(e.payload) for e in aenc.values()); ssz = sum(len(e.payload) for e in senc.values())
            print(f"lr {lr:g} {a.name[-2:]}->{b.name[-2:]}: ctx/bound {size / bound:.3f} ac/bound {asz / bound:.3f} sparse/bound {ssz / bound:.3f} | memcpy {mc:.2f} GB/s | "
                  + " ".join(f"{k} {v / mc:.3f}" for k, v in res.items()), flush=True)

if __name__ == '__main__':
    main(npairs=int(sys.argv[1]) if len(sys.argv) > 1 else 5, K=int(sys.argv[2]) if len(sys.argv) > 2 else 8)
