"""rANS with 4 states against two sections' 4 states in one loop (8 chains), encode and decode, on
symbols drawn from the trajectory's distribution: python probe_interleave.py"""
import numpy as np, time
from numba import njit
from weightsync.codec import entropy
from weightsync.codec.entropy import rans_steps, _rans_table, NSYM, PROB_ONE, PROB_BITS, RANS_L
from weightsync.codec.simd import ONE, ZERO
from weightsync.codec.entropy import mulhi
M16 = np.uint64(0xFFFF); W16 = np.uint64(16); W32 = np.uint64(32); TWO = np.uint64(2); THREE = np.uint64(3); FOUR = np.uint64(4)
U32 = np.uint32

@njit(nogil=True, inline="always")
def st(x, s, tab, tmp, t):
    fl = x >= tab[s]
    tmp[t - ONE] = np.uint16(x & M16)
    t -= np.uint64(fl)
    x = (x >> W16) if fl else x
    x += tab[s + TWO] + mulhi(x, tab[s + ONE]) * tab[s + THREE]
    return x, t

@njit(nogil=True)
def enc4(syms, c, tab, tmp):
    t = np.uint64(tmp.size); x0 = x1 = x2 = x3 = np.uint64(RANS_L)
    j = np.uint64(c)
    while j > ZERO:
        j -= FOUR
        x3, t = st(x3, np.uint64(syms[j + THREE]) << TWO, tab, tmp, t)
        x2, t = st(x2, np.uint64(syms[j + TWO]) << TWO, tab, tmp, t)
        x1, t = st(x1, np.uint64(syms[j + ONE]) << TWO, tab, tmp, t)
        x0, t = st(x0, np.uint64(syms[j]) << TWO, tab, tmp, t)
    return t + x0 + x1 + x2 + x3

@njit(nogil=True)
def enc8(sa, sb, c, ta, tb, tmpa, tmpb):
    t = np.uint64(tmpa.size); x0 = x1 = x2 = x3 = np.uint64(RANS_L)
    u = np.uint64(tmpb.size); y0 = y1 = y2 = y3 = np.uint64(RANS_L)
    j = np.uint64(c)
    while j > ZERO:
        j -= FOUR
        x3, t = st(x3, np.uint64(sa[j + THREE]) << TWO, ta, tmpa, t)
        y3, u = st(y3, np.uint64(sb[j + THREE]) << TWO, tb, tmpb, u)
        x2, t = st(x2, np.uint64(sa[j + TWO]) << TWO, ta, tmpa, t)
        y2, u = st(y2, np.uint64(sb[j + TWO]) << TWO, tb, tmpb, u)
        x1, t = st(x1, np.uint64(sa[j + ONE]) << TWO, ta, tmpa, t)
        y1, u = st(y1, np.uint64(sb[j + ONE]) << TWO, tb, tmpb, u)
        x0, t = st(x0, np.uint64(sa[j]) << TWO, ta, tmpa, t)
        y0, u = st(y0, np.uint64(sb[j]) << TWO, tb, tmpb, u)
    return t + u + x0 + x1 + x2 + x3 + y0 + y1 + y2 + y3

MASK = U32(PROB_ONE - 1); RL = U32(1 << 16)
@njit(nogil=True, inline="always")
def dt(x, tab, w16, wp, out, dj):
    en = tab[x & MASK]
    x = U32(en & M16) * (x >> U32(PROB_BITS)) + U32((en >> W16) & M16)
    t = U32(x < RL)
    x = (x << (t << U32(4))) | (U32(w16[wp]) & (U32(0) - t))
    wp += np.uint64(t)
    out[dj] = en >> W32
    return x, wp

@njit(nogil=True)
def dec4(tab, w16, out, c):
    x0 = x1 = x2 = x3 = U32(1 << 20); wp = ZERO
    for j in range(0, c, 4):
        dj = np.uint64(j)
        x0, wp = dt(x0, tab, w16, wp, out, dj)
        x1, wp = dt(x1, tab, w16, wp, out, dj + ONE)
        x2, wp = dt(x2, tab, w16, wp, out, dj + TWO)
        x3, wp = dt(x3, tab, w16, wp, out, dj + THREE)
    return x0 + x1 + x2 + x3 + wp

@njit(nogil=True)
def dec8(ta, wa, oa, tb, wb, ob, c):
    x0 = x1 = x2 = x3 = U32(1 << 20); wp = ZERO
    y0 = y1 = y2 = y3 = U32(1 << 20); wq = ZERO
    for j in range(0, c, 4):
        dj = np.uint64(j)
        x0, wp = dt(x0, ta, wa, wp, oa, dj)
        y0, wq = dt(y0, tb, wb, wq, ob, dj)
        x1, wp = dt(x1, ta, wa, wp, oa, dj + ONE)
        y1, wq = dt(y1, tb, wb, wq, ob, dj + ONE)
        x2, wp = dt(x2, ta, wa, wp, oa, dj + TWO)
        y2, wq = dt(y2, tb, wb, wq, ob, dj + TWO)
        x3, wp = dt(x3, ta, wa, wp, oa, dj + THREE)
        y3, wq = dt(y3, tb, wb, wq, ob, dj + THREE)
    return x0 + x1 + x2 + x3 + wp + y0 + y1 + y2 + y3 + wq

rng = np.random.default_rng(1)
# trajectory-like: ~80% +-1 (syms 0,1), 7% +-2 (2,3), rest
p = np.array([0.41, 0.40, 0.04, 0.035, 0.02, 0.02, 0.01, 0.01, 0.006, 0.006, 0.004, 0.004, 0.003, 0.003, 0.002, 0.027]); p /= p.sum()
c = 1 << 21
sa = rng.choice(16, c, p=p).astype(np.uint8); sb = rng.choice(16, c, p=p).astype(np.uint8)
cnt = np.bincount(sa, minlength=16).astype(np.int64); f = np.zeros(16, np.int64); entropy.normalise(cnt, f)
tab = rans_steps(f); tmpa = np.empty(c + 4, np.uint16); tmpb = np.empty(c + 4, np.uint16)
vals = np.arange(16, dtype=np.uint16); dtab = _rans_table(f, vals)
wa = rng.integers(0, 65535, c + 8, dtype=np.uint16); wb = rng.integers(0, 65535, c + 8, dtype=np.uint16)
oa = np.empty(c, np.uint16); ob = np.empty(c, np.uint16)
def T(fn):
    fn(); best = 1e9
    for _ in range(15):
        t = time.thread_time(); fn(); best = min(best, time.thread_time() - t)
    return best * 1e9 / (2 * c)
for _ in range(2):
    print("enc4 %.3f enc8 %.3f dec4 %.3f dec8 %.3f ns/sym" % (
        T(lambda: (enc4(sa, c, tab, tmpa), enc4(sb, c, tab, tmpb))), T(lambda: enc8(sa, sb, c, tab, tab, tmpa, tmpb)),
        T(lambda: (dec4(dtab, wa, oa, c), dec4(dtab, wb, ob, c))), T(lambda: dec8(dtab, wa, oa, dtab, wb, ob, c))))
