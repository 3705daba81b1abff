"""(Session 39, before nibbles: python probe_s39_large2.py) 2.03 GiB pair: the scan against a read-only floor; _encode's parts (gaps, rice, rans)."""
import sys, time
ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]; sys.path.insert(0, str(ROOT / "benchmarks")); sys.path.insert(0, str(ROOT))
import numpy as np, numba
import common, e2e
from weightsync.codec import ans, entropy
from weightsync.codec.entropy import NSYM
dirs = e2e.trajectory("full", 3)
a, b = common.load_checkpoint(dirs[1]), common.load_checkpoint(dirs[2])
pairs = [(a[k][1].view(np.uint16), b[k][1].view(np.uint16)) for k in a if a[k][0] == "BF16"]
pairs.sort(key=lambda p: -p[0].size)
@numba.njit(nogil=True, fastmath=True)
def rd(o, n):
    o64 = o.view(np.uint64); n64 = n.view(np.uint64); acc = np.uint64(0)
    for i in range(o64.size): acc |= o64[i] ^ n64[i]
    return acc
@numba.njit(nogil=True, fastmath=True)
def cnt(o, n):
    c = 0
    for i in range(o.size): c += o[i] != n[i]
    return c
def floor():
    for o, n in pairs: rd(o, n)
def count():
    for o, n in pairs: cnt(o, n)
buckets, groups, G4 = [], [], 0
for o, n in pairs:
    blk = ans.encode_block("BF16", o, n)[0]
    if not len(blk): continue
    p = ans.Parsed("BF16", memoryview(blk), o.size, o.dtype, "t")
    for bb in range(p.K):
        nb = int(p.nb[bb]); w = p.words[p.wbase[bb]: p.wbase[bb] + (nb + 63)//64 + 2].copy()
        tail = nb & 63
        if tail: w[nb >> 6] &= np.uint64((1 << tail) - 1)
        w[(nb + 63)//64:] = 0
        c = int(np.unpackbits(w.view(np.uint8)).sum())
        if c: buckets.append((w, nb, c, 2 * c > nb))
    for g in range(p.G):
        dd = p.diffs[p.dstart[g]:p.dstart[g+1]].astype(np.int16).astype(np.int64)
        z = ((dd << 1) ^ (dd >> 63)).astype(np.uint16)
        if z.size: groups.append(z)
gl = [ans._gaps_of(w, nb, c, inv) for w, nb, c, inv in buckets]
out = np.empty(1 << 26, np.uint8)
syms = [np.minimum(z.astype(np.int64) - 1, NSYM - 1).astype(np.uint8) for z in groups]
freqs = []
for s in syms:
    cnt_ = np.bincount(s, minlength=NSYM).astype(np.int64); f = np.zeros(NSYM, np.int64); entropy.normalise(cnt_, f); freqs.append(f)
symp = [np.concatenate([s, np.zeros(8, np.uint8)]) for s in syms]
sizes = np.array([s.size for s in syms])
print("groups", len(syms), "syms", sizes.sum(), "wide-eligible syms frac %.3f" % (sizes[sizes >= 1 << 15].sum() / sizes.sum()), "median group", int(np.median(sizes)))
def gaps():
    for w, nb, c, inv in buckets: ans._gaps_of(w, nb, c, inv)
def rice():
    for g, k in gl: entropy.rice_section(g, k, out)
def rans():
    for s, f in zip(symp, freqs): entropy.rans_encode(s, s.size - 8, f, out)
def T(f, r=5):
    f(); best = 1e9
    for _ in range(r):
        t = time.perf_counter(); f(); best = min(best, time.perf_counter() - t)
    return best * 1e3
ng = sum(g.size for g, k in gl); ns = sum(s.size for s in syms)
r = {k: round(T(f), 1) for k, f in (("floor", floor), ("count", count), ("gaps", gaps), ("rice", rice), ("rans", rans))}
print("gaps", ng, "syms", ns, r, "ns/gap rice %.2f ns/sym %.2f" % (r["rice"]*1e6/ng, r["rans"]*1e6/ns))
