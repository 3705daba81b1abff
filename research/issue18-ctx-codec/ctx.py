"""Prototype codec: K exponent-interval buckets; per bucket rank gaps (or unchanged-rank gaps when most changed)
and zigzag values, canonical Huffman (<= 12 bits, LSB-first). One block = one tensor here."""
import numpy as np, numba
from proto import _tz, _pop, _pdep, huff_lengths, canonical, build_lut, MAXLEN, U0, U1
from vec import lt_mask64, ne_mask64

njit = numba.njit(nogil=True, cache=True)
NG, NV = 64, 32
SAMPLE = 16  # every 16th word for thresholds

@njit
def choose_thresholds(old, new, shift, fmask, K):
    n = old.size
    per = np.zeros(256, np.float64); chp = np.zeros(256, np.float64)
    for w in range(0, n // 64, SAMPLE):
        for j in range(w * 64, w * 64 + 64):
            e = (old[j] >> shift) & fmask
            per[e] += 1
            chp[e] += old[j] != new[j]
    ex = np.flatnonzero(per)
    m = ex.size
    thr = np.zeros(K - 1, np.int64)
    if m <= 1:
        return thr, 1
    cp = np.zeros(m + 1); cc = np.zeros(m + 1)
    for i in range(m):
        cp[i + 1] = cp[i] + per[ex[i]]; cc[i + 1] = cc[i] + chp[ex[i]]
    g = min(K, m)
    dp = np.full((g + 1, m + 1), 1e300); arg = np.zeros((g + 1, m + 1), np.int64); dp[0, 0] = 0.0
    for q in range(1, g + 1):
        for b in range(q, m + 1):
            for a in range(q - 1, b):
                nn = cp[b] - cp[a]; kk = cc[b] - cc[a]
                c = nn * np.log2(nn)
                if kk > 0: c -= kk * np.log2(kk)
                if nn - kk > 0: c -= (nn - kk) * np.log2(nn - kk)
                v = dp[q - 1, a] + c
                if v < dp[q, b]:
                    dp[q, b] = v; arg[q, b] = a
    b = m
    cuts = np.zeros(g + 1, np.int64); cuts[g] = m
    for q in range(g, 0, -1):
        b = arg[q, b]; cuts[q - 1] = b
    for t in range(g - 1):
        thr[t] = ex[cuts[t + 1]]
    return thr, g

@njit
def scan(old, new, lim, K, bucket, rank, zz):
    n = old.size
    masks = np.zeros(K, np.uint64); cnt = np.zeros(K, np.int64)
    shift = np.uint64(64 - 8 * old.itemsize)
    am = lim[K - 1]
    k = 0
    nw = n // 64
    for w in range(nw + (n % 64 != 0)):
        base = w * 64
        if w < nw:
            c = ne_mask64(old, new, base)
            prev = U0
            for t in range(K - 1):
                m = lt_mask64(old, base, am, lim[t])
                masks[t] = m & ~prev
                prev = m
            masks[K - 1] = ~prev
        else:
            ce = n - base
            c = U0
            for j in range(ce):
                c |= np.uint64(old[base + j] != new[base + j]) << np.uint64(j)
            prev = U0
            for t in range(K - 1):
                m = U0
                for j in range(ce):
                    m |= np.uint64((old[base + j] & am) < lim[t]) << np.uint64(j)
                masks[t] = m & ~prev
                prev = m
            masks[K - 1] = ((U1 << np.uint64(ce)) - U1) & ~prev
        if c != U0:
            for b in range(K):
                M = masks[b]
                cm = c & M
                while cm != U0:
                    j = _tz(cm)
                    i = base + np.int64(j)
                    bucket[k] = b
                    rank[k] = cnt[b] + np.int64(_pop(M & ((U1 << j) - U1)))
                    s = np.int64(np.uint64(new[i] - old[i]) << shift) >> np.int64(shift)
                    zz[k] = np.uint64((s << 1) ^ (s >> 63))
                    k += 1
                    cm &= cm - U1
        for b in range(K):
            cnt[b] += np.int64(_pop(masks[b]))
    return k, cnt

@njit
def gsym(g):
    if g < 4:
        return g, 0
    t = g; b = 0
    while t > 1:
        t >>= 1; b += 1
    return 2 * b + ((g >> (b - 1)) & 1), b - 1

@njit
def gbase(s):
    if s < 4:
        return s, 0
    b = s >> 1
    return (2 + (s & 1)) << (b - 1), b - 1

@njit
def put(out, st, bits, nb):
    # st: acc, nbits, pos (int64 / uint64 in int64 slots)
    st[0] |= bits << st[1]
    st[1] += nb
    while st[1] >= 8:
        out[st[2]] = st[0] & 0xFF; st[2] += 1; st[0] = np.int64(np.uint64(st[0]) >> np.uint64(8)); st[1] -= 8

@njit
def flushb(out, st):
    if st[1] > 0:
        out[st[2]] = st[0] & 0xFF; st[2] += 1
    st[0] = 0; st[1] = 0

@njit
def encode_core(old, new, shift, fmask, K, width_bits):
    """-> bytes array."""
    n = old.size
    thr, K = choose_thresholds(old, new, shift, fmask, K)
    lim = np.zeros(K, old.dtype)
    for t in range(K - 1):
        lim[t] = thr[t] << shift
    lim[K - 1] = (fmask << shift) | ((1 << shift) - 1)
    bucket = np.empty(n + 1, np.uint8); rank = np.empty(n + 1, np.int64); zz = np.empty(n + 1, np.uint64)
    k, cnt = scan(old, new, lim, K, bucket, rank, zz)
    # counting sort by bucket
    cb = np.zeros(K + 1, np.int64)
    for i in range(k): cb[bucket[i] + 1] += 1
    for b in range(K): cb[b + 1] += cb[b]
    fill = cb[:K].copy()
    r2 = np.empty(k, np.int64); z2 = np.empty(k, np.uint64)
    for i in range(k):
        b = bucket[i]; p = fill[b]; r2[p] = rank[i]; z2[p] = zz[i]; fill[b] = p + 1
    out = np.zeros(64 + K * 80 + 2 * k * 8 + n // 4 + 1024, np.uint8)
    st = np.zeros(3, np.int64)
    # header: k(4) K(1) shift(1) bits(1) 0 ; thresholds K-1 bytes
    put(out, st, k, 32); put(out, st, K, 8); put(out, st, shift, 8); put(out, st, 0, 16)
    for t in range(K - 1): put(out, st, thr[t], 8)
    gl = np.zeros(NG, np.int64); vl = np.zeros(NV, np.int64); gc = np.zeros(NG, np.int64); vc = np.zeros(NV, np.int64)
    for b in range(K):
        a, e = cb[b], cb[b + 1]
        nch = e - a; nb = cnt[b]
        inv = 2 * nch > nb
        put(out, st, nch, 32)
        if nch == 0:
            continue
        put(out, st, 1 if inv else 0, 8)
        ncoded = nb - nch if inv else nch
        # gap symbols
        gh = np.zeros(NG, np.int64)
        if inv:
            # unchanged ranks: complement
            prevr = -1; q = a
            gaps = np.empty(ncoded, np.int64); gi = 0
            for r in range(nb):
                if q < e and r2[q] == r:
                    q += 1
                else:
                    gaps[gi] = r - prevr - 1; prevr = r; gi += 1
        else:
            gaps = np.empty(ncoded, np.int64)
            prevr = -1
            for q in range(a, e):
                gaps[q - a] = r2[q] - prevr - 1; prevr = r2[q]
        for g in gaps:
            s, _ = gsym(g); gh[s] += 1
        vh = np.zeros(NV, np.int64)
        for q in range(a, e):
            vh[min(z2[q] - 1, 31)] += 1
        huff_lengths(gh, gl, MAXLEN); huff_lengths(vh, vl, MAXLEN)
        canonical(gl, gc); canonical(vl, vc)
        ngs = 0
        for s in range(NG):
            if gl[s]: ngs = s + 1
        nvs = 0
        for s in range(NV):
            if vl[s]: nvs = s + 1
        put(out, st, ncoded, 32); put(out, st, ngs, 8); put(out, st, nvs, 8)
        for s in range(ngs): put(out, st, gl[s], 4)
        for s in range(nvs): put(out, st, vl[s], 4)
        for g in gaps:
            s, x = gsym(g)
            put(out, st, gc[s], gl[s])
            if x: put(out, st, g & ((1 << x) - 1), x)
        for q in range(a, e):
            z = z2[q] - 1
            if z < 31:
                put(out, st, vc[z], vl[z])
            else:
                put(out, st, vc[31], vl[31])
                put(out, st, np.int64(z >> np.uint64(16)), width_bits - 16 if width_bits > 16 else 0)
                put(out, st, np.int64(z & np.uint64(0xFFFF)), 16)
    flushb(out, st)
    return out[:st[2]].copy(), k

@njit
def refill(data, rs):
    # rs: acc(uint64 as int64 bits), nbits, pos
    acc = np.uint64(rs[0]); nb = rs[1]; pos = rs[2]
    while nb <= 56:
        b = np.uint64(data[pos]) if pos < data.size else U0
        acc |= b << np.uint64(nb)
        nb += 8; pos += 1
    rs[0] = np.int64(acc); rs[1] = nb; rs[2] = pos

@njit
def getb(data, rs, nb):
    if nb == 0:
        return 0
    if rs[1] < nb:
        refill(data, rs)
    acc = np.uint64(rs[0])
    v = np.int64(acc & ((U1 << np.uint64(nb)) - U1))
    rs[0] = np.int64(acc >> np.uint64(nb)); rs[1] -= nb
    return v

@njit
def decode_streams(data, n, width_bits):
    """Phase A. Returns K, lim-thresholds, per bucket: inv, nch, ncoded, offsets into ranks/zz; or raises."""
    rs = np.zeros(3, np.int64)
    k = getb(data, rs, 32); K = getb(data, rs, 8); shift = getb(data, rs, 8); getb(data, rs, 16)
    thr = np.zeros(max(K - 1, 0), np.int64)
    for t in range(K - 1): thr[t] = getb(data, rs, 8)
    inv = np.zeros(K, np.int64); nch = np.zeros(K, np.int64); ncod = np.zeros(K, np.int64)
    roff = np.zeros(K + 1, np.int64); zoff = np.zeros(K + 1, np.int64)
    ranks = np.empty(n + 1, np.int64); zz = np.empty(k + 1, np.uint64)
    gl = np.zeros(NG, np.int64); vl = np.zeros(NV, np.int64)
    glut = np.zeros(1 << MAXLEN, np.int32); vlut = np.zeros(1 << MAXLEN, np.int32)
    rp = 0; zp = 0
    mask12 = np.uint64((1 << MAXLEN) - 1)
    for b in range(K):
        roff[b] = rp; zoff[b] = zp
        c = getb(data, rs, 32); nch[b] = c
        if c == 0:
            continue
        inv[b] = getb(data, rs, 8)
        nc = getb(data, rs, 32); ncod[b] = nc
        ngs = getb(data, rs, 8); nvs = getb(data, rs, 8)
        gl[:] = 0; vl[:] = 0
        for s in range(ngs): gl[s] = getb(data, rs, 4)
        for s in range(nvs): vl[s] = getb(data, rs, 4)
        if nc > 0: build_lut(gl, glut)
        build_lut(vl, vlut)
        r = -1
        acc = np.uint64(rs[0]); nb = rs[1]; pos = rs[2]
        for i in range(nc):
            if nb < 48:
                while nb <= 56:
                    acc |= (np.uint64(data[pos]) if pos < data.size else U0) << np.uint64(nb)
                    nb += 8; pos += 1
            e = glut[acc & mask12]
            l = e & 15
            s = e >> 4
            acc >>= np.uint64(l); nb -= l
            g, x = gbase(s)
            if x:
                g += np.int64(acc & ((U1 << np.uint64(x)) - U1)); acc >>= np.uint64(x); nb -= x
            r += g + 1
            ranks[rp] = r; rp += 1
        for i in range(c):
            if nb < 48:
                while nb <= 56:
                    acc |= (np.uint64(data[pos]) if pos < data.size else U0) << np.uint64(nb)
                    nb += 8; pos += 1
            e = vlut[acc & mask12]
            l = e & 15
            s = e >> 4
            acc >>= np.uint64(l); nb -= l
            if s < 31:
                zz[zp] = np.uint64(s + 1)
            else:
                rs[0] = np.int64(acc); rs[1] = nb; rs[2] = pos
                hi = getb(data, rs, width_bits - 16 if width_bits > 16 else 0)
                lo = getb(data, rs, 16)
                acc = np.uint64(rs[0]); nb = rs[1]; pos = rs[2]
                zz[zp] = np.uint64((hi << 16) | lo) + U1
            zp += 1
        rs[0] = np.int64(acc); rs[1] = nb; rs[2] = pos
    roff[K] = rp; zoff[K] = zp
    return K, shift, thr, inv, nch, ncod, roff, zoff, ranks, zz

@njit
def apply_slice(old, out, a, e, lim, K, inv, nch, ncod, roff, zoff, ranks, zz, cnt, ri, zi, copy):
    """Phase B over elements [a, e) (a multiple of 64): copy, compute masks, patch."""
    if copy:
        for i in range(np.uint64(a), np.uint64(e)):
            out[i] = old[i]
    shift = np.uint64(64 - 8 * old.itemsize)
    am = lim[K - 1]
    masks = np.zeros(K, np.uint64)
    nwf = old.size // 64
    for w in range(a // 64, (e + 63) // 64):
        base = w * 64
        if w < nwf:
            prev = U0
            for t in range(K - 1):
                m = lt_mask64(old, base, am, lim[t])
                masks[t] = m & ~prev
                prev = m
            masks[K - 1] = ~prev
        else:
            ce = old.size - base
            prev = U0
            for t in range(K - 1):
                m = U0
                for j in range(ce):
                    m |= np.uint64((old[base + j] & am) < lim[t]) << np.uint64(j)
                masks[t] = m & ~prev
                prev = m
            masks[K - 1] = ((U1 << np.uint64(ce)) - U1) & ~prev
        for b in range(K):
            M = masks[b]
            p = np.int64(_pop(M))
            hi = cnt[b] + p
            q = ri[b]
            qe = roff[b + 1]
            if inv[b]:
                U = U0
                while q < qe and ranks[q] < hi:
                    U |= U1 << np.uint64(ranks[q] - cnt[b]); q += 1
                R = ~U & ((U1 << np.uint64(p)) - U1) if p < 64 else ~U
            else:
                if q >= qe or ranks[q] >= hi:
                    cnt[b] = hi
                    continue
                R = U0
                while q < qe and ranks[q] < hi:
                    R |= U1 << np.uint64(ranks[q] - cnt[b]); q += 1
            ri[b] = q
            cnt[b] = hi
            C = _pdep(R, M)
            z = zi[b]
            while C != U0:
                j = np.int64(_tz(C))
                code = zz[z]; z += 1
                old_v = out[base + j]
                out[base + j] = old_v + ((code >> U1) ^ (U0 - (code & U1)))
                C &= C - U1
            zi[b] = z
