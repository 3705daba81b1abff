"""Encode and decode time (thread CPU, fastest of 9) of every BF16 tensor of an lr 1e-5 pair, with the
package on PYTHONPATH (run once per package, alternating): python probe_k8_time.py 0"""
import sys, time, os, glob
HERE = __import__("pathlib").Path(__file__).resolve().parent
CACHE = HERE.parents[1] / "benchmarks" / ".cache"
sys.path.insert(0, str(HERE.parents[1] / "benchmarks"))
import numpy as np
from pathlib import Path
from common import load_checkpoint
from weightsync.codec import ans
d = sorted(glob.glob(f"{CACHE}/moe-lr1e-05-*"))[0]
steps = sorted(os.listdir(d)); pi = int(sys.argv[1])
a, b = load_checkpoint(Path(d)/steps[pi]), load_checkpoint(Path(d)/steps[pi+1])
pairs = [(a[k][1].view(np.uint16), b[k][1].view(np.uint16)) for k in a if a[k][0] == "BF16"]
blocks = [(o, n, np.frombuffer(ans.encode_block("BF16", o, n)[0], np.uint8)) for o, n in pairs]
blocks = [x for x in blocks if x[2].size]
outs = [np.empty_like(o) for o, _, _ in blocks]
for (o, n, data), out in zip(blocks, outs):
    ans.decode_block("BF16", memoryview(data), o, out, "t"); assert (out == n).all()
def enc():
    for o, n in pairs: ans.encode_block("BF16", o, n)
def dec():
    for (o, n, data), out in zip(blocks, outs): ans.decode_block("BF16", memoryview(data), o, out, "t")
def T(f):
    f(); best = 1e9
    for _ in range(9):
        t = time.thread_time(); f(); best = min(best, time.thread_time() - t)
    return best * 1e3
print(ans.MAX_K, "pair", pi, "size", sum(x[2].size for x in blocks), "encode %.1f decode %.1f ms" % (T(enc), T(dec)))
