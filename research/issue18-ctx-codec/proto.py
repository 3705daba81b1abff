"""Prototype: exponent-interval buckets, per-bucket rank gaps + zigzag values, canonical Huffman (LSB-first)."""
import numpy as np
import numba
from numba import types
from numba.extending import intrinsic
from llvmlite import ir
from numba.core import cgutils

MAXLEN = 12
NGAP = 64   # gap symbols
NVAL = 32   # zz symbols (31 = escape)

@intrinsic
def _tz(typingctx, x):
    def codegen(context, builder, signature, args):
        fnty = ir.FunctionType(ir.IntType(64), [ir.IntType(64), ir.IntType(1)])
        fn = builder.module.declare_intrinsic("llvm.cttz", [ir.IntType(64)], fnty)
        return builder.call(fn, [args[0], ir.Constant(ir.IntType(1), 0)])
    return types.uint64(types.uint64), codegen

@intrinsic
def _pop(typingctx, x):
    def codegen(context, builder, signature, args):
        fnty = ir.FunctionType(ir.IntType(64), [ir.IntType(64)])
        fn = builder.module.declare_intrinsic("llvm.ctpop", [ir.IntType(64)], fnty)
        return builder.call(fn, [args[0]])
    return types.uint64(types.uint64), codegen

@intrinsic
def _pdep(typingctx, x, m):
    def codegen(context, builder, signature, args):
        fnty = ir.FunctionType(ir.IntType(64), [ir.IntType(64), ir.IntType(64)])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.x86.bmi.pdep.64")
        return builder.call(fn, [args[0], args[1]])
    return types.uint64(types.uint64, types.uint64), codegen

njit = numba.njit(nogil=True, cache=True)

@njit
def gap_sym(g):
    if g < 4:
        return g, 0, 0
    b = 63 - np.int64(numba.uint64(0)) if False else 0
    t = g; b = 0
    while t > 1:
        t >>= 1; b += 1
    return 2 * b + ((g >> (b - 1)) & 1), b - 1, g & ((1 << (b - 1)) - 1)

@njit
def gap_base(s):
    # inverse: symbol -> (base, extra bits)
    if s < 4:
        return s, 0
    b = s >> 1
    return (2 + (s & 1)) << (b - 1), b - 1

@njit
def huff_lengths(counts, lengths, maxlen):
    """Huffman code lengths (length-limited by scaling counts) into lengths; n <= 64 symbols."""
    n = counts.size
    c = counts.copy()
    while True:
        for i in range(n):
            lengths[i] = 0
        m = 0
        w = np.zeros(2 * n, np.int64); parent = np.full(2 * n, -1, np.int64); alive = np.zeros(2 * n, np.bool_)
        for i in range(n):
            if c[i] > 0:
                w[i] = c[i]; alive[i] = True; m += 1
        if m == 0:
            return
        if m == 1:
            for i in range(n):
                if c[i] > 0:
                    lengths[i] = 1
            return
        nxt = n
        for _ in range(m - 1):
            a = -1; b = -1
            for i in range(nxt):
                if alive[i]:
                    if a < 0 or w[i] < w[a]:
                        b = a; a = i
                    elif b < 0 or w[i] < w[b]:
                        b = i
            alive[a] = False; alive[b] = False
            w[nxt] = w[a] + w[b]; alive[nxt] = True; parent[a] = nxt; parent[b] = nxt; nxt += 1
        mx = 0
        for i in range(n):
            if c[i] > 0:
                d = 0; j = i
                while parent[j] >= 0:
                    j = parent[j]; d += 1
                lengths[i] = d; mx = max(mx, d)
        if mx <= maxlen:
            return
        for i in range(n):
            if c[i] > 0:
                c[i] = (c[i] + 1) >> 1

@njit
def canonical(lengths, codes):
    """LSB-first (bit-reversed) canonical codes from lengths."""
    bl = np.zeros(MAXLEN + 1, np.int64)
    for l in lengths:
        if l:
            bl[l] += 1
    code = 0; nextc = np.zeros(MAXLEN + 2, np.int64)
    for b in range(1, MAXLEN + 1):
        code = (code + bl[b - 1]) << 1 if b > 1 else 0
        nextc[b] = code
    for s in range(lengths.size):
        l = lengths[s]
        if l:
            c = nextc[l]; nextc[l] += 1
            r = 0
            for i in range(l):
                r = (r << 1) | ((c >> i) & 1)
            codes[s] = r

@njit
def build_lut(lengths, lut):
    """lut[peek 12 bits] = sym << 4 | len; returns False if lengths are not a complete/valid prefix code."""
    codes = np.zeros(lengths.size, np.int64)
    # validate Kraft
    kraft = 0
    nz = 0
    for l in lengths:
        if l > MAXLEN:
            return False
        if l:
            kraft += 1 << (MAXLEN - l); nz += 1
    if nz == 0 or kraft > (1 << MAXLEN):
        return False
    canonical(lengths, codes)
    for i in range(lut.size):
        lut[i] = 0  # len 0: invalid
    for s in range(lengths.size):
        l = lengths[s]
        if l:
            step = 1 << l
            for i in range(codes[s], 1 << MAXLEN, step):
                lut[i] = (s << 4) | l
    return True

# --- bit writer: state in arrays (acc, nbits, pos)
@njit
def put(out, st, bits, n):
    acc = st[0] | (np.uint64(bits) << np.uint64(st[1])) if False else 0
    st[0] |= bits << st[1]
    st[1] += n
    if st[1] >= 32:
        p = st[2]
        v = st[0]
        out[p] = v & 0xFF; out[p + 1] = (v >> 8) & 0xFF; out[p + 2] = (v >> 16) & 0xFF; out[p + 3] = (v >> 24) & 0xFF
        st[2] = p + 4
        st[0] = v >> 32
        st[1] -= 32

@njit
def flush(out, st):
    while st[1] > 0:
        out[st[2]] = st[0] & 0xFF; st[2] += 1; st[0] >>= 8; st[1] -= 8
    st[1] = 0

U1 = np.uint64(1)
U0 = np.uint64(0)

@njit
def word_masks(old, base, cnt_elems, lim, K, masks):
    """masks[k]: elements j of the word (j < cnt_elems) whose (old & absmask) falls in bucket k.
    lim (old's dtype): lim[t] = T_t << shift for t < K-1, lim[K-1] = absmask."""
    am = lim[K - 1]
    prev = U0
    for t in range(K - 1):
        T = lim[t]
        m = U0
        if cnt_elems == 64:
            for j in range(64):
                m |= np.uint64((old[base + j] & am) < T) << np.uint64(j)
        else:
            for j in range(cnt_elems):
                m |= np.uint64((old[base + j] & am) < T) << np.uint64(j)
        masks[t] = m & ~prev
        prev = m
    full = ~U0 if cnt_elems == 64 else (U1 << np.uint64(cnt_elems)) - U1
    masks[K - 1] = full & ~prev

@njit
def _scan_changes(old, new, lim, K, bucket, rank, zz):
    """One pass: every changed element's bucket, rank within bucket, zigzag diff (as uint64). Returns (k, counts per bucket of elements)."""
    n = old.size
    masks = np.zeros(K, np.uint64)
    cnt = np.zeros(K, np.int64)
    width_bits = 8 * old.itemsize
    shift = np.uint64(64 - width_bits)
    k = 0
    for w in range((n + 63) // 64):
        base = w * 64
        ce = min(64, n - base)
        c = U0
        for j in range(ce):
            c |= np.uint64(old[base + j] != new[base + j]) << np.uint64(j)
        word_masks(old, base, ce, lim, K, masks)
        if c != U0:
            for b in range(K):
                cm = c & masks[b]
                M = masks[b]
                while cm != U0:
                    j = _tz(cm)
                    below = M & ((U1 << j) - U1)
                    i = base + np.int64(j)
                    bucket[k] = b
                    rank[k] = cnt[b] + np.int64(_pop(below))
                    s = np.int64(np.uint64(new[i] - old[i]) << shift) >> np.int64(shift)
                    zz[k] = np.uint64((s << 1) ^ (s >> 63))
                    k += 1
                    cm &= cm - U1
        for b in range(K):
            cnt[b] += np.int64(_pop(masks[b]))
    return k, cnt
