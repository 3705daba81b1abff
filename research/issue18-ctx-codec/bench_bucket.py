"""The prototype codec ``bucket`` (bucket.py) against ``sparse`` and ``ac``: size / zeroth-order bound and thread-CPU-time
throughput as a fraction of memcpy measured in the same process (whole passes over every tensor); round trip and backward decode checked on
every tensor; the bytes of a one-version rollback with keyframes (today) and with bucket deltas.

    python research/issue18-ctx-codec/bench_bucket.py [pairs]
"""

import itertools
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT), str(Path(__file__).resolve().parent)]
import common  # noqa: E402
import numpy as np  # noqa: E402
import xxhash  # noqa: E402

import bucket  # noqa: E402

from weightsync.codec import registry  # noqa: E402
from weightsync.codec.payload import CodecConfig, _encode_payload, decode_tensor, encode_tensor  # noqa: E402


def h_bits(counts):
    c = np.asarray(counts, np.float64)
    c = c[c > 0]
    return float(c.sum() * np.log2(c.sum()) - (c * np.log2(c)).sum())


def best(fn, repeat=3):
    ts = []
    for _ in range(repeat):
        t = time.thread_time()
        fn()
        ts.append(time.thread_time() - t)
    return min(ts)


def main(npairs=5):
    cfg = CodecConfig()
    for lr in (1e-6, 1e-5):
        dirs = common.cache_dirs(f"moe-lr{lr:g}", lr=lr, steps=6)
        for a, b in list(itertools.pairwise(dirs))[:npairs]:
            old, new = common.load_checkpoint(a), common.load_checkpoint(b)
            names = sorted(new, key=lambda n: -new[n][1].size)
            bound = sum(
                h_bits(np.append(np.unique(d[d != 0], return_counts=True)[1], np.count_nonzero(d == 0))) / 8
                for d in (new[n][1].view(np.uint16) - old[n][1].view(np.uint16) for n in names)
            )
            raw = sum(new[n][1].size for n in names)
            outs = {n: np.empty_like(new[n][1]) for n in names}
            row = [f"lr {lr:g} {a.name[-2:]}->{b.name[-2:]}"]
            mem = raw / best(lambda: [np.copyto(outs[n], new[n][1]) for n in names], 5)
            ov = {n: old[n][1].view(np.uint16) for n in names}
            nv = {n: new[n][1].view(np.uint16) for n in names}
            ow = {n: outs[n].view(np.uint16) for n in names}
            # bucket: one block per tensor (every tensor here is under the 32 MiB block), plus the
            # 36 bytes of a one-block payload container
            enc = {n: bucket.encode_block("BF16", ov[n], nv[n])[0] for n in names}
            for n in names:
                bucket.decode_block("BF16", memoryview(enc[n]), ov[n], ow[n], n)
                assert np.array_equal(ow[n], nv[n]), n
                assert np.array_equal(bucket.decode_backward("BF16", enc[n], nv[n]), ov[n]), n
            size = sum(len(e) + 36 for e in enc.values())
            te = best(lambda: [bucket.encode_block("BF16", ov[n], nv[n]) for n in names])
            td = best(
                lambda: [
                    bucket.decode_block("BF16", memoryview(enc[n]), ov[n], ow[n], n, xxhash.xxh3_128())
                    for n in names
                ]
            )
            row.append(f"bucket {size / bound:.3f}x bound enc {raw / te / mem:.3f} dec {raw / td / mem:.3f}")
            full = sum(len(encode_tensor("BF16", old[n][1], None, cfg).payload) for n in names if enc[n])
            row.append(f"rollback keyframes {full / 1e6:.2f} MB -> deltas {size / 1e6:.2f} MB")
            for codec in ("sparse", "ac"):
                impl = registry.get(codec)
                enc = {n: bytes(_encode_payload(impl, "BF16", ov[n], nv[n], cfg)[0]) for n in names}
                size = sum(len(e) for e in enc.values())
                te = best(lambda: [_encode_payload(impl, "BF16", ov[n], nv[n], cfg) for n in names])
                td = best(
                    lambda: [
                        decode_tensor(
                            "BF16", codec, enc[n], old[n][1], new[n][1].size, out=outs[n], hasher=xxhash.xxh3_128()
                        )
                        for n in names
                    ]
                )
                row.append(f"{codec} {size / bound:.3f}x bound enc {raw / te / mem:.3f} dec {raw / td / mem:.3f}")
            print(" | ".join(row) + f" | memcpy {mem / 1e9:.2f} GB/s", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5)
