"""``ctx3`` against ``sparse`` on one step pair of benchmarks/e2e.py's 2 GiB checkpoints (4 MiB tensors; built
once into benchmarks/.cache, ~90 s): decode+hash and encode against memcpy, on one thread and on a pool of
all cores (largest tensors first), the passes interleaved in rounds and the fastest of each kept.

    python research/issue18-ctx-codec/bench_ctx3_large.py [rounds]
"""

import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT), str(Path(__file__).resolve().parent)]
import common  # noqa: E402
import ctx3  # noqa: E402
import e2e  # noqa: E402
import numpy as np  # noqa: E402
import xxhash  # noqa: E402

from weightsync.codec import registry  # noqa: E402
from weightsync.codec.payload import CodecConfig, _encode_payload, decode_tensor  # noqa: E402


def main(rounds: int = 3) -> None:
    dirs = e2e.trajectory("full", 3)
    old, new = common.load_checkpoint(dirs[1]), common.load_checkpoint(dirs[2])
    names = [n for n in sorted(new, key=lambda n: -new[n][1].size) if new[n][0] == "BF16"]
    ov = {n: old[n][1].view(np.uint16) for n in names}
    nv = {n: new[n][1].view(np.uint16) for n in names}
    ow = {n: np.empty_like(ov[n]) for n in names}
    raw = sum(v.nbytes for v in ov.values())
    changed = sum(np.count_nonzero(ov[n] != nv[n]) for n in names) / sum(v.size for v in ov.values())
    print(f"{len(names)} BF16 tensors, {raw / 2**30:.2f} GiB, {changed:.1%} changed")
    enc = {n: ctx3.encode_block("BF16", ov[n], nv[n])[0] for n in names}
    for n in names:
        ctx3.decode_block("BF16", memoryview(enc[n]), ov[n], ow[n], n)
        assert np.array_equal(ow[n], nv[n]), n
    cfg, sparse = CodecConfig(), registry.get("sparse")
    spenc = {n: bytes(_encode_payload(sparse, "BF16", ov[n], nv[n], cfg)[0]) for n in names}

    def sparse_decode(n):
        out = ow[n].view(np.uint8)
        decode_tensor("BF16", "sparse", spenc[n], old[n][1], out.size, out=out, hasher=xxhash.xxh3_128())

    ops = {
        "memcpy": lambda n: np.copyto(ow[n], ov[n]),
        "ctx3 dec": lambda n: ctx3.decode_block("BF16", memoryview(enc[n]), ov[n], ow[n], n, xxhash.xxh3_128()),
        "sparse dec": sparse_decode,
        "ctx3 enc": lambda n: ctx3.encode_block("BF16", ov[n], nv[n]),
        "sparse enc": lambda n: _encode_payload(sparse, "BF16", ov[n], nv[n], cfg),
    }
    cores = os.cpu_count() or 1
    with ThreadPoolExecutor(cores) as pool:
        for threads in (1, cores):
            fastest = dict.fromkeys(ops, float("inf"))
            for _ in range(rounds):
                for key, op in ops.items():
                    t = time.perf_counter()
                    if threads == 1:
                        for n in names:
                            op(n)
                    else:
                        list(pool.map(op, names))
                    fastest[key] = min(fastest[key], time.perf_counter() - t)
            mem = fastest["memcpy"]
            ratios = " ".join(f"{k} {mem / v:.3f}" for k, v in fastest.items() if k != "memcpy")
            print(f"{threads} thread(s): memcpy {raw / mem / 1e9:.2f} GB/s | {ratios}", flush=True)


if __name__ == "__main__":
    main(*(int(x) for x in sys.argv[1:]))
