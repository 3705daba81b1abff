"""(Session 39: python probe_s39_ab2.py 1; LR=1e-05 for the other trajectory) Same tree: blocks with nibbles vs without (encode_block(nibbles=...)), encode and decode time, thread CPU, best of 9."""
import sys, time, os, glob
from pathlib import Path
ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]; sys.path.insert(0, str(ROOT / "benchmarks"))
import numpy as np
from common import load_checkpoint
from weightsync.codec import ans
lr = os.environ.get("LR", "1e-06")
d = sorted(glob.glob(f"{ROOT}/benchmarks/.cache/moe-lr{lr}-*"))[0]
steps = sorted(os.listdir(d)); pi = int(sys.argv[1])
a, b = load_checkpoint(Path(d)/steps[pi]), load_checkpoint(Path(d)/steps[pi+1])
pairs = [(a[k][1].view(np.uint16), b[k][1].view(np.uint16)) for k in a if a[k][0] == "BF16"]
def T(f):
    f(); best = 1e9
    for _ in range(9):
        t = time.thread_time(); f(); best = min(best, time.thread_time() - t)
    return best * 1e3
for rnd in range(2):
    for nib in (False, True):
        blocks = [(o, n, np.frombuffer(ans.encode_block("BF16", o, n, nibbles=nib)[0], np.uint8)) for o, n in pairs]
        blocks = [x for x in blocks if x[2].size]
        outs = [np.empty_like(o) for o, _, _ in blocks]
        def enc():
            for o, n in pairs: ans.encode_block("BF16", o, n, nibbles=nib)
        def dec():
            for (o, n, data), out in zip(blocks, outs): ans.decode_block("BF16", memoryview(data), o, out, "t")
        print(lr, "nibbles", nib, "size", sum(x[2].size for x in blocks), "encode %.2f decode %.2f ms" % (T(enc), T(dec)))
