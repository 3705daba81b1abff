"""Self-check of the prototype codec ``ctx3``: round trips (the pass for every bucket count, portable
``pdep``, in place, the numpy reference, backward decode) over dtypes and hostile change patterns,
bases that do not match the block, then corrupted blocks (truncations, byte flips), which must
raise FormatError or decode to bytes that the caller's hash rejects, never crash.

    python research/issue18-ctx-codec/check_ctx3.py [fuzz iterations]
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent)]
import ctx3  # noqa: E402
import numpy as np  # noqa: E402

from weightsync.errors import FormatError  # noqa: E402

VIEW = {"BF16": np.uint16, "F16": np.uint16, "F32": np.uint32, "U8": np.uint8, "I16": np.uint16}


def cases(rng):
    for dtype, t in VIEW.items():
        for n in (1, 63, 64, 65, 1000, 70_000, 300_000):
            old = rng.integers(0, np.iinfo(t).max, n, dtype=t, endpoint=True)
            if dtype in ("BF16", "F32"):  # realistic: weights near 0.02, some NaN / inf / -0.0 / subnormals
                f = rng.normal(0, 0.02, n).astype(np.float32)
                f[: min(n, 8)] = np.array([np.nan, np.inf, -0.0, 1e-40, -np.inf, 0.0, 3e38, -1e-45])[: min(n, 8)]
                old = f.view(np.uint32) if dtype == "F32" else (f.view(np.uint32) >> 16).astype(np.uint16)
            for frac in (0.001, 0.03, 0.2, 0.6, 1.0):
                new = old.copy()
                idx = rng.random(n) < frac
                delta = rng.choice([1, -1, 2, -3, 17, 1000, -40000], idx.sum()).astype(np.int64)
                new[idx] = (old[idx].astype(np.int64) + delta).astype(t)
                yield dtype, old, new
            if n >= 1000:  # clustered: long runs of changes and gaps far beyond the Rice escape
                new = old.copy()
                new[: n // 10] += t(1)
                new[-3:] -= t(1)
                yield dtype, old, new


def main(iterations: int = 2000) -> int:
    rng = np.random.default_rng(0)
    blocks = []
    for dtype, old, new in cases(rng):
        for kmax in (1, 2, 4, 8):
            data, k = ctx3.encode_block(dtype, old, new, kmax)
            assert data == ctx3.encode_block(dtype, old, new, kmax, bmi2=False)[0]
            assert k == np.count_nonzero(old != new)
            for bmi2 in (True, False):
                out = np.empty_like(old)
                ctx3.decode_block(dtype, memoryview(data), old, out, "check", bmi2=bmi2)
                assert np.array_equal(out, new), (dtype, old.size, kmax, bmi2)
            inplace = old.copy()
            ctx3.decode_block(dtype, memoryview(data), inplace, inplace, "check")
            assert np.array_equal(inplace, new)
            assert np.array_equal(ctx3.decode_reference(dtype, data, old), new)
            assert np.array_equal(ctx3.decode_backward(dtype, data, new), old)
            if data and old.size < 100_000:
                blocks.append((dtype, old, new, data))
    print(f"round trips: ok ({len(blocks)} blocks kept for fuzzing)")
    # a block against a base it was not made from: refused or other bytes, never out of bounds
    refused = other = 0
    for dtype, old, new, data in blocks[::7]:
        for base in (new, np.roll(old, 1), rng.permutation(old)):
            try:
                out = np.empty_like(old)
                ctx3.decode_block(dtype, memoryview(data), base, out, "wrong base")
                other += 1
            except FormatError:
                refused += 1
    print(f"wrong bases: {refused} refused, {other} decoded to other bytes")
    rejected = wrong = 0
    for _ in range(iterations):
        dtype, old, new, data = blocks[rng.integers(len(blocks))]
        bad = bytearray(data)
        if rng.random() < 0.3:
            bad = bad[: rng.integers(len(bad))]
        else:
            for _ in range(rng.integers(1, 4)):
                bad[rng.integers(len(bad))] ^= 1 << rng.integers(8)
        try:
            out = np.empty_like(old)
            ctx3.decode_block(dtype, memoryview(bytes(bad)), old, out, "fuzz")
            wrong += not np.array_equal(out, new)
        except FormatError:
            rejected += 1
    print(f"fuzz: {iterations} corrupted blocks, {rejected} rejected, {wrong} decoded to other bytes (hash catches)")
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 2000))
