"""Tensors as payloads (docs/FORMAT.md, "Payloads"): the container of independent blocks, the
choice of a codec per tensor (``same``, ``full``, ``ans``, ``ac``, ``sparse``, ``dense``), and
rebuilding a tensor from a chain of payloads (docs/DESIGN.md)."""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from weightsync.codec import hashing, registry
from weightsync.codec.abc import Codec
from weightsync.codec.streams import copy, same_memory
from weightsync.errors import ChecksumError, FormatError, UsageError
from weightsync.format.dtypes import UINT_VIEW, itemsize

MAGIC = b"WSP1"
REVERSE_MAGIC = b"WSR1"  # a reverse payload: what only a backward decode reads (docs/FORMAT.md)


_HEADER = struct.Struct("<4sBBHQQI")  # magic, codec id, elem width, reserved, n elems, block elems, n blocks


MAX_BLOCK_ELEMS = 1 << 31


CODERS = ("ans", "ac")
"""The entropy coders a :class:`CodecConfig` may name."""


@dataclass(frozen=True)
class CodecConfig:
    """How tensors are encoded. Decoding needs none of it: payloads are self-describing.

    level: zstd level of delta streams; full_level: zstd level of full tensors (both with
    ``min_match`` 7 and ``hash_log`` 10, see :func:`weightsync.codec.streams.compressor`);
    block_bytes: raw bytes per block (bounds encoder memory to a few blocks per thread);
    dense_above: changed fraction above which the dense coding is also tried;
    entropy_coder: use the entropy coder ``coder`` where it applies (elements of up to 4 bytes);
    False: ``sparse`` (1.2-1.6x faster to encode than ``ans``, no faster to decode, 1.5x larger);
    coder: ``ans`` (the default: 0.69-0.76x the entropy bound, decoding at 0.5-1.07x ``sparse``'s
    speed by CPU) or ``ac`` (0.69-0.75x, 3.5-7.4x slower to decode and 2.4-5x slower to encode);
    benchmarks/README.md, "Delta size and codec speed"; docs/DESIGN.md, ``weightsync.codec.ans``.
    """

    level: int = 1
    full_level: int = 1
    block_bytes: int = 32 << 20
    dense_above: float = 0.25
    entropy_coder: bool = True
    coder: str = "ans"

    def __post_init__(self) -> None:
        if not (1 <= self.level <= 22 and 1 <= self.full_level <= 22):
            raise UsageError("zstd levels must be in 1..22")
        if not (8 <= self.block_bytes <= MAX_BLOCK_ELEMS):
            raise UsageError(f"block_bytes must be in 8..{MAX_BLOCK_ELEMS}")
        if not 0.0 <= self.dense_above <= 1.0:
            raise UsageError("dense_above must be a fraction in [0, 1]")
        if self.coder not in CODERS:
            raise UsageError(f"unknown entropy coder {self.coder!r} (one of {', '.join(CODERS)})")

    def block_elems(self, width: int) -> int:
        """Elements per block for elements of ``width`` bytes (blocks are coded independently)."""
        return max(1, self.block_bytes // width)


@dataclass(frozen=True)
class EncodedTensor:
    """One tensor encoded: the codec chosen (a registry name, or ``same`` with an empty payload), the
    payload bytes, and how many elements differ from the old tensor."""

    codec: str
    payload: bytes | bytearray
    changed: int  # elements that differ from old (all of them for a full encoding)
    reverse: bytes | bytearray = b""  # the reverse payload (:attr:`Codec.apart`), b"" when it has none


# --- encoding ------------------------------------------------------------------------------------
def _encode_payload(
    codec: Codec, dtype: str, old: np.ndarray | None, new: np.ndarray, cfg: CodecConfig
) -> tuple[bytearray, int, bytearray]:
    """The payload, the changed count and the reverse payload (empty unless one of its blocks has a
    reverse part: :attr:`Codec.apart`)."""
    width = new.dtype.itemsize
    step = cfg.block_elems(width)
    n_blocks = -(-new.size // step)
    blocks, reverse, changed = [], [], 0
    for i in range(n_blocks):
        sl = slice(i * step, (i + 1) * step)
        base = None if old is None else old[sl]
        if codec.apart:
            data, rev, n = codec.encode_apart(dtype, base, new[sl], cfg)
            reverse.append(rev)
        else:
            data, n = codec.encode(dtype, base, new[sl], cfg)
        blocks.append(data)
        changed += n
    head = _HEADER.pack(MAGIC, codec.id, width, 0, new.size, step, n_blocks)
    rev = bytearray()
    if any(reverse):
        rev = _assemble(_HEADER.pack(REVERSE_MAGIC, codec.id, width, 0, new.size, step, n_blocks), reverse)
    return _assemble(head, blocks), changed, rev


def _assemble(head: bytes, blocks: list[bytes]) -> bytearray:
    """Header, block lengths and blocks in one buffer, releasing each block once copied (a full
    payload of a huge tensor is never held twice)."""
    out = bytearray(head)
    out += b"".join([len(b).to_bytes(8, "little") for b in blocks])
    for i, b in enumerate(blocks):
        out += b  # grows in place (no zero-filled buffer touched up front)
        blocks[i] = b = b""
    return out


def _as_elements(buf: np.ndarray, dtype: str, what: str) -> np.ndarray:
    width = itemsize(dtype)
    if buf.dtype != np.uint8 or buf.ndim != 1:
        raise UsageError(f"{what}: expected a 1-D uint8 array of raw bytes")
    if buf.size % width:
        raise FormatError(f"{what}: {buf.size} bytes is not a whole number of {dtype} elements")
    return buf.view(UINT_VIEW[width])


def encode_tensor(
    dtype: str, new: np.ndarray, old: np.ndarray | None, config: CodecConfig = CodecConfig()
) -> EncodedTensor:
    """Encode ``new`` (raw bytes, 1-D uint8) against ``old`` (same length) or in full if ``old`` is None.

    Elements of up to 4 bytes use the entropy coder (``config.coder``, unless ``entropy_coder`` is
    off), wider ones ``sparse`` (:func:`delta_codec`); above ``dense_above`` changed, ``dense`` is
    tried too and the smaller wins. An unchanged tensor is ``same``.
    """
    new_e = _as_elements(new, dtype, "new tensor")
    if old is None:
        payload, changed, _ = _encode_payload(registry.get("full"), dtype, None, new_e, config)
        return EncodedTensor("full", payload, changed)
    old_e = _as_elements(old, dtype, "old tensor")
    if old_e.size != new_e.size:
        raise UsageError("old and new tensors differ in size; encode in full")
    codec = registry.get(delta_codec(dtype, config))
    payload, changed, reverse = _encode_payload(codec, dtype, old_e, new_e, config)
    if changed == 0:
        return EncodedTensor("same", b"", 0)
    best = EncodedTensor(codec.name, payload, changed, reverse)
    if changed > config.dense_above * new_e.size:
        dense, _, _ = _encode_payload(registry.get("dense"), dtype, old_e, new_e, config)
        if len(dense) < len(best.payload):
            best = EncodedTensor("dense", dense, changed)
    return best


def delta_codec(dtype: str, config: CodecConfig) -> str:
    """The codec :func:`encode_tensor` codes a changed tensor of ``dtype`` with (before trying ``dense``)."""
    if config.entropy_coder and registry.get(config.coder).supports(dtype):
        return config.coder
    return "sparse"


def encode_sparse_from_changes(
    dtype: str, n_elems: int, idx: np.ndarray, diffs: np.ndarray, config: CodecConfig = CodecConfig()
) -> bytes:
    """The ``sparse`` payload of a change given as flat positions ``idx`` (strictly ascending, below
    ``n_elems``) and the wrapping differences ``u_new - u_old`` there (nonzero integers of the
    element width), without the old or new tensor: byte for byte what :func:`encode_tensor` writes
    for the same change when it chooses ``sparse``. Raises :class:`UsageError` for a malformed change.
    """
    width = itemsize(dtype)
    if n_elems < 0:
        raise UsageError(f"element count must be non-negative, not {n_elems}")
    idx = np.asarray(idx)
    diffs = np.asarray(diffs)
    if idx.ndim != 1 or diffs.shape != idx.shape or idx.dtype.kind not in "iu" or diffs.dtype.kind not in "iu":
        raise UsageError("idx and diffs must be 1-D integer arrays of the same length")
    if diffs.dtype.itemsize != width:
        raise UsageError(f"diffs of {diffs.dtype.itemsize}-byte integers for {dtype} elements of {width} bytes")
    idx = idx.astype(np.int64, copy=False)
    if idx.size and (idx[0] < 0 or idx[-1] >= n_elems or np.any(idx[1:] <= idx[:-1])):
        raise UsageError(f"positions must be strictly ascending in [0, {n_elems})")
    diffs = diffs.view(UINT_VIEW[width])
    if np.any(diffs == 0):
        raise UsageError("a zero difference is not a change")
    from weightsync.codec.sparse import Sparse, block_from_changes  # numba: imported on first use

    step = config.block_elems(width)
    n_blocks = -(-n_elems // step)
    cuts = np.searchsorted(idx, np.arange(n_blocks + 1, dtype=np.int64) * step)
    blocks = [
        block_from_changes(idx[a:b] - i * step, diffs[a:b], config.level)
        for i, (a, b) in enumerate(zip(cuts[:-1], cuts[1:]))
    ]
    head = _HEADER.pack(MAGIC, Sparse.id, width, 0, n_elems, step, n_blocks)
    return bytes(_assemble(head, blocks))


# --- decoding ------------------------------------------------------------------------------------
def _codec(name: str, what: str) -> Codec:
    try:
        return registry.get(name)
    except KeyError:
        raise FormatError(f"{what}: unknown codec {name!r}") from None


def decode_tensor(
    dtype: str,
    codec: str,
    payload: bytes | memoryview,
    old: np.ndarray | None,
    nbytes: int,
    out: np.ndarray | None = None,
    what: str = "tensor",
    hasher=None,
) -> np.ndarray:
    """Rebuild a tensor's raw bytes (1-D uint8 of ``nbytes``), into ``out`` if given.

    ``hasher`` (``xxhash.xxh3_128()`` or anything with ``update``) is fed the result in order as it
    is written; ``ans``, ``sparse`` and ``same`` hash each slice while it is still in cache, so
    verifying costs little more than the copy (the kernels feed a :func:`weightsync.codec.hashing.hasher`
    themselves, without going back to Python per slice). On an error it may have been fed part of the result.
    ``out`` may be ``old`` itself: the tensor is then decoded in place (``sparse`` and ``same``
    copy nothing), and on an error ``old`` may be half overwritten. Any other overlap is refused.

    Raises :class:`FormatError` for a payload that does not match the declared codec, dtype or size.
    """
    width = itemsize(dtype)
    if nbytes % width:
        raise FormatError(f"{what}: {nbytes} bytes is not a whole number of {dtype} elements")
    impl = None if codec == "same" else _codec(codec, what)
    if impl is not None and not impl.supports(dtype):
        raise FormatError(f"{what}: codec {codec!r} does not take {dtype} elements")
    if impl is not None and len(payload) >= _HEADER.size:
        _, _, pw, _, pn, _, _ = _HEADER.unpack_from(payload)
        if pw * pn != nbytes:
            raise FormatError(f"{what}: payload declares {pn} x {pw}-byte elements, expected {nbytes} bytes")
    if out is None:
        try:
            out = np.empty(nbytes, dtype=np.uint8)
        except MemoryError:
            raise FormatError(f"{what}: declared size of {nbytes} bytes cannot be allocated") from None
    if out.size != nbytes:
        raise UsageError(f"{what}: output buffer has {out.size} bytes, need {nbytes}")
    if not out.flags.c_contiguous or not out.flags.writeable:
        raise UsageError(f"{what}: output buffer must be contiguous and writable")
    if old is not None and np.may_share_memory(out, old) and not same_memory(out, old):
        raise UsageError(f"{what}: output buffer overlaps the base without being it")
    out_e = out.view(UINT_VIEW[width])
    old_e = None if old is None else _as_elements(old, dtype, f"{what} base")
    if (impl is None or impl.needs_base) and (old_e is None or old_e.size != out_e.size):
        raise FormatError(f"{what}: codec {codec!r} needs a base of {nbytes} bytes")
    if impl is None:
        if len(payload):
            raise FormatError(f"{what}: codec 'same' carries no payload")
        copy(old_e, out_e, hasher)
        return out
    _decode_payload(impl, dtype, memoryview(payload), old_e, out_e, what, hasher)
    return out


def payload_changes(
    dtype: str, codec: str, payload: bytes | memoryview, nbytes: int, what: str = "tensor"
) -> tuple[np.ndarray, np.ndarray] | None:
    """The changes a delta payload makes, without its base: positions (int64, ascending) and the
    wrapping differences there (unsigned of the element width), new = old + difference; or None
    for a codec that cannot say without decoding the whole tensor (``ans``, ``ac``, ``dense``, ``full``).
    Work proportional to the change: what an in-place patch of a live model needs."""
    width = itemsize(dtype)
    n = nbytes // width
    if codec == "same":
        if len(payload):
            raise FormatError(f"{what}: codec 'same' carries no payload")
        return np.empty(0, np.int64), np.empty(0, UINT_VIEW[width])
    impl = _codec(codec, what)
    if not hasattr(impl, "changes") or not impl.supports(dtype):
        return None
    idx, diff = [], []
    for sl, block, i in _blocks(impl, memoryview(payload), width, n, what):
        b_idx, b_diff = impl.changes(block, sl.stop - sl.start, width, f"{what} block {i}")
        idx.append(b_idx + sl.start)
        diff.append(b_diff)
    return np.concatenate(idx), np.concatenate(diff)


def _blocks(codec: Codec, payload: memoryview, width: int, n: int, what: str, magic: bytes = MAGIC):
    """``(elements, block, index)`` of each block of a payload (a reverse payload with
    :data:`REVERSE_MAGIC`), once its container is checked."""
    if len(payload) < _HEADER.size:
        raise FormatError(f"{what}: payload of {len(payload)} bytes is too short")
    got, cid, pw, _, pn, step, n_blocks = _HEADER.unpack_from(payload)
    if got != magic or cid != codec.id:
        kind = f"a reverse payload of {codec.name!r}" if magic == REVERSE_MAGIC else f"a {codec.name!r} payload"
        raise FormatError(f"{what}: payload is not {kind}")
    if pw != width or pn != n or not 0 < step <= MAX_BLOCK_ELEMS:
        raise FormatError(f"{what}: payload declares {pn} x {pw}-byte elements, expected {n} x {width}")
    if n_blocks != -(-n // step):
        raise FormatError(f"{what}: payload declares {n_blocks} blocks for {n} elements")
    pos = _HEADER.size + 8 * n_blocks
    if pos > len(payload):
        raise FormatError(f"{what}: truncated payload")
    lengths = np.frombuffer(payload[_HEADER.size : pos], dtype="<u8").tolist()
    if sum(lengths) != len(payload) - pos:  # Python ints: no wrap-around
        raise FormatError(f"{what}: block lengths do not add up to the payload size")
    for i, length in enumerate(lengths):
        yield slice(i * step, min((i + 1) * step, n)), payload[pos : pos + length], i
        pos += length


def _decode_payload(
    codec: Codec, dtype: str, payload: memoryview, old: np.ndarray | None, out: np.ndarray, what: str, hasher=None
) -> None:
    for sl, block, i in _blocks(codec, payload, out.dtype.itemsize, out.size, what):
        codec.decode(dtype, block, None if old is None else old[sl], out[sl], f"{what} block {i}", hasher)


def decode_tensor_backward(
    dtype: str,
    codec: str,
    payload: bytes | memoryview,
    new: np.ndarray,
    nbytes: int,
    out: np.ndarray | None = None,
    what: str = "tensor",
    hasher=None,
    reverse: bytes | memoryview = b"",
) -> np.ndarray:
    """The base a delta payload was encoded against, from the tensor it decodes to: the inverse of
    :func:`decode_tensor` for codecs that are :attr:`~weightsync.codec.abc.Codec.invertible`
    (``same``, ``sparse``, ``dense``, ``ans``; not ``ac`` or ``full``). ``new`` holds the raw bytes the
    payload decodes to (1-D uint8 of ``nbytes``); the result goes into ``out`` if given, which may
    be ``new`` itself (in place; on an error ``new`` may be half overwritten). ``hasher`` as
    :func:`decode_tensor`'s. ``reverse``: the payload's reverse payload, if it has one
    (:attr:`EncodedTensor.reverse`). Raises :class:`FormatError` for a codec that cannot run
    backward and for a payload that does not match the declared codec, dtype or size."""
    width = itemsize(dtype)
    if nbytes % width:
        raise FormatError(f"{what}: {nbytes} bytes is not a whole number of {dtype} elements")
    impl = None if codec == "same" else _codec(codec, what)
    if impl is not None and not (impl.invertible and impl.needs_base):
        raise FormatError(f"{what}: codec {codec!r} cannot be decoded backward")
    if impl is not None and not impl.supports(dtype):
        raise FormatError(f"{what}: codec {codec!r} does not take {dtype} elements")
    new_e = _as_elements(new, dtype, f"{what} result")
    if new_e.size * width != nbytes:
        raise FormatError(f"{what}: codec {codec!r} decoded backward needs the {nbytes} bytes it decodes to")
    if out is None:
        out = np.empty(nbytes, dtype=np.uint8)
    if out.size != nbytes:
        raise UsageError(f"{what}: output buffer has {out.size} bytes, need {nbytes}")
    if not out.flags.c_contiguous or not out.flags.writeable:
        raise UsageError(f"{what}: output buffer must be contiguous and writable")
    if np.may_share_memory(out, new) and not same_memory(out, new):
        raise UsageError(f"{what}: output buffer overlaps the result without being it")
    out_e = out.view(UINT_VIEW[width])
    if len(reverse) and (impl is None or not impl.apart):
        raise FormatError(f"{what}: codec {codec!r} has no reverse payload")
    if impl is None:
        if len(payload):
            raise FormatError(f"{what}: codec 'same' carries no payload")
        copy(new_e, out_e, hasher)
        return out
    blocks = _blocks(impl, memoryview(payload), width, out_e.size, what)
    if not impl.apart:
        for sl, block, i in blocks:
            impl.decode_backward(dtype, block, new_e[sl], out_e[sl], f"{what} block {i}", hasher)
        return out
    parts = None
    if len(reverse):  # checked whole first: the encoder writes none that lists no exception
        parts = list(_blocks(impl, memoryview(reverse), width, out_e.size, what, REVERSE_MAGIC))
        if not any(len(rev) for _, rev, _ in parts):
            raise FormatError(f"{what}: its reverse payload lists no exception")
        parts = iter(parts)
    for sl, block, i in blocks:
        rev = b""
        if parts is not None:  # as many blocks as the payload (both declare n), each of the same elements
            rsl, rev, _ = next(parts)
            if rsl != sl:
                raise FormatError(f"{what}: its reverse payload's blocks are not the payload's")
        impl.decode_backward(dtype, block, new_e[sl], out_e[sl], f"{what} block {i}", hasher, reverse=rev)
    return out


def rebuild(
    dtype: str,
    nbytes: int,
    xxh3: str,
    base: np.ndarray | None,
    steps: Sequence[tuple],
    what: str = "tensor",
    in_place: bool = False,
) -> np.ndarray:
    """Apply ``steps`` in turn to ``base`` (each a codec and a function giving its payload, called
    only when that step is decoded, and optionally True for a step that runs backward: the delta
    of a newer version undone, :func:`decode_tensor_backward`, then optionally a function giving
    that payload's reverse payload, or None where it has none) and check the result's XXH3-128
    against ``xxh3`` (hex): the hash is fed while the last decode writes. ``in_place``: ``base`` is
    the caller's to overwrite (a buffer read for this call), so each step decodes into it. Raises
    :class:`ChecksumError` for a wrong result, :class:`FormatError` for a bad payload or a recipe
    with neither base nor steps."""
    if not steps:
        if base is None:
            raise FormatError(f"{what}: recipe without a base or a payload")
        actual = xxhash.xxh3_128_hexdigest(base)
    else:
        hasher, cur = hashing.hasher(), base  # one the kernels feed as they write
        for i, (codec, payload, *backward) in enumerate(steps, 1):
            out = cur if in_place and cur is not None and cur.size == nbytes else None
            feed = hasher if i == len(steps) else None
            if backward and backward[0]:
                if cur is None:
                    raise FormatError(f"{what}: a backward step without the bytes it undoes")
                reverse = backward[1]() if len(backward) > 1 and backward[1] is not None else b""
                cur = decode_tensor_backward(dtype, codec, payload(), cur, nbytes, out, what, feed, reverse)
            else:
                cur = decode_tensor(dtype, codec, payload(), cur, nbytes, out, what, feed)
        base, actual = cur, hasher.hexdigest()
    if actual != xxh3:
        raise ChecksumError(what, xxh3, actual)
    return base


def warm_up_steps() -> list[tuple]:
    """The pieces of :func:`warm_up`, each compiling on its own (``python -m weightsync.codec.jit
    --jobs N`` spreads them over processes): ``("width", w)`` for each element width, then ``("ans",
    dtype, buckets, groups)`` for each pass of ``ans`` (:func:`weightsync.codec.ans.warm_up_steps`)."""
    from weightsync.codec import ans  # numba: imported on first use

    return [("width", w) for w in sorted(set(UINT_VIEW))] + [("ans", *step) for step in ans.warm_up_steps()]


def warm_up_step(kind: str, *args) -> None:
    """One piece of :func:`warm_up` (:func:`warm_up_steps`)."""
    from weightsync.codec import ans

    if kind == "ans":
        ans.warm_up_step(*args)
        return
    (width,) = args
    rng = np.random.default_rng(0)
    dtype = next(d for d in ("U8", "BF16", "F32", "F64") if itemsize(d) == width)
    old = rng.integers(0, 256, 1024 * width, dtype=np.uint8)
    new = old.copy()
    new[:: 37 * width] += 1  # 2.7% of the elements change: the delta codecs, not dense
    deltas = (CodecConfig(), CodecConfig(coder="ac"), CodecConfig(entropy_coder=False))
    for cfg, base in (*((c, old) for c in deltas), (CodecConfig(), None)):
        enc = encode_tensor(dtype, new, base, cfg)  # base None: a keyframe ("full")
        for payload in (bytes(enc.payload), bytearray(enc.payload)):  # both read as read-only arrays: one kernel
            for fed in (None, hashing.hasher()):  # a pull's last step feeds a hasher, the others none
                into = old.copy()  # decoded into a fresh buffer, and in place (as pulls do): two kernels
                outs = (
                    decode_tensor(dtype, enc.codec, payload, base, new.size, hasher=fed),
                    decode_tensor(
                        dtype, enc.codec, payload, into if base is not None else None, new.size, into, hasher=fed
                    ),
                )
                for out in outs:
                    if not np.array_equal(out, new):
                        raise AssertionError(f"codec warm-up: {enc.codec} did not round-trip")  # never expected
    hasher = hashing.hasher()  # a copy that feeds a hasher as it goes (kernels.copy_feeding)
    copy(new.view(UINT_VIEW[width]), np.empty(new.size // width, UINT_VIEW[width]), hasher)
    if hasher.digest() != xxhash.xxh3_128(new).digest():
        raise AssertionError("codec warm-up: a copy fed the hasher other bytes")  # never expected


def warm_up() -> None:
    """Compile the numba kernels, or load them from numba's cache (:mod:`weightsync.codec.jit`), for
    every element width and every signature publishes and pulls use, by coding a tiny tensor pair
    with each codec: deltas and keyframes, decoded from a read-only payload (as fetched) and a
    writable one, into a fresh buffer and in place; and every pass of ``ans`` its encoder uses
    (:func:`weightsync.codec.ans.warm_up`), last: every other kernel is ready in seconds. Daemons run
    this at start in the background, so that their first delta does not pay it (minutes of one CPU
    with a cold cache, 1-2 s to load a warm one); an image build fills the image's cache with
    ``python -m weightsync.codec.jit``, whose ``--jobs`` compiles the pieces in parallel."""
    for step in warm_up_steps():
        warm_up_step(*step)
