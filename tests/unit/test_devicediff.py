"""Device-side diffing (weightsync.torch.device): sparse payloads from known changes, the device
snapshot's diff, and the host mirror. CPU tensors here; the CUDA tests run where CUDA is present.

Every comparison is on raw bytes or integer views, never on float values.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from weightsync.codec.payload import CodecConfig, decode_tensor, encode_sparse_from_changes, encode_tensor
from weightsync.errors import UsageError
from weightsync.format.dtypes import ITEMSIZE, UINT_VIEW
from weightsync.torch.device import DeviceSnapshot
from weightsync.torch.dtypes import ST_DTYPE, TORCH_DTYPE
from weightsync.torch.hostpatch import DeviceDiff, HostMirror, TensorChange, clone_file
from weightsync.torch.state_dict import save_state_dict

FAST = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
DTYPES = sorted(ITEMSIZE)
TORCH_DTYPES = [TORCH_DTYPE[k] for k in sorted(TORCH_DTYPE)]  # the dtypes torch and safetensors share
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def bits(t: torch.Tensor) -> np.ndarray:
    """A tensor's elements as unsigned integers of the element width (row-major order)."""
    b = t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy()
    return b.view(UINT_VIEW[t.element_size()])


def random_tensor(dtype: torch.dtype, shape, seed: int) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    w = torch.empty(0, dtype=dtype).element_size()
    n = int(np.prod(shape))
    raw = rng.integers(0, 256, n * w, dtype=np.uint8)
    if dtype == torch.bool:
        raw &= 1
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.from_numpy(raw).view(dtype).reshape(shape).clone()


def ints(t: torch.Tensor) -> torch.Tensor:
    """A flat signed-integer view of a contiguous tensor (indexing works for every dtype)."""
    return t.view(-1).view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def set_bits(t: torch.Tensor, positions, values) -> None:
    """Write raw bit patterns into a tensor (flat positions), bypassing float arithmetic."""
    v = ints(t)
    w = t.element_size()
    signed = np.array(values, dtype=UINT_VIEW[w]).view({1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}[w])
    v[torch.as_tensor(positions)] = torch.from_numpy(signed)


# --- codec: sparse payloads from precomputed changes -------------------------------------------------
@FAST
@given(
    dtype=st.sampled_from(DTYPES),
    n=st.integers(0, 300),
    block_bytes=st.sampled_from([8, 24, 64, 1 << 20]),
    density=st.floats(0, 1),
    seed=st.integers(0, 2**32 - 1),
)
def test_sparse_from_changes_is_byte_identical_to_encode_tensor(dtype, n, block_bytes, density, seed):
    w = ITEMSIZE[dtype]
    rng = np.random.default_rng(seed)
    old = rng.integers(0, 256, n * w, dtype=np.uint8)
    new = old.copy()
    oe, ne = old.view(UINT_VIEW[w]), new.view(UINT_VIEW[w])
    mask = rng.random(n) < density
    ne[mask] = rng.integers(0, 256, mask.sum() * w, dtype=np.uint8).view(UINT_VIEW[w])
    idx = np.flatnonzero(oe != ne)
    cfg = CodecConfig(entropy_coder=False, block_bytes=block_bytes, dense_above=1.0)
    payload = encode_sparse_from_changes(dtype, n, idx, ne[idx] - oe[idx], cfg)
    ref = encode_tensor(dtype, new, old, cfg)
    if idx.size:
        assert ref.codec == "sparse" and ref.payload == payload
    assert decode_tensor(dtype, "sparse", payload, old, n * w).tobytes() == new.tobytes()


def test_sparse_from_changes_accepts_int32_positions_and_signed_differences():
    old = np.zeros(1000, np.uint16)
    new = old.copy()
    new[[3, 500, 999]] = [1, 0xFFFF, 7]
    d = (new - old)[[3, 500, 999]]
    a = encode_sparse_from_changes("BF16", 1000, np.array([3, 500, 999], np.int32), d.view(np.int16))
    assert a == encode_tensor("BF16", new.view(np.uint8), old.view(np.uint8), CodecConfig(entropy_coder=False)).payload


@pytest.mark.parametrize(
    "idx, diffs, match",
    [
        ([3, 2], [1, 1], "ascending"),
        ([2, 2], [1, 1], "ascending"),
        ([-1], [1], "ascending"),
        ([10], [1], "ascending"),
        ([1, 2], [1, 0], "zero difference"),
        ([1, 2], [1], "same length"),
        ([[1]], [[1]], "1-D"),
    ],
)
def test_sparse_from_changes_rejects_malformed_changes(idx, diffs, match):
    with pytest.raises(UsageError, match=match):
        encode_sparse_from_changes("BF16", 10, np.array(idx, np.int64), np.array(diffs, np.uint16))


def test_sparse_from_changes_rejects_a_width_mismatch_and_a_negative_count():
    with pytest.raises(UsageError, match="2-byte"):
        encode_sparse_from_changes("F32", 10, np.array([1]), np.array([1], np.uint16))
    with pytest.raises(UsageError, match="non-negative"):
        encode_sparse_from_changes("F32", -1, np.array([], np.int64), np.array([], np.uint32))


# --- device snapshot -------------------------------------------------------------------------------
def check_diff(diff: DeviceDiff, before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> None:
    """``diff`` is exactly the bit-level change from ``before`` to ``after``, and its byte count adds up."""
    assert list(diff.changes) == list(after)
    moved = 0
    for name, t in after.items():
        ch = diff.changes[name]
        assert (ch.dtype, ch.shape) == (ST_DTYPE[t.dtype], tuple(t.shape))
        new = bits(t)
        prev = before.get(name)
        if prev is None or prev.dtype != t.dtype or prev.shape != t.shape:
            assert ch.index is None and ch.values.tobytes() == new.tobytes()
        elif ch.index is None:  # dense: sent whole
            k = np.count_nonzero(bits(prev) != new)
            assert k * (4 + new.itemsize) >= new.nbytes and ch.values.tobytes() == new.tobytes()
        else:
            expect = np.flatnonzero(bits(prev) != new)
            assert ch.index.dtype == np.int32 and expect.size * (4 + new.itemsize) < new.nbytes
            assert np.array_equal(ch.index, expect) and ch.values.tobytes() == new[expect].tobytes()
            assert ch.values.dtype == new.dtype
        moved += ch.values.nbytes + (0 if ch.index is None else ch.index.nbytes)
    assert diff.d2h_bytes == moved
    assert diff.tensor_bytes == sum(t.nbytes for t in after.values())


def test_first_diff_copies_every_tensor_of_every_dtype():
    sd = {f"t.{d}": random_tensor(d, (3, 5), i) for i, d in enumerate(TORCH_DTYPES)}
    snap = DeviceSnapshot()
    diff = snap.diff(sd)
    check_diff(diff, {}, sd)
    assert diff.d2h_bytes == diff.tensor_bytes and len(snap) == len(sd)
    for t in sd.values():  # the snapshot is a copy, not the live tensors
        t.view(-1).view(torch.uint8)[:1] ^= 1
    check_diff(snap.diff(sd), diff_tensors(diff), sd)


def diff_tensors(diff: DeviceDiff) -> dict[str, torch.Tensor]:
    """The tensors a full diff carried, rebuilt from its bytes."""
    out = {}
    for name, ch in diff.changes.items():
        signed = ch.values.view({1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}[ch.values.itemsize])
        out[name] = torch.from_numpy(signed.copy()).view(TORCH_DTYPE[ch.dtype]).reshape(ch.shape)
    return out


def test_bit_level_changes_that_float_compares_miss_or_invent():
    """NaN payloads, -0.0 vs 0.0, NaN == NaN: compared as bits, not floats."""
    t = torch.zeros(16, dtype=torch.bfloat16)
    set_bits(t, [0, 1, 2, 3], [0x7FC0, 0x7FC0, 0x0000, 0x7F80])
    f = torch.zeros(8, dtype=torch.float32)
    set_bits(f, [0, 1], [0x7FC00000, 0x00000001])
    sd = {"bf16": t, "f32": f}
    snap = DeviceSnapshot()
    before = {k: v.clone() for k, v in sd.items()}
    snap.diff(sd)
    set_bits(t, [0, 1, 2, 3], [0x7FC1, 0x7FC0, 0x8000, 0x7F80])  # NaN payload, same NaN, -0.0, same inf
    set_bits(f, [0, 1, 5], [0xFFC00000, 0x00000002, 0x80000000])  # NaN sign, subnormal, -0.0
    diff = snap.diff(sd)
    check_diff(diff, before, sd)
    assert diff.changes["bf16"].index.tolist() == [0, 2]
    assert diff.changes["bf16"].values.tolist() == [0x7FC1, 0x8000]
    assert diff.changes["f32"].index.tolist() == [0, 1, 5]
    assert snap.diff(sd).d2h_bytes == 0  # the snapshot advanced: nothing changed since


@FAST
@given(
    dtype=st.sampled_from(TORCH_DTYPES),
    n=st.integers(0, 200),
    density=st.floats(0, 1),
    seed=st.integers(0, 2**32 - 1),
    slice_elems=st.sampled_from([1, 7, 64, 1 << 28]),
    staging=st.sampled_from([1, 100, 64 << 20]),
)
def test_diff_matches_numpy_over_dtypes_slices_and_flushes(dtype, n, density, seed, slice_elems, staging):
    rng = np.random.default_rng(seed)
    a = random_tensor(dtype, (n,), seed)
    b = random_tensor(dtype, (2, 3), seed + 1)
    sd = {"a": a, "b": b}
    snap = DeviceSnapshot(slice_elems=slice_elems, staging_bytes=staging)
    snap.diff(sd)
    for _ in range(2):
        before = {k: v.clone() for k, v in sd.items()}
        pos = np.flatnonzero(rng.random(n) < density)
        fresh = ints(random_tensor(dtype, (n,), int(rng.integers(2**31))))
        ints(a)[torch.from_numpy(pos)] = fresh[torch.from_numpy(pos)]
        check_diff(snap.diff(sd), before, sd)


def test_new_reshaped_retyped_and_removed_tensors():
    sd = {
        "keep": random_tensor(torch.float32, (4, 4), 0),
        "shape": random_tensor(torch.bfloat16, (6,), 1),
        "dtype": random_tensor(torch.float16, (3,), 2),
        "gone": random_tensor(torch.int64, (2,), 3),
    }
    snap = DeviceSnapshot()
    snap.diff(sd)
    before = {k: v.clone() for k, v in sd.items()}
    sd2 = {
        "keep": sd["keep"],
        "shape": random_tensor(torch.bfloat16, (2, 3), 1),
        "dtype": random_tensor(torch.bfloat16, (3,), 2),
        "new": random_tensor(torch.uint8, (5,), 4),
    }
    diff = snap.diff(sd2)
    check_diff(diff, before, sd2)
    assert [n for n, c in diff.changes.items() if c.index is None] == ["shape", "dtype", "new"]
    assert len(snap) == 4  # "gone" dropped
    snap.reset()
    assert len(snap) == 0 and all(c.index is None for c in snap.diff(sd2).changes.values())


@FAST
@given(
    dtype=st.sampled_from(TORCH_DTYPES),
    n=st.integers(0, 120),
    density=st.floats(0, 1),
    seed=st.integers(0, 2**32 - 1),
)
def test_restore_undoes_a_diff_from_the_old_values_at_its_positions(dtype, n, density, seed):
    """A rank's part not committed: putting back the old bit patterns at the positions the diff
    moved returns the snapshot to the committed version (the next diff is from it), for sparse and
    dense changes of every dtype; a tensor restored under another dtype or shape is dropped."""
    rng = np.random.default_rng(seed)
    a = random_tensor(dtype, (n,), seed)
    sd = {"a": a, "b": random_tensor(torch.float32, (3,), 1)}
    snap = DeviceSnapshot(slice_elems=16)
    snap.diff(sd)
    committed = {k: v.clone() for k, v in sd.items()}
    old = bits(a).copy()
    pos = np.flatnonzero(rng.random(n) < density)
    ints(a)[torch.from_numpy(pos)] = ints(random_tensor(dtype, (n,), seed + 7))[torch.from_numpy(pos)]
    diff = snap.diff(sd)  # the snapshot now holds the uncommitted state
    moved = np.flatnonzero(old != bits(a))
    snap.restore("a", diff.changes["a"].dtype, (n,), moved, old[moved])
    check_diff(snap.diff(sd), committed, sd)  # from the committed version again
    snap.restore("b", "F16", (3,), np.array([0]), np.array([0], np.uint16))
    snap.drop("a")
    assert len(snap) == 0
    assert all(c.index is None for c in snap.diff(sd).changes.values())


def test_non_contiguous_and_zero_dim_tensors_diff_in_row_major_order():
    base = random_tensor(torch.bfloat16, (5, 7), 0)
    sd = {"t": base.t(), "scalar": torch.tensor(3, dtype=torch.int64), "empty": torch.empty(0, 4)}
    snap = DeviceSnapshot()
    snap.diff(sd)
    before = {k: v.clone() for k, v in sd.items()}
    base[1, 2] = 7.0
    sd["scalar"].fill_(4)
    check_diff(snap.diff(sd), before, sd)


def test_unsupported_values_are_refused():
    with pytest.raises(UsageError, match="not a tensor"):
        DeviceSnapshot().diff({"x": 3})
    with pytest.raises(UsageError, match="cannot be stored"):
        DeviceSnapshot().diff({"x": torch.zeros(2, dtype=torch.complex64)})


# --- host mirror -----------------------------------------------------------------------------------
def dump(sd, tmp_path, metadata=None) -> bytes:
    path = tmp_path / "ref.safetensors"
    save_state_dict(sd, path, metadata)
    return path.read_bytes()


@pytest.mark.parametrize("in_place", [True, False])
def test_mirror_patches_to_what_save_state_dict_writes(tmp_path, in_place):
    sd = {
        "a": random_tensor(torch.bfloat16, (64, 8), 0),
        "b": random_tensor(torch.float32, (10,), 1),
        "e": torch.empty(0, 3, dtype=torch.float16),
    }
    snap, mirror = DeviceSnapshot(), HostMirror(tmp_path / "work")
    (tmp_path / "work").mkdir()
    mf, deltas = mirror.write(snap.diff(sd), None, in_place)
    assert deltas == {}
    assert (mf.folder / "model.safetensors").read_bytes() == dump(sd, tmp_path)
    mirror.advance(mf, 0)
    old_bytes = dump(sd, tmp_path)
    set_bits(sd["a"], [0, 5, 511], [0x7FC1, 0x8000, 1])
    sd["b"][3] = -0.0
    mf2, deltas = mirror.write(snap.diff(sd), None, in_place)
    assert (mf2.folder == mf.folder) == in_place
    assert (mf2.folder / "model.safetensors").read_bytes() == dump(sd, tmp_path)
    assert deltas["a"][0].tolist() == [0, 5, 511] and deltas["e"][0].size == 0
    mirror.discard(mf2)  # not published: the mirror is the previous version again
    assert (mf.folder / "model.safetensors").read_bytes() == old_bytes
    assert mf2.folder.exists() == in_place


def test_mirror_rebuilds_when_the_layout_changes(tmp_path):
    sd = {"a": random_tensor(torch.bfloat16, (8, 8), 0), "b": random_tensor(torch.float32, (10,), 1)}
    snap, mirror = DeviceSnapshot(), HostMirror(tmp_path)
    mf, _ = mirror.write(snap.diff(sd), None, True)
    mirror.advance(mf, 0)
    sd = {"a": sd["a"], "c": random_tensor(torch.int8, (3,), 2)}
    sd["a"][0, 0] = 1.5
    diff = snap.diff(sd)
    mf2, deltas = mirror.write(diff, {"step": "1"}, True)
    assert mf2.folder != mf.folder
    assert (mf2.folder / "model.safetensors").read_bytes() == dump(sd, tmp_path, {"step": "1"})
    assert set(deltas) == {"a"} and deltas["a"][0].tolist() == diff.changes["a"].index.tolist()
    mirror.advance(mf2, 1)
    assert not mf.folder.exists()
    bogus = DeviceDiff({"a": TensorChange("BF16", (9,), np.array([0], np.int32), np.array([1], np.uint16))}, 0, 0)
    with pytest.raises(UsageError, match="does not hold"):
        mirror.write(bogus, None, False)


def test_clone_file_copies_exactly(tmp_path):
    src = tmp_path / "src"
    data = np.random.default_rng(0).integers(0, 256, (3 << 20) + 5, dtype=np.uint8).tobytes()
    src.write_bytes(data)
    clone_file(src, tmp_path / "dst")
    assert (tmp_path / "dst").read_bytes() == data
    (tmp_path / "empty").write_bytes(b"")
    clone_file(tmp_path / "empty", tmp_path / "dst2")
    assert (tmp_path / "dst2").read_bytes() == b""


def test_layouts_agree_with_safetensors(tmp_path):
    """The mirror's rebuild and save_state_dict serialize through the same safetensors call."""
    sd = {n: random_tensor(d, (2,), i) for i, (n, d) in enumerate((f"x{k}", d) for k, d in enumerate(TORCH_DTYPES))}
    save_file({k: v.contiguous() for k, v in sd.items()}, str(tmp_path / "a.safetensors"), metadata={"format": "pt"})
    mf, _ = HostMirror(tmp_path).write(DeviceSnapshot().diff(sd), None)
    assert (mf.folder / "model.safetensors").read_bytes() == (tmp_path / "a.safetensors").read_bytes()


# --- CUDA (run wherever a GPU is present) ------------------------------------------------------------
@cuda
def test_cuda_diff_equals_the_cpu_diff_and_moves_only_changes():
    sd = {f"t.{d}": random_tensor(d, (257, 31), i) for i, d in enumerate(TORCH_DTYPES)}
    gpu = {k: v.cuda() for k, v in sd.items()}
    cpu_snap, gpu_snap = DeviceSnapshot(), DeviceSnapshot(slice_elems=1000, staging_bytes=4096)
    cpu_snap.diff(sd)
    assert gpu_snap.diff(gpu).d2h_bytes == sum(t.nbytes for t in sd.values())
    rng = np.random.default_rng(0)
    for step in range(3):
        for name, t in sd.items():
            pos = torch.from_numpy(np.flatnonzero(rng.random(t.numel()) < 0.03))
            ints(t)[pos] = ints(random_tensor(t.dtype, (t.numel(),), step))[pos]
            gpu[name].copy_(t)
        a, b = cpu_snap.diff(sd), gpu_snap.diff(gpu)
        assert a.d2h_bytes == b.d2h_bytes < b.tensor_bytes
        for name in sd:
            ca, cb = a.changes[name], b.changes[name]
            assert np.array_equal(ca.index, cb.index) and ca.values.tobytes() == cb.values.tobytes()
