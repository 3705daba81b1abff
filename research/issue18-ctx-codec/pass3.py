"""Experiment: the decode pass specialised for 3 position buckets (state in locals, codes in position
order: one pointer), against memcpy on lm_head. python pass3.py LR (1e-06 or 1e-05)."""
import sys, time
sys.path[:0]=['/work/main','/work/main/benchmarks','/work/main/research/issue18-ctx-codec']
import numpy as np, numba, common
import bucket as B
from bucket import _below_mask64, _pop, _pdep_bmi2, _tz, ONE, ZERO, ALL
lr=float(sys.argv[1])
dirs = common.cache_dirs(f"moe-lr{lr:g}", lr=lr, steps=6)
old, new = common.load_checkpoint(dirs[1]), common.load_checkpoint(dirs[2])
nm='lm_head.weight'
o=old[nm][1].view(np.uint16); n=new[nm][1].view(np.uint16)
data,k=B.encode_block('BF16',o,n)
p=B.Parsed('BF16',memoryview(data),o.size,2,'x')
assert p.thr_p.size==2
# codes in position order (what a single-stream layout would give)
e=B._exponents(p,o); idx,codes=B._changes(p,p.lut_p[e],p.lut_v[e],'x')
def best(f,r=5):
    ts=[]
    for _ in range(r):
        t=time.thread_time(); f(); ts.append(time.thread_time()-t)
    return min(ts)
out=np.empty_like(o)
@numba.njit(nogil=True)
def pass3(out, src, a, e, l0, l1, words, o0, o1, o2, zz, zi):
    for i in range(np.uint64(a), np.uint64(e)):
        out[i] = src[i]
    absmask = np.uint16(0x7FFF)
    for base in range(a, e, 64):
        m0 = _below_mask64(out, base, absmask, l0)
        m1 = _below_mask64(out, base, absmask, l1)
        b1 = m1 & ~m0
        b2 = ~m1
        p0 = _pop(m0); p1 = _pop(b1); p2 = np.uint64(64) - p0 - p1
        s = np.uint64(o0 & 63); q = o0 >> 6
        v0 = (words[q] >> s) | ((words[q + 1] << ONE) << (np.uint64(63) - s))
        s = np.uint64(o1 & 63); q = o1 >> 6
        v1 = (words[q] >> s) | ((words[q + 1] << ONE) << (np.uint64(63) - s))
        s = np.uint64(o2 & 63); q = o2 >> 6
        v2 = (words[q] >> s) | ((words[q + 1] << ONE) << (np.uint64(63) - s))
        ch = _pdep_bmi2(v0, m0) | _pdep_bmi2(v1, b1) | _pdep_bmi2(v2, b2)
        o0 += np.int64(p0); o1 += np.int64(p1); o2 += np.int64(p2)
        while ch != ZERO:
            i = base + np.int64(_tz(ch))
            code = zz[zi]
            out[i] += (code >> ONE) ^ (ZERO - (code & ONE))
            zi += 1
            ch &= ch - ONE
    return o0, o1, o2, zi
l0=np.uint16(p.thr_p[0]<<7); l1=np.uint16(p.thr_p[1]<<7)
step=262144
def run():
    st=(p.wstart[0],p.wstart[1],p.wstart[2],0)
    for a in range(0,o.size,step):
        st=pass3(out,o,a,min(a+step,o.size),l0,l1,p.words,*st[:3],codes,st[3])
run()
print('equal', np.array_equal(out,n))
t=best(run); mc=best(lambda: np.copyto(out,o))
tp=best(lambda: B._parse(np.frombuffer(data,np.uint8),o.size,16))
import xxhash
th=best(lambda: xxhash.xxh3_128(o))
print(f"lr {lr:g}: ns/elem pass {t/o.size*1e9:.3f} parse {tp/o.size*1e9:.3f} hash {th/o.size*1e9:.3f} memcpy {mc/o.size*1e9:.3f} -> decode/memcpy {mc/(t+tp+th):.3f}")
