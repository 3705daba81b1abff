import sys, time
sys.path[:0]=['/work/wt/codec','/work/wt/codec/benchmarks','/work/wt/codec/research/issue18-ctx-codec']
import numpy as np, numba, common
import bucket as B
lr=float(sys.argv[1])
dirs = common.cache_dirs(f"moe-lr{lr:g}", lr=lr, steps=6)
old, new = common.load_checkpoint(dirs[1]), common.load_checkpoint(dirs[2])
nm='lm_head.weight'
o=old[nm][1].view(np.uint16); n=new[nm][1].view(np.uint16)
def best(f,r=5):
    ts=[]
    for _ in range(r):
        t=time.thread_time(); f(); ts.append(time.thread_time()-t)
    return min(ts)
data,k=B.encode_block('BF16',o,n)
blk=np.frombuffer(data,np.uint8)
N=o.size
tp=best(lambda: B._parse(blk,N,16))
# rANS alone: re-encode the symbols of one big stream
syms=np.minimum(B.zigzag_codes(o,n) if hasattr(B,'zigzag_codes') else np.ones(k,np.int64),15)
d=(n.astype(np.int64)-o.astype(np.int64)); d=d[d!=0]; d=np.where(d>32767,d-65536,d); d=np.where(d< -32768,d+65536,d)
zz=np.where(d>=0,2*d,-2*d-1); syms=np.minimum(zz-1,15).astype(np.int64)
cnt=np.bincount(syms,minlength=16); freq=np.zeros(16,np.int64); B._normalise(cnt,freq)
buf=np.zeros(4*k+64,np.uint8); L=B._rans_encode(syms,freq,buf)
te=best(lambda: B._rans_encode(syms,freq,buf))
out=np.empty(k,np.uint64)
td=best(lambda: B._rans_decode(buf[:L],freq,out,k))
tenc=best(lambda: B._encode(o,n,7,8,3,8,16))
th=best(lambda: B._histogram(o,n,7,255))
print(f"lr {lr:g} k={k}: per change ns: parse {tp/k*1e9:.1f} rans dec {td/k*1e9:.1f} rans enc {te/k*1e9:.1f}; encode total {tenc/N*1e9:.3f} ns/elem = {tenc/k*1e9:.1f} ns/change, histogram {th/N*1e9:.3f} ns/elem")
