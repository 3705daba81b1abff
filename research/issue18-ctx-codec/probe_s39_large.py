"""(Session 39: python probe_s39_large.py) 2.03 GiB pair: encode phases per tensor, thread CPU, fastest of N whole passes."""
import sys, time
ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]; sys.path.insert(0, str(ROOT / "benchmarks")); sys.path.insert(0, str(ROOT))
import numpy as np
import common, e2e
from weightsync.codec import ans
from weightsync.codec import encode_tensor
from weightsync.codec import CodecConfig
dirs = e2e.trajectory("full", 3)
a, b = common.load_checkpoint(dirs[1]), common.load_checkpoint(dirs[2])
pairs = [(a[k][1].view(np.uint16), b[k][1].view(np.uint16)) for k in a if a[k][0] == "BF16"]
pairs.sort(key=lambda p: -p[0].size)
nbytes = sum(o.nbytes for o, n in pairs)
ch = sum(int(np.count_nonzero(o != n)) for o, n in pairs)
print("tensors", len(pairs), "bytes", nbytes, "changed frac %.4f" % (ch / (nbytes/2)))
shift, bits = ans.EXPONENT_FIELD["BF16"]
plans = [ans._plan(o, n, shift, bits, ans.BUCKETS, 16) for o, n in pairs]
def plan():
    for o, n in pairs: ans._plan(o, n, shift, bits, ans.BUCKETS, 16)
def scan():
    for (o, n), (thr, vthr, dense) in zip(pairs, plans):
        K, G = thr.size + 1, vthr.size + 1
        raw, st = ans._SCRATCH.take(o.size, K, 2)
        ans._kernel("scan", K, G, True)(o, n, thr, vthr, shift, bits, raw, st, dense)
def full():
    for o, n in pairs: ans.encode_block("BF16", o, n)
outs = [np.empty_like(n) for o, n in pairs]
def memcpy():
    for (o, n), x in zip(pairs, outs): np.copyto(x, n)
cfg = CodecConfig()
def tensor():
    for o, n in pairs: encode_tensor("BF16", n.view(np.uint8), o.view(np.uint8), cfg)
def T(f, r=5):
    f(); best = 1e9
    for _ in range(r):
        t = time.perf_counter(); f(); best = min(best, time.perf_counter() - t)
    return best * 1e3
for rnd in range(2):
    r = {k: round(T(f), 1) for k, f in (("memcpy", memcpy), ("plan", plan), ("scan", scan), ("block", full), ("tensor", tensor))}
    print(r, "enc x memcpy %.3f" % (r["memcpy"] / r["tensor"]))
