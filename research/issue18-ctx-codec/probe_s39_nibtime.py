"""Prototype timing, lr 1e-5 pair 0: dense buckets' positions by Rice (as now) vs nibble rANS.
(Session 39; reads blocks in the layout before nibbles and carried bytes: run it with cced093's tree
on PYTHONPATH, e.g. a git worktree.)"""
import sys, os, glob, time
from pathlib import Path
ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]; sys.path.insert(0, str(ROOT / "benchmarks")); sys.path.insert(0, str(ROOT))
import numpy as np, numba
from common import load_checkpoint
from weightsync.codec import ans, entropy, lanes
d = sorted(glob.glob(f"{ROOT}/benchmarks/.cache/moe-lr1e-05-*"))[0]
steps = sorted(os.listdir(d)); pi = int(sys.argv[1]) if len(sys.argv) > 1 else 0
THR = float(sys.argv[2]) if len(sys.argv) > 2 else 1/16
POP = np.array([bin(i).count("1") for i in range(16)])
def table(c, n):
    q = min(4095, max(1, (c * 4096 + n // 2) // n))
    f = np.array([max(1, (q ** int(POP[t]) * (4096 - q) ** (4 - int(POP[t]))) >> 36) for t in range(16)], np.int64)
    big = 0 if q <= 2048 else 15
    f[big] = 0; f[big] = 4096 - f.sum()
    return f
@numba.njit(nogil=True)
def unpack(w, nb, out):
    by = w.view(np.uint8)
    m = (nb + 3) // 4
    for i in range((m + 1) // 2):
        b = by[i]
        out[2 * i] = b & 15
        out[2 * i + 1] = b >> 4
    return m
@numba.njit(nogil=True)
def pack(nib, m, words, w0):
    x = nib.view(np.uint64)
    for i in range((m + 15) // 16):
        a = x[2 * i]; b = x[2 * i + 1]
        a = (a | (a >> np.uint64(4))) & np.uint64(0x00FF00FF00FF00FF)
        a = (a | (a >> np.uint64(8))) & np.uint64(0x0000FFFF0000FFFF)
        a = (a | (a >> np.uint64(16))) & np.uint64(0xFFFFFFFF)
        b = (b | (b >> np.uint64(4))) & np.uint64(0x00FF00FF00FF00FF)
        b = (b | (b >> np.uint64(8))) & np.uint64(0x0000FFFF0000FFFF)
        b = (b | (b >> np.uint64(16))) & np.uint64(0xFFFFFFFF)
        words[w0 + i] = a | (b << np.uint64(32))
a, b = load_checkpoint(Path(d)/steps[pi]), load_checkpoint(Path(d)/steps[pi+1])
bk = []
for name in a:
    if a[name][0] != "BF16": continue
    o, n = a[name][1].view("<u2"), b[name][1].view("<u2")
    data, ch = ans.encode_block("BF16", o, n)
    if not ch: continue
    p = ans.Parsed("BF16", memoryview(data), o.size, o.dtype, "t")
    for bb in range(p.K):
        nb = int(p.nb[bb])
        if not nb: continue
        w = p.words[p.wbase[bb]: p.wbase[bb] + (nb + 63)//64 + 2].copy()
        if nb & 63: w[nb >> 6] &= np.uint64((1 << (nb & 63)) - 1)
        w[(nb + 63)//64:] = 0
        c = int(np.unpackbits(w.view(np.uint8)).sum())
        if not c or c < THR * nb: continue
        inv = 2 * c > nb
        g, k = ans._gaps_of(w, nb, c, inv)
        rb = np.empty(1 << 22, np.uint8); rl = entropy.rice_section(g, k, rb)
        bk.append(dict(w=w, nb=nb, c=c, inv=inv, k=k, rice=rb[:rl].copy(), f=table(c, nb)))
out = np.empty(1 << 24, np.uint8)
nib = np.zeros((1 << 22) + 64, np.uint8)
vals = np.arange(16, dtype=np.uint8)
for x in bk:
    m = unpack(x["w"], x["nb"], nib); x["m"] = m
    nib[m:m + 64] = 0
    L = lanes.rans_encode_wide(nib, m, x["f"], out, True) if m >= lanes.WIDE_MIN else entropy.rans_encode(nib, m, x["f"], out)
    x["nibsec"] = out[:L].copy()
words = np.zeros(1 << 22, np.uint64)
def enc_rice():
    for x in bk:
        g, k = ans._gaps_of(x["w"], x["nb"], x["c"], x["inv"]); entropy.rice_section(g, k, out)
def enc_nib():
    for x in bk:
        m = unpack(x["w"], x["nb"], nib)
        lanes.rans_encode_wide(nib, m, x["f"], out, True) if m >= lanes.WIDE_MIN else entropy.rans_encode(nib, m, x["f"], out)
def dec_rice():
    for x in bk:
        s = x["rice"]; ng = x["nb"] - x["c"] if x["inv"] else x["c"]
        words[: (x["nb"] + 63) // 64 + 2] = 0
        assert entropy.rice_decode(s, 0, s.size, ng, x["k"], x["nb"], x["inv"], words, 0) == 0
def dec_nib():
    for x in bk:
        s = x["nibsec"]; m = x["m"]
        if m >= lanes.WIDE_MIN: r = lanes.rans_decode_wide(s, 0, s.size, x["f"], vals, nib, 0, m, True)
        else: r = entropy.rans_decode(s, 0, s.size, x["f"], vals, nib, 0, m)
        assert r == 0
        nib[m: m + 32] = 0
        pack(nib, m, words, 0)
dec_nib()
assert all(True for x in bk)
def T(f, r=9):
    f(); best = 1e9
    for _ in range(r):
        t = time.thread_time(); f(); best = min(best, time.thread_time() - t)
    return best * 1e3
ng = sum(min(x["c"], x["nb"] - x["c"]) for x in bk); ns = sum(x["m"] for x in bk)
print("buckets", len(bk), "gaps", ng, "nibbles", ns, "wide nibbles", sum(x["m"] for x in bk if x["m"] >= lanes.WIDE_MIN))
print("bytes rice", sum(x["rice"].size for x in bk), "nib", sum(x["nibsec"].size for x in bk))
for r in range(2):
    print({k: round(T(f), 2) for k, f in (("enc_rice", enc_rice), ("enc_nib", enc_nib), ("dec_rice", dec_rice), ("dec_nib", dec_nib))})
