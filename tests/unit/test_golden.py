"""Golden fixtures: today's code must still rebuild the committed checkpoints from the committed store.

The store in tests/fixtures/golden/store was written by tests/fixtures/make_golden.py. Only
decoding is the contract: encoding today's checkpoints may give other bytes (zstd versions differ).
Tests copy the store to a temporary directory first and never write into the fixture.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import xxhash

import weightsync
from weightsync.codec import decode_tensor, registry
from weightsync.codec.payload import decode_tensor_backward
from weightsync.errors import FormatError
from weightsync.format.keys import HEAD_KEY, MARKER_KEY, chunk_key, parse_version_key, version_key
from weightsync.format.manifest import check_marker, head_from_json, manifest_from_json

GOLDEN = Path(__file__).resolve().parents[1] / "fixtures" / "golden"
EXPECTED = json.loads((GOLDEN / "expected.json").read_text())
VERSIONS = sorted(int(v) for v in EXPECTED["versions"])
STATE_DIR = ".weightsync"


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def content(root: Path) -> dict[str, str]:
    """relpath -> sha256 of every file outside ``.weightsync``."""
    return {
        p.relative_to(root).as_posix(): sha256(p)
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.relative_to(root).parts[0] != STATE_DIR
    }


def checkpoint(version: int) -> Path:
    return GOLDEN / "checkpoints" / f"step_{version}"


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    """A private copy of the golden store, as a file:// URL."""
    root = tmp_path_factory.mktemp("golden") / "store"
    shutil.copytree(GOLDEN / "store", root)
    return f"file://{root}"


@pytest.fixture(scope="module")
def manifests() -> dict:
    return {v: manifest_from_json((GOLDEN / "store" / version_key(v)).read_bytes()) for v in VERSIONS}


def assert_holds(out: Path, version: int) -> None:
    expected = EXPECTED["versions"][str(version)]["files"]
    assert content(out) == expected, f"{out} does not hold version {version}"
    hidden = {p.name for p in out.iterdir() if p.name.startswith(".")}
    assert hidden <= {STATE_DIR}


# --- the fixture itself ----------------------------------------------------------------------------
@pytest.mark.parametrize("version", VERSIONS)
def test_committed_checkpoints_are_intact(version):
    assert content(checkpoint(version)) == EXPECTED["versions"][str(version)]["files"]


def test_fixture_is_small():
    assert sum(p.stat().st_size for p in GOLDEN.rglob("*") if p.is_file()) < 1 << 20


def test_store_layout_follows_the_format(manifests):
    root = GOLDEN / "store"
    check_marker((root / MARKER_KEY).read_bytes())
    assert head_from_json((root / HEAD_KEY).read_bytes()) == VERSIONS[-1]
    keys = {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}
    versions = {parse_version_key(k) for k in keys if k.startswith("versions/")}
    assert versions == set(VERSIONS)
    referenced = {c.id for m in manifests.values() for c in m.chunks}
    chunk_keys = {k for k in keys if k.startswith("chunks/")}
    assert chunk_keys == {chunk_key(c) for c in referenced}
    assert keys == chunk_keys | {version_key(v) for v in VERSIONS} | {MARKER_KEY, HEAD_KEY}
    for m in manifests.values():
        for c in m.chunks:  # content addressed: the name is the XXH3-128 of the bytes
            data = (root / chunk_key(c.id)).read_bytes()
            assert len(data) == c.size and xxhash.xxh3_128_hexdigest(data) == c.id


def test_manifests_describe_the_trajectory(manifests):
    for v, m in manifests.items():
        exp = EXPECTED["versions"][str(v)]
        assert (m.version, m.parent, m.keyframe) == (v, exp["parent"], exp["keyframe"])
        assert sorted(f.path for f in m.files) == sorted(exp["files"])
        assert m.chain_length == (0 if m.keyframe else manifests[m.parent].chain_length + 1)
    codecs = {s.codec for m in manifests.values() for f in m.files for s in f.segments}
    deltas = {s.delta.codec for m in manifests.values() for f in m.files for s in f.segments if s.delta}
    assert codecs == {"full", "sparse", "dense", "same"} and {"sparse", "same"} <= deltas
    assert any(len(s.payload.parts) > 1 for m in manifests.values() for f in m.files for s in f.segments if s.payload)


# --- decoding, segment by segment, straight from the chunks ----------------------------------------------
def _payload_bytes(m, payload) -> bytes:
    buf = b"".join(
        (GOLDEN / "store" / chunk_key(m.chunks[p.chunk].id)).read_bytes()[p.offset : p.offset + p.length]
        for p in payload.parts
    )
    assert len(buf) == payload.size and xxhash.xxh3_128_hexdigest(buf) == payload.xxh3
    return buf


def _segment_bytes(version: int, path: str, seg) -> np.ndarray:
    data = (checkpoint(version) / path).read_bytes()[seg.begin : seg.end]
    return np.frombuffer(data, dtype=np.uint8)


@pytest.mark.parametrize("version", VERSIONS)
def test_every_payload_decodes_to_the_checkpoint_bytes(manifests, version):
    m = manifests[version]
    parent = manifests.get(m.parent) if m.parent is not None else None
    checked = 0
    for f in m.files:
        assert sha256(checkpoint(version) / f.path) == EXPECTED["versions"][str(version)]["files"][f.path]
        whole = (checkpoint(version) / f.path).read_bytes()
        assert len(whole) == f.size and xxhash.xxh3_128_hexdigest(whole) == f.xxh3
        for s in f.segments:
            new = _segment_bytes(version, f.path, s)
            assert xxhash.xxh3_128_hexdigest(new) == s.xxh3
            encodings = [(s.codec, s.payload)] + ([(s.delta.codec, s.delta.payload)] if s.delta else [])
            for codec, payload in encodings:
                old = None
                if codec != "full":
                    pseg = next(p for p in parent.file(f.path).segments if p.key == s.key)
                    old = _segment_bytes(parent.version, f.path, pseg)
                data = b"" if payload is None else _payload_bytes(m, payload)
                out = decode_tensor(s.dtype, codec, data, old, s.nbytes, what=f"v{version} {f.path} {s.name}")
                assert out.tobytes() == new.tobytes()
                checked += 1
    assert checked >= sum(len(f.segments) for f in m.files)


# --- decoding through the public API ---------------------------------------------------------------------
@pytest.mark.parametrize("version", VERSIONS)
def test_fresh_pull_of_every_version(store, tmp_path, version):
    out = tmp_path / "replica"
    result = weightsync.pull(store, out, version)
    assert result.version == version and result.from_version is None
    assert_holds(out, version)


@pytest.mark.parametrize(
    "path",
    [
        VERSIONS,  # forward, one version at a time
        list(reversed(VERSIONS)),  # rollbacks
        [VERSIONS[1], VERSIONS[3], VERSIONS[0], VERSIONS[2], VERSIONS[2], VERSIONS[1]],  # across keyframes, repeats
    ],
    ids=["forward", "backward", "mixed"],
)
def test_incremental_pulls(store, tmp_path, path):
    out = tmp_path / "replica"
    prev = None
    for version in path:
        result = weightsync.pull(store, out, version)
        assert result.version == version and result.from_version == prev
        assert_holds(out, version)
        prev = version


def test_pull_latest_and_verify(store, tmp_path):
    out = tmp_path / "replica"
    weightsync.pull(store, out)
    assert_holds(out, VERSIONS[-1])
    assert weightsync.verify(store, out) == VERSIONS[-1]
    info = weightsync.versions(store)
    assert [i.version for i in info] == VERSIONS
    assert [i.keyframe for i in info] == [EXPECTED["versions"][str(v)]["keyframe"] for v in VERSIONS]


def test_fixture_is_untouched_by_the_tests():
    """The tests above work on a copy: the committed store still matches its own manifests."""
    root = GOLDEN / "store"
    assert not (root / ".lock").exists()
    assert {p.name for p in root.iterdir()} == {"HEAD", "weightsync.json", "versions", "chunks"}


@pytest.mark.parametrize("fixture", ["ac", "ans", "ans-derived", "ans-wide", "ans-nibbles", "ans-apart"])
def test_committed_entropy_coded_payload_still_decodes(fixture):
    """The entropy coders' byte layouts must not drift: a payload made when the codec was added (2
    blocks of a bf16 tensor) must decode to the recorded bytes; ``ans``'s backward too, and so must
    ``ans``'s payload of the same step in its later layouts (coded exception lists and escape
    orders; nibble-coded buckets and the list carried by the sections' states), a step of small
    changes in its third (exceptions derived from the new values), a step that changes every element
    in its fourth (a wide rANS section, 32 states; then with carried bytes) and a step of a base
    taken 4 times over whose nibble section is wide; then the exception lists apart, in a reverse
    payload that only the backward decode reads, and the Rice sections' first bytes carried by the
    states (``ans-apart``)."""
    import zstandard

    d = GOLDEN / fixture
    spec = json.loads((d / "expected.json").read_text())
    codec = spec["codec"]
    base = GOLDEN / spec.get("base", f"{codec}/old.bin.zst")
    old = np.frombuffer(zstandard.ZstdDecompressor().decompress(base.read_bytes()), dtype=np.uint8)
    old = np.tile(old, spec.get("repeat", 1))  # a larger block from the same base
    for name in spec.get("payloads", ["payload.bin"]):  # ans: its first layout and today's
        payload = (d / name).read_bytes()
        out = decode_tensor(spec["dtype"], spec["codec"], payload, old, spec["nbytes"])
        assert hashlib.sha256(out.tobytes()).hexdigest() == spec["sha256_new"], name
        assert np.count_nonzero(out.view("<u2") != old.view("<u2")) == spec["changed"]
        if registry.get(codec).invertible:  # ans: backward too (with its reverse payload, where it has one)
            rev = spec.get("reverses", {}).get(name)
            reverse = (d / rev).read_bytes() if rev else b""
            back = decode_tensor_backward(spec["dtype"], codec, payload, out, spec["nbytes"], reverse=reverse)
            assert np.array_equal(back, old)
            if reverse:  # without it, refused (its exceptions' old buckets are unknown), never other bytes
                with pytest.raises(FormatError):
                    decode_tensor_backward(spec["dtype"], codec, payload, out, spec["nbytes"])
