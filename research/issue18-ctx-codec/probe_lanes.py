"""Probe: does a W-lane rANS decoder with a word stream per lane vectorise under numba here, and how fast is it?"""
import numpy as np, time
from numba import njit
L = 16
PB = 12
@njit(nogil=True)
def enc_lanes(syms, c, freq, cum, W):
    # each lane q codes symbols q, q+W, ...; its own word stream (reversed at the end)
    words = np.zeros((W, c // W + 8), np.uint16)
    nw = np.zeros(W, np.int64)
    xs = np.full(W, 1 << 16, np.uint64)
    for j in range(c - 1, -1, -1):
        q = j % W
        s = syms[j]
        f = freq[s]
        x = xs[q]
        if x >= (np.uint64(f) << np.uint64(32 - PB)):
            words[q, nw[q]] = x & 0xFFFF
            nw[q] += 1
            x >>= np.uint64(16)
        x = (x // np.uint64(f) << np.uint64(PB)) + x % np.uint64(f) + np.uint64(cum[s])
        xs[q] = x
    return xs, words, nw

@njit(nogil=True)
def dec_lanes2(tab, symtab, xs0, stream, starts, out, c, W):
    x = xs0.copy()
    p = starts.copy()
    for j in range(0, c, W):
        for q in range(W):
            xq = x[q]
            slot = xq & np.uint32(4095)
            e = tab[slot]
            out[j + q] = symtab[slot]
            xq = (e & np.uint32(0xFFFF)) * (xq >> np.uint32(PB)) + (e >> np.uint32(16))
            t = xq < np.uint32(1 << 16)
            w = np.uint32(stream[p[q]])
            xq = ((xq << np.uint32(16)) | w) if t else xq
            p[q] += np.int64(t)
            x[q] = xq
    return x, p

rng = np.random.default_rng(1)
p = np.array([0.41, 0.40, 0.04, 0.035, 0.02, 0.02, 0.01, 0.01, 0.006, 0.006, 0.004, 0.004, 0.003, 0.003, 0.002, 0.027]); p /= p.sum()
c = 1 << 22
syms = rng.choice(16, c, p=p).astype(np.uint8)
cnt = np.bincount(syms, minlength=16)
from weightsync.codec.entropy import normalise
freq = np.zeros(16, np.int64); normalise(cnt.astype(np.int64), freq)
cum = np.concatenate([[0], np.cumsum(freq)[:-1]])
tab = np.zeros(4096, np.uint32); symtab = np.zeros(4096, np.uint8)
for s in range(16):
    for k in range(freq[s]):
        tab[cum[s] + k] = freq[s] | (k << 16); symtab[cum[s] + k] = s
for W in (4, 8, 16, 32):
    xs, words, nw = enc_lanes(syms, c, freq, cum, W)
    # lane streams reversed, concatenated
    parts = [words[q, :nw[q]][::-1] for q in range(W)]
    starts = np.cumsum([0] + [len(x) for x in parts])[:-1].astype(np.int64)
    stream = np.concatenate(parts + [np.zeros(64, np.uint16)])
    out = np.empty(c, np.uint8)
    x, pp = dec_lanes2(tab, symtab, xs.astype(np.uint32), stream, starts, out, c, W)
    assert (out == syms).all() and (x == (1 << 16)).all()
    best = 1e9
    for _ in range(11):
        t0 = time.thread_time(); dec_lanes2(tab, symtab, xs.astype(np.uint32), stream, starts, out, c, W); best = min(best, time.thread_time() - t0)
    print(W, "lanes: %.3f ns/sym" % (best * 1e9 / c))
