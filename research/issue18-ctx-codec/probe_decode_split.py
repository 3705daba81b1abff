"""lr 1e-5 pair N's decode split: Rice sections, rANS sections, the whole parse, the whole decode
(thread CPU, fastest of 9), then the Rice decode with each word's bits kept in a register
(probe_rice_register.py) against the package's: python probe_decode_split.py 0"""
import sys, time, os, glob
HERE = __import__("pathlib").Path(__file__).resolve().parent
CACHE = HERE.parents[1] / "benchmarks" / ".cache"
sys.path.insert(0, str(HERE.parents[1] / "benchmarks"))
sys.path.insert(0, str(HERE.parents[1]))
import numpy as np
from pathlib import Path
from common import load_checkpoint
from weightsync.codec import ans, entropy
from weightsync.codec.entropy import NSYM

def varint(d, p):
    v = s = 0
    while True:
        b = d[p]; p += 1; v |= (b & 127) << s; s += 7
        if b < 128: return v, p

def sections(d, n):
    K, L, G = d[4] & 7, d[4] >> 7, d[7]
    p = 8 + K - 1 + G - 1
    e, p = varint(d, p)
    if e and L:
        p += 1; x, p = varint(d, p); p += x
    elif e:
        for _ in range(e): _, p = varint(d, p)
        p += e
    rice = []
    for _ in range(K):
        nb, p = varint(d, p); cb, p = varint(d, p)
        if cb:
            k, inv = d[p] >> 1, d[p] & 1
            r, p = varint(d, p + 1)
            rice.append([nb, cb, k, inv, r])
    groups = []
    for _ in range(G):
        m, p = varint(d, p)
        if m:
            s = d[p] & 31; p += 1
            f = np.zeros(NSYM, np.int64)
            for q in range(s): f[q], p = varint(d, p)
            e_g, p = varint(d, p); a_g, p = varint(d, p)
            groups.append([m, f, e_g, a_g])
    rs = []
    for nb, cb, k, inv, r in rice:
        rs.append((p, r, nb - cb if inv else cb, k, nb, inv)); p += r
    gs = []
    for m, f, e_g, a_g in groups:
        p += e_g; gs.append((p, a_g, f, m)); p += a_g
    assert p == len(d)
    return rs, gs

d = sorted(glob.glob(f"{CACHE}/moe-lr1e-05-*"))[0]
steps = sorted(os.listdir(d))
pi = int(sys.argv[1]) if len(sys.argv) > 1 else 0
a, b = load_checkpoint(Path(d)/steps[pi]), load_checkpoint(Path(d)/steps[pi+1])
pairs = [(a[k][1].view(np.uint16), b[k][1].view(np.uint16)) for k in a if a[k][0] == "BF16"]
blocks = [(o, n, np.frombuffer(ans.encode_block("BF16", o, n)[0], np.uint8)) for o, n in pairs]
blocks = [x for x in blocks if x[2].size]
secs = [sections(bytes(x[2]), x[0].size) for x in blocks]
words = np.zeros(1 << 24, np.uint64)
diffs = np.zeros(1 << 24, np.uint16)
values = np.zeros(NSYM, np.uint16)
for sym in range(NSYM - 1):
    z = sym + 1; values[sym] = (z >> 1) ^ (-(z & 1) & 0xFFFF)
ngaps = sum(r[2] for rs, gs in secs for r in rs); nsym = sum(g[3] for rs, gs in secs for g in gs)
def rice():
    for (o, n, data), (rs, gs) in zip(blocks, secs):
        for p, bl, cnt, k, nb, inv in rs:
            assert entropy.rice_decode(data, p, bl, cnt, k, nb, inv, words, 0) == 0
def rans():
    for (o, n, data), (rs, gs) in zip(blocks, secs):
        for p, al, f, m in gs:
            assert entropy.rans_decode(data, p, al, f, values, diffs, 0, m) == 0
sc = ans._DSCRATCH
def parse():
    for o, n, data in blocks:
        arrays = sc.arrays(o.dtype)
        while True:
            status, K, G = ans._prepare(data, o.size, 16, 7, sc.hdr, *arrays, sc.st)
            if status != -1: break
            arrays = sc.grow(o.dtype, sc.hdr, arrays)
outs = [np.empty_like(o) for o, _, _ in blocks]
def whole():
    for (o, n, data), out in zip(blocks, outs):
        ans.decode_block("BF16", memoryview(data), o, out, "t")
def T(f):
    f(); best = 1e9
    for _ in range(9):
        t = time.thread_time(); f(); best = min(best, time.thread_time() - t)
    return best * 1e3
r = {k: round(T(f), 2) for k, f in (("rice", rice), ("rans", rans), ("parse", parse), ("decode", whole))}
print("pair", pi, "gaps", ngaps, "symbols", nsym, r, "ns/gap %.2f ns/sym %.2f" % (r["rice"] * 1e6 / ngaps, r["rans"] * 1e6 / nsym))
sys.path.insert(0, str(HERE))
from probe_rice_register import rice_decode2
w2 = np.zeros_like(words)
def rice2():
    for (o, n, data), (rs, gs) in zip(blocks, secs):
        for p, bl, cnt, k, nb, inv in rs:
            assert rice_decode2(data, p, bl, cnt, k, nb, inv, w2, 0) == 0
# correctness
for (o, n, data), (rs, gs) in zip(blocks, secs):
    for p, bl, cnt, k, nb, inv in rs:
        m = (nb + 63) // 64 + 2
        words[:m] = 0; w2[:m] = 0
        entropy.rice_decode(data, p, bl, cnt, k, nb, inv, words, 0); rice_decode2(data, p, bl, cnt, k, nb, inv, w2, 0)
        assert (words[:m] == w2[:m]).all(), (nb, cnt, inv)
for _ in range(2):
    print("rice", round(T(rice), 2), "rice2", round(T(rice2), 2))
