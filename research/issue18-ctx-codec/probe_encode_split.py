"""lr 1e-5 pair 0's encode, three parts alone: the gaps from the bitmaps, the Rice sections, the rANS
sections (thread CPU, fastest of 9): python probe_encode_split.py"""
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
d = sorted(glob.glob(f"{CACHE}/moe-lr1e-05-*"))[0]
steps = sorted(os.listdir(d))
a, b = load_checkpoint(Path(d)/steps[0]), load_checkpoint(Path(d)/steps[1])
pairs = [(a[k][1].view(np.uint16), b[k][1].view(np.uint16)) for k in a if a[k][0] == "BF16"]
buckets, groups = [], []
for o, n in pairs:
    blk = ans.encode_block("BF16", o, n)[0]
    if not len(blk): continue
    p = ans.Parsed("BF16", memoryview(blk), o.size, o.dtype, "t")
    for bb in range(p.K):
        nb = int(p.nb[bb]); w = p.words[p.wbase[bb]: p.wbase[bb] + (nb + 63)//64 + 2].copy()
        tail = nb & 63
        if tail: w[nb >> 6] &= np.uint64((1 << tail) - 1)
        w[(nb + 63)//64:] = 0
        c = int(sum(bin(int(x)).count("1") for x in w))
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
    cnt = np.bincount(s, minlength=NSYM).astype(np.int64); f = np.zeros(NSYM, np.int64); entropy.normalise(cnt, f); freqs.append(f)
symp = [np.concatenate([s, np.zeros(8, np.uint8)]) for s in syms]
def gaps():
    for w, nb, c, inv in buckets: ans._gaps_of(w, nb, c, inv)
def rice():
    for g, k in gl: entropy.rice_section(g, k, out)
def rans():
    for s, f in zip(symp, freqs): entropy.rans_encode(s, s.size - 8, f, out)
def T(f):
    f(); best = 1e9
    for _ in range(9):
        t = time.thread_time(); f(); best = min(best, time.thread_time() - t)
    return best * 1e3
ng = sum(g.size for g, k in gl); ns = sum(s.size for s in syms)
r = {k: round(T(f), 2) for k, f in (("gaps", gaps), ("rice", rice), ("rans", rans))}
print("gaps", ng, "syms", ns, r, "ns/gap rice %.2f ns/sym %.2f" % (r["rice"]*1e6/ng, r["rans"]*1e6/ns))
