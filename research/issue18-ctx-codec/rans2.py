import sys, time
sys.path[:0]=['/work/wt/codec','/work/wt/codec/research/issue18-ctx-codec']
import numpy as np, numba
import bucket as B
from weightsync.codec.jit import njit
NS=16; PB=12; L=1<<23
@numba.njit(nogil=True)
def enc_n(syms, freq, out, W):
    start = np.zeros(NS + 1, np.int64)
    for i in range(NS): start[i + 1] = start[i] + freq[i]
    tmp = np.empty(syms.size * 2 + 64, np.uint8); t = tmp.size
    x = np.full(W, L, np.int64)
    for j in range(syms.size - 1, -1, -1):
        l = j % W
        s = syms[j]; f = freq[s]; xm = ((L >> PB) << 8) * f; xx = x[l]
        while xx >= xm:
            t -= 1; tmp[t] = xx & 0xFF; xx >>= 8
        x[l] = ((xx // f) << PB) + (xx % f) + start[s]
    p = 0
    for l in range(W):
        for b in range(4):
            out[p] = (x[l] >> (8 * b)) & 0xFF; p += 1
    m = tmp.size - t; out[p:p + m] = tmp[t:]
    return p + m
@numba.njit(nogil=True)
def dec2(data, freq, zz, count):
    start = np.zeros(NS + 1, np.int64)
    for i in range(NS): start[i + 1] = start[i] + freq[i]
    lut = np.empty(1 << PB, np.uint8)
    for i in range(NS): lut[start[i]:start[i + 1]] = i
    x0 = np.int64(data[0]) | np.int64(data[1]) << 8 | np.int64(data[2]) << 16 | np.int64(data[3]) << 24
    x1 = np.int64(data[4]) | np.int64(data[5]) << 8 | np.int64(data[6]) << 16 | np.int64(data[7]) << 24
    pos = 8; mask = (1 << PB) - 1
    for j in range(0, count - 1, 2):
        s0 = lut[x0 & mask]; s1 = lut[x1 & mask]
        x0 = freq[s0] * (x0 >> PB) + (x0 & mask) - start[s0]
        x1 = freq[s1] * (x1 >> PB) + (x1 & mask) - start[s1]
        zz[j] = s0 + 1; zz[j + 1] = s1 + 1
        if x0 < L:
            x0 = (x0 << 8) | data[pos]; pos += 1
            if x0 < L:
                x0 = (x0 << 8) | data[pos]; pos += 1
        if x1 < L:
            x1 = (x1 << 8) | data[pos]; pos += 1
            if x1 < L:
                x1 = (x1 << 8) | data[pos]; pos += 1
    return pos
rng=np.random.default_rng(0)
k=500000
syms=np.minimum(rng.geometric(0.6,k)-1,15).astype(np.int64)
cnt=np.bincount(syms,minlength=16); freq=np.zeros(16,np.int64); B._normalise(cnt,freq)
buf=np.zeros(4*k,np.uint8)
def best(f,r=5):
    ts=[]
    for _ in range(r):
        t=time.thread_time(); f(); ts.append(time.thread_time()-t)
    return min(ts)
L1=B._rans_encode(syms,freq,buf); out=np.empty(k,np.uint64)
print('1 state dec', best(lambda: B._rans_decode(buf[:L1],freq,out,k))/k*1e9, 'ns/sym')
buf2=np.zeros(4*k,np.uint8); L2=enc_n(syms,freq,buf2,2); out2=np.empty(k,np.uint64)
dec2(buf2[:L2],freq,out2,k)
print('2 states dec', best(lambda: dec2(buf2[:L2],freq,out2,k))/k*1e9, 'ns/sym', np.array_equal(out2[:k-1], (syms+1)[:k-1]))
