"""Hostile and damaged stores: what a subscriber reads is untrusted, so a store crafted to escape the
target folder, exhaust memory, or make it serve other bytes than the publisher's must be refused
with a clear error, never followed.

Stores are crafted by editing a real store's objects (raw JSON, content-addressed chunks written by
hand). Every refusal must be a ``WeightsyncError`` whose message names the object; nothing may be
written outside the target folder (the whole temporary tree is compared before and after); a folder
that already held a version keeps it. The end-to-end fuzzer's harness is ``benchmarks/fuzz.py``
(its long run: ``python benchmarks/fuzz.py``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import sys
from pathlib import Path

import numpy as np
import pytest
import xxhash
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_daemons import Daemon, wait_for

import weightsync
from weightsync.codec.payload import MAGIC
from weightsync.demo import SyntheticTrainer
from weightsync.errors import ChecksumError, FormatError, NotFoundError, UsageError, VersionError, WeightsyncError
from weightsync.format.keys import chunk_key, version_key
from weightsync.format.manifest import manifest_checksum
from weightsync.local.checkpoint import scan_checkpoint
from weightsync.store import MemoryStore
from weightsync.sync.plan import plan_pull
from weightsync.sync.pull import PullConfig
from weightsync.sync.selection import Selection, materialize

_FUZZ = Path(__file__).resolve().parents[2] / "benchmarks" / "fuzz.py"
_spec = importlib.util.spec_from_file_location("weightsync_bench_fuzz", _FUZZ)
fuzz = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = fuzz  # dataclasses look their module up by name
_spec.loader.exec_module(fuzz)

NOFSYNC = PullConfig(fsync=False, decode_threads=2)


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> fuzz.World:
    """Versions 0..4 of a tiny two-shard model (keyframes 0, 2, 4), a replica of each version."""
    return fuzz.build_world(tmp_path_factory.mktemp("hostile") / "world")


@pytest.fixture
def damaged(world):
    """The world, restored to its pristine objects after the test."""
    world.restore()
    yield world
    world.restore()


def manifest(world, v: int) -> dict:
    return json.loads(world.objects[version_key(v)])


def write_manifest(world, v: int, doc: dict, seal: bool = True) -> None:
    """Store a hand-made manifest; ``seal`` gives it a valid checksum, as a hostile writer would."""
    if seal and isinstance(doc, dict):
        doc = {**doc, "checksum": manifest_checksum(doc)}
    (world.store / version_key(v)).write_bytes(json.dumps(doc).encode())


def edit_manifest(world, v: int, fn, seal: bool = True) -> None:
    doc = manifest(world, v)
    fn(doc)
    write_manifest(world, v, doc, seal)


def put_object(world, key: str, data: bytes) -> None:
    path = world.store / key
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def put_chunk(world, data: bytes) -> str:
    cid = xxhash.xxh3_128_hexdigest(data)
    put_object(world, chunk_key(cid), data)
    return cid


def pull(world, out: Path, version="latest"):
    return weightsync.pull(world.store, out, version, config=NOFSYNC)


def files(folder: Path) -> dict[str, str]:
    return {p: h for p, h in fuzz.tree(folder, skip_state=True).items() if h != "<dir>"}


def refused(world, out: Path, version, error=WeightsyncError) -> WeightsyncError:
    """Pull ``version`` into ``out``: it must fail with ``error``, write nothing anywhere but
    ``out/.weightsync``, and leave ``out``'s files as they were."""
    before_all = fuzz.tree(world.root)
    before = files(out) if out.exists() else {}
    with pytest.raises(error) as info:
        pull(world, out, version)
    after_all = fuzz.tree(world.root)
    rel = out.relative_to(world.root).as_posix() if out.is_relative_to(world.root) else None
    outside = lambda t: {p: h for p, h in t.items() if rel is None or not (p == rel or p.startswith(rel + "/"))}  # noqa: E731
    assert outside(after_all) == outside(before_all), "the pull wrote outside its target folder"
    assert (files(out) if out.exists() else {}) == before, "the refused pull changed the folder"
    return info.value


# --- damaged objects: detected, named, never served ---------------------------------------------------
def _chunk_of(world, v: int, i: int = 0) -> str:
    return chunk_key(manifest(world, v)["chunks"][i]["id"])


def _needed_chunk(world, incremental: bool) -> str:
    """The first chunk a pull of version 4 reads (fresh: keyframe payloads; from 3: its deltas)."""
    repo = weightsync.open_repo(world.store)
    local = repo.manifest(3) if incremental else None
    plan = plan_pull(repo.chain(4, back_to=3 if incremental else None), local, set())
    return chunk_key(plan.chunks[0].chunk.id)


def _damage_chunk(how: str):
    def damage(w, incremental):
        key = _needed_chunk(w, incremental)
        data = w.objects[key]
        path = w.store / key
        if how == "missing":
            path.unlink()
        elif how == "swapped":
            path.write_bytes(next(d for k, d in sorted(w.objects.items()) if k.startswith("chunks/") and k != key))
        else:
            path.write_bytes(
                data[:100] + bytes([data[100] ^ 1]) + data[101:] if how == "corrupted" else data[: len(data) // 2]
            )
        return key

    return damage


def _damage_object(key: str, data):
    def damage(w, incremental):
        (w.store / key).unlink()
        if data is not None:
            (w.store / key).write_bytes(data(w))
        return key if key != version_key(4) or data is not None else "version 4"

    return damage


DAMAGE = {
    "chunk corrupted": (_damage_chunk("corrupted"), ChecksumError),
    "chunk truncated": (_damage_chunk("truncated"), ChecksumError),
    "chunk missing": (_damage_chunk("missing"), NotFoundError),
    "chunks swapped": (_damage_chunk("swapped"), ChecksumError),
    "manifest not JSON": (_damage_object(version_key(4), lambda w: w.objects[version_key(4)][:-7]), FormatError),
    "manifest missing": (_damage_object(version_key(4), None), VersionError),
    "manifests swapped": (_damage_object(version_key(4), lambda w: w.objects[version_key(3)]), FormatError),
    "head garbage": (_damage_object("HEAD", lambda w: b'{"format": "weightsync.head", "version": -4}'), FormatError),
}


@pytest.mark.parametrize("incremental", [False, True], ids=["fresh", "incremental"])
@pytest.mark.parametrize("case", list(DAMAGE))
def test_damaged_store_objects_are_detected_named_and_never_served(case, incremental, damaged, tmp_path):
    world = damaged
    damage, error = DAMAGE[case]
    out = world.root / f"out-{case.replace(' ', '-')}-{incremental}"
    shutil.rmtree(out, ignore_errors=True)
    if incremental:
        shutil.copytree(world.replicas[3], out)
    name = damage(world, incremental)
    exc = refused(world, out, "latest", error)
    assert name in str(exc), f"the error does not name {name}: {exc}"
    assert "\n" not in str(exc)
    if incremental:
        assert files(out) == world.expected[3]
    shutil.rmtree(out, ignore_errors=True)


def _remote(world) -> weightsync.Repo:
    """The world's objects in a memory store: like S3, it has no local files, so a pull downloads
    each chunk (whole, checked against its id, or by ranges, checked by payload) into the spool."""
    store = MemoryStore()
    for key, data in world.objects.items():
        store.put(key, data)
    return weightsync.open_repo(store)


def _flip_byte(repo, chunk_id: str, offset: int) -> str:
    """One bit of a chunk flipped, its length kept; returns the chunk's key."""
    key = chunk_key(chunk_id)
    data = bytearray(repo.store.get(key))
    data[offset] ^= 1
    repo.store.put(key, bytes(data))
    return key


@pytest.mark.parametrize("back_to", [None, 3], ids=["fresh", "incremental"])
def test_a_corrupt_chunk_downloaded_whole_is_refused_by_its_id(back_to, world, tmp_path):
    """A chunk of the right length whose bytes differ from its id (its XXH3-128) never enters the
    spool: the pull fails with a ChecksumError naming the chunk, and the folder keeps what it held."""
    repo = _remote(world)
    out = tmp_path / "out"
    if back_to is not None:
        shutil.copytree(world.replicas[back_to], out)
    plan = plan_pull(repo.chain(4, back_to=back_to), None if back_to is None else repo.manifest(back_to), set())
    need = plan.chunks[0]
    assert need.whole()
    key = _flip_byte(repo, need.chunk.id, need.chunk.size // 2)
    with pytest.raises(ChecksumError) as info:
        weightsync.pull(repo, out, 4, config=NOFSYNC)
    assert info.value.expected == need.chunk.id and key in str(info.value), info.value
    assert "\n" not in str(info.value)
    assert files(out) == ({} if back_to is None else world.expected[back_to])
    assert not (out / ".weightsync" / "spool" / need.chunk.id).exists()


def test_a_huge_object_under_a_chunk_key_is_refused_without_reading_it_whole(world, tmp_path, monkeypatch):
    """An object far larger than the chunk its key names (a planted 400 MiB object for an 8 KiB chunk)
    was read whole into memory before its size was checked; 32 fetches in flight could exhaust it.
    One byte more than the chunk is read, and the pull is refused naming the chunk."""
    repo = _remote(world)
    plan = plan_pull(repo.chain(4), None, set())
    need = plan.chunks[0]
    key = chunk_key(need.chunk.id)
    repo.store.put(key, b"\0" * (need.chunk.size * 64 + 4096))
    read: list[int] = []
    real = MemoryStore.get_range
    real_get = MemoryStore.get
    monkeypatch.setattr(MemoryStore, "get", lambda self, k: pytest.fail(k) if k == key else real_get(self, k))
    monkeypatch.setattr(
        MemoryStore, "get_range", lambda self, k, s, n: read.append(n) or real(self, k, s, n)
    )  # get_at_most's
    with pytest.raises(ChecksumError, match=f"more than {need.chunk.size} bytes") as info:
        weightsync.pull(repo, tmp_path / "out", 4, config=NOFSYNC)
    assert key in str(info.value) and max(read) <= max(c.chunk.size for c in plan.chunks) + 1


def test_a_corrupt_range_of_a_chunk_is_refused_by_its_payload_checksum(world, tmp_path):
    """A chunk fetched by byte ranges cannot be checked against its id: the payload read from the
    ranges is checked against its own xxh3 before it is decoded, and the error names the chunk."""
    repo = _remote(world)
    out = tmp_path / "out"
    shutil.copytree(world.replicas[2], out)
    plan = plan_pull(repo.chain(4, back_to=2), repo.manifest(2), set())
    need = next(n for n in plan.chunks if not n.whole())
    offset, length = need.ranges[0]
    key = _flip_byte(repo, need.chunk.id, offset + length // 2)
    with pytest.raises(ChecksumError) as info:
        weightsync.pull(repo, out, 4, config=NOFSYNC)
    assert key in str(info.value) and "payload" in str(info.value), info.value
    assert files(out) == world.expected[2]


@pytest.mark.parametrize("how", ["a file path altered", "a file dropped"])
def test_a_damaged_manifest_that_still_parses_is_detected(how, damaged):
    """One changed byte in a path, or one file entry gone, leaves a manifest that still parses as
    another folder's; the manifest's own checksum catches it. (Version 4 is a keyframe: every file
    is rebuilt from its own payloads.)"""
    world = damaged

    def edit(doc):
        if how == "a file path altered":
            f = next(f for f in doc["files"] if f["path"] == "config.json")
            f["path"] = "conf1g.json"
        else:
            doc["files"] = [f for f in doc["files"] if f["path"] != "config.json"]

    edit_manifest(world, 4, edit, seal=False)  # damage, not a forger: the checksum is stale
    out = world.root / "out-parses"
    shutil.rmtree(out, ignore_errors=True)
    try:
        pull(world, out, 4)
    except WeightsyncError as exc:
        assert version_key(4) in str(exc) or "version 4" in str(exc), exc
        return
    finally:
        got = files(out) if out.exists() else {}
        shutil.rmtree(out, ignore_errors=True)
    assert got == world.expected[4], (
        f"served a folder that is not version 4 ({how}): {sorted(set(got) ^ set(world.expected[4]))}"
    )


# --- paths that try to escape ---------------------------------------------------------------------------
HOSTILE_PATHS = [
    "../evil.json",
    "../../evil.json",
    "{abs}",
    "a/../../evil.json",
    ".weightsync/state.json",
    "..\\..\\evil.json",
    "evil\x00.json",
    "",
    "a//b.json",
    "./config.json",
    "config.json/../../evil.json",
]


@pytest.mark.parametrize("path", HOSTILE_PATHS, ids=lambda p: repr(p))
def test_file_paths_that_escape_the_folder_are_refused(path, damaged):
    world = damaged
    path = path.replace("{abs}", str(world.root.parent / "abs-evil.json"))

    def edit(doc):
        next(f for f in doc["files"] if f["path"] == "config.json")["path"] = path

    edit_manifest(world, 4, edit)
    out = world.root / "out-paths"
    exc = refused(world, out, 4, FormatError)
    assert "unsafe file path" in str(exc), exc
    assert not (world.root.parent / "abs-evil.json").exists() and not (world.root.parent / "evil.json").exists()
    shutil.rmtree(out, ignore_errors=True)


DEEP_MANIFESTS = {  # a manifest planted by hand -> what the one-line error says
    "2000-component path": (lambda doc: doc["files"][0].update(path="/".join(["a"] * 2000)), "over 255 components"),
    "256-component path": (lambda doc: doc["files"][0].update(path="/".join(["a"] * 256)), "over 255 components"),
    "component over NAME_MAX": (
        lambda doc: doc["files"][0].update(path="a/" + "b" * 256),
        "a component over 255 bytes",
    ),
    "deep JSON": (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    "deep stats": (lambda doc: doc.update(stats={"x": json.loads("[" * 100 + "]" * 100)}), "nested more than 32 deep"),
}


@pytest.mark.parametrize("case", list(DEEP_MANIFESTS))
def test_a_too_deep_manifest_is_a_one_line_error_from_the_cli(case, damaged, run_cli, ws):
    """Paths a file system cannot hold and JSON nested too deeply: a clear FormatError, no RecursionError."""
    world = damaged
    edit, why = DEEP_MANIFESTS[case]
    if isinstance(edit, bytes):
        put_object(world, version_key(4), edit)
    else:
        edit_manifest(world, 4, edit)
    before = fuzz.tree(world.root)
    out = world.root / "out-deep"
    rc, _, stderr = run_cli("pull", "--store", f"file://{world.store}", "--version", 4, out)
    assert rc != 0 and "Traceback" not in stderr and "RecursionError" not in stderr, stderr
    line = ws.error_line(stderr)
    assert why in line and version_key(4) in line and len(line) < 400, line
    after = fuzz.tree(world.root)
    assert {p: h for p, h in after.items() if not p.startswith(out.name)} == {
        p: h for p, h in before.items() if not p.startswith(out.name)
    }
    assert not any(p.startswith(f"{out.name}/a") for p in after), "the refused pull created folders"
    shutil.rmtree(out, ignore_errors=True)


def test_an_unsafe_path_error_names_the_manifest(damaged):
    world = damaged
    edit_manifest(world, 4, lambda d: d["files"][0].update(path="../evil.json"))
    exc = refused(world, world.root / "out-paths", 4, FormatError)
    assert version_key(4) in str(exc), f"the error does not name the manifest: {exc}"


def test_symlinked_chunk_pointing_outside_the_store_is_not_trusted(damaged):
    world = damaged
    key = _chunk_of(world, 4)
    outside = world.root / "outside-secret.bin"
    outside.write_bytes(b"not the chunk" * 100)
    (world.store / key).unlink()
    os.symlink(outside, world.store / key)
    out = world.root / "out-symlink-chunk"
    exc = refused(world, out, 4, ChecksumError)
    assert key in str(exc)
    assert outside.read_bytes() == b"not the chunk" * 100
    outside.unlink()
    shutil.rmtree(out, ignore_errors=True)


def test_symlinked_directory_planted_in_the_target_is_not_written_through(world, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(world.replicas[3], out)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("mine")
    os.symlink(outside, out / "sub")
    before = fuzz.tree(tmp_path)
    with pytest.raises(UsageError, match="did not put there"):
        pull(world, out, 4)
    assert fuzz.tree(tmp_path) == before


def test_a_planted_state_directory_symlink_is_not_written_through(world, tmp_path):
    """``.weightsync`` replaced by a link to another folder: the pull must not put its staging
    area, journal and state there."""
    out = tmp_path / "out"
    shutil.copytree(world.replicas[3], out)
    outside = tmp_path / "outside"
    shutil.move(out / ".weightsync", outside)
    os.symlink(outside, out / ".weightsync")
    before = fuzz.tree(outside)
    try:
        pull(world, out, 4)
    except WeightsyncError:
        pass
    assert fuzz.tree(outside) == before, "weightsync wrote through a symlinked .weightsync"


# --- absurd sizes and counts ------------------------------------------------------------------------------
def test_an_absurd_declared_size_is_a_clear_error_not_an_allocation(damaged):
    """A blob declared 1 TiB (its payload is the real, tiny one): refused before allocating."""
    world = damaged
    n = 1 << 40

    def edit(doc):
        f = next(f for f in doc["files"] if f["path"] == "config.json")
        seg = f["segments"][0]
        f["size"], seg["shape"], seg["end"] = n, [n], n

    edit_manifest(world, 4, edit)
    exc = refused(world, world.root / "out-huge", 4, WeightsyncError)
    assert "config.json" in str(exc)


def _full_payload(block: bytes, n: int) -> bytes:
    head = (
        MAGIC + bytes([1, 1]) + b"\0\0" + n.to_bytes(8, "little") + n.to_bytes(8, "little") + (1).to_bytes(4, "little")
    )
    return head + len(block).to_bytes(8, "little") + block


@pytest.mark.parametrize("frame", ["declares 64 MiB", "declares nothing"])
def test_decompression_bombs_are_refused_by_declared_size(frame, damaged):
    """config.json's payload replaced by a well-formed one whose zstd frame inflates to 64 MiB (or
    does not say its size): the checksums match the crafted payload, the declared sizes do not."""
    world = damaged
    doc = manifest(world, 4)
    entry = next(f for f in doc["files"] if f["path"] == "config.json")
    n = entry["size"]
    if frame == "declares 64 MiB":
        block = zstandard.ZstdCompressor(level=1, write_content_size=True).compress(b"\0" * (64 << 20))
    else:
        block = zstandard.ZstdCompressor(level=1, write_content_size=False).compress(b"{}" * (n // 2))
    payload = _full_payload(block, n)
    cid = put_chunk(world, payload)
    doc["chunks"].append({"id": cid, "size": len(payload)})
    entry["segments"][0]["payload"] = {
        "size": len(payload),
        "xxh3": xxhash.xxh3_128_hexdigest(payload),
        "parts": [[len(doc["chunks"]) - 1, 0, len(payload)]],
    }
    write_manifest(world, 4, doc)
    exc = refused(world, world.root / "out-bomb", 4, FormatError)
    assert "frame declares" in str(exc) and "config.json" in str(exc), exc


def test_absurd_counts_of_chunks_and_sizes_of_chunks(damaged):
    """100 000 declared chunks nobody uses and a chunk declared 1 PiB: only what the segments
    reference is read, every payload is checked, the folder is version 4 byte for byte."""
    world = damaged

    def edit(doc):
        doc["chunks"][0]["size"] = 1 << 50
        doc["chunks"] += [{"id": f"{i:032x}", "size": 1 << 40} for i in range(100_000)]

    edit_manifest(world, 4, edit)
    out = world.root / "out-counts"
    try:
        pull(world, out, 4)
        assert files(out) == world.expected[4]
    except WeightsyncError as exc:
        assert version_key(4) in str(exc) or "chunks/" in str(exc)
    finally:
        shutil.rmtree(out, ignore_errors=True)


# --- versions out of order ----------------------------------------------------------------------------------
def test_non_monotonic_versions_are_refused(damaged):
    world = damaged
    edit_manifest(world, 4, lambda d: d.update(parent=4))  # its own parent
    exc = refused(world, world.root / "out-order", 4, FormatError)
    assert "parent" in str(exc) and version_key(4) in str(exc)
    world.restore()
    edit_manifest(world, 3, lambda d: d.update(version=5))  # a manifest claiming another number
    exc = refused(world, world.root / "out-order", 3, FormatError)
    assert "claims version 5" in str(exc) and version_key(3) in str(exc)
    world.restore()
    put_object(world, "HEAD", json.dumps({"format": "weightsync.head", "version": 9}).encode())  # no manifest 9
    exc = refused(world, world.root / "out-order", "latest", VersionError)
    assert "version 9" in str(exc)


def test_a_head_moved_backwards_serves_a_whole_older_version(damaged, tmp_path):
    """The head goes from 4 back to 2 (a repair, or a hostile store): a replica of 4 following the
    head becomes version 2 byte for byte, through the journal; never a mix."""
    world = damaged
    out = tmp_path / "out"
    shutil.copytree(world.replicas[4], out)
    put_object(world, "HEAD", json.dumps({"format": "weightsync.head", "version": 2}).encode())
    assert pull(world, out).version == 2
    assert files(out) == world.expected[2]


# --- safetensors headers that lie ---------------------------------------------------------------------------------
def test_a_manifest_that_relabels_tensors_is_not_served_under_the_false_names(damaged, tmp_path):
    """Version 4's manifest swaps the names of two tensors of equal shape in one shard, so the table
    of tensors disagrees with the (checksummed) safetensors header it came with. A full pull copies
    the header and serves the right file; a partial pull names tensors from the manifest and must
    not serve experts.0.gate_proj's bytes as experts.1.up_proj."""
    world = damaged
    shard = "model-00001-of-00002.safetensors"
    a, b = "model.layers.0.mlp.experts.0.gate_proj.weight", "model.layers.0.mlp.experts.1.up_proj.weight"

    def edit(doc):
        segs = {s["name"]: s for s in next(f for f in doc["files"] if f["path"] == shard)["segments"]}
        assert segs[a]["shape"] == segs[b]["shape"]
        segs[a]["name"], segs[b]["name"] = b, a

    edit_manifest(world, 4, edit)
    full = tmp_path / "full"
    try:
        pull(world, full, 4)
        assert files(full) == world.expected[4]
    except WeightsyncError:
        pass
    part = tmp_path / "part"
    repo = weightsync.open_repo(world.store)
    try:
        materialize(repo, part, 4, Selection(include=(b,)), config=PullConfig(decode_threads=2, fsync=False))
    except WeightsyncError as exc:
        assert version_key(4) in str(exc) or shard in str(exc), exc
        return
    src = next(f for f in scan_checkpoint(world.replicas[4]) if f.path == shard)
    truth = {
        s.name: (world.replicas[4] / shard).read_bytes()[s.begin : s.end] for s in src.segments if s.role == "tensor"
    }
    got = next(f for f in scan_checkpoint(part) if f.path == shard)
    served = {s.name: (part / shard).read_bytes()[s.begin : s.end] for s in got.segments if s.role == "tensor"}
    assert served[b] == truth[b], "served another tensor's bytes under the name " + b


def test_publisher_refuses_a_checkpoint_whose_header_lies_and_keeps_the_store(tmp_path):
    """The trainer drops a checkpoint whose safetensors header declares more bytes than the file
    has: the publisher reports it by name and publishes nothing; once the folder is rewritten,
    it publishes it."""
    watch, store = tmp_path / "watch", tmp_path / "store"
    t = SyntheticTrainer(**fuzz.TINY)
    good0 = t.save(watch / "step_0")
    (good0 / "COMPLETE").write_text("")
    t.step()
    bad = t.save(watch / "step_1")
    data = (bad / "model.safetensors").read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    name = next(k for k in header if k != "__metadata__")
    header[name]["data_offsets"][1] += 2  # the header lies: the tensor "ends" past its bytes
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    (bad / "model.safetensors").write_bytes(len(raw).to_bytes(8, "little") + raw + data[8 + n :])
    (bad / "COMPLETE").write_text("")
    pub = Daemon("publisher", ["--store", store, "--watch", watch, "--state-dir", tmp_path / "st"], tmp_path).start()
    try:
        status = wait_for(
            lambda: (s := pub.status())["head_version"] == 0 and s["last_error"] and s,
            20,
            f"a failed publish of step 1\n{pub.log()}",
        )
        assert "model.safetensors" in status["last_error"] and "CheckpointError" in status["last_error"], status
        assert weightsync.open_repo(store).versions() == [0]
        assert "weightsync_publish_failures_total" in pub.get("/metrics")[1]
        failures = [
            ln for ln in pub.get("/metrics")[1].splitlines() if ln.startswith("weightsync_publish_failures_total{")
        ]
        assert failures and float(failures[0].split()[-1]) >= 1
        t.save(bad)  # the trainer rewrites the folder (same step, a valid file)
        wait_for(lambda: pub.status()["head_version"] == 1, 30, "step 1 published after the fix")
        pull(fuzz.World(tmp_path, store, {}, {}), tmp_path / "pulled", 1)
        assert files(tmp_path / "pulled") == {p: h for p, h in fuzz.tree(bad).items() if p != "COMPLETE"}
    finally:
        assert pub.stop(signal.SIGTERM) == 0


# --- end-to-end fuzz (the long run: python benchmarks/fuzz.py) --------------------------------------------------
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.text(max_size=12)
    | st.sampled_from(fuzz.SPECIAL),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=4,
)


@st.composite
def mutations(draw):
    target = draw(st.sampled_from(["manifest", "chunk", "other"]))
    op = draw(
        st.sampled_from({"manifest": fuzz.MANIFEST_OPS, "chunk": fuzz.CHUNK_OPS, "other": fuzz.OTHER_OPS}[target])
    )
    value = draw(json_values if op.startswith("json-") else st.binary(max_size=8) | st.integers(-1, 12))
    return fuzz.Mutation(
        target,
        op,
        draw(st.sampled_from([2, 3, 4, 4])),
        draw(st.integers(0, 1 << 20)),
        draw(st.integers(0, 1 << 20)),
        value,
    )


@settings(
    max_examples=120,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(m=mutations(), incremental=st.booleans(), version=st.sampled_from([None, 3, 4]), back=st.booleans())
def test_fuzzed_store_objects_never_yield_a_wrong_byte(m, incremental, version, back, world, tmp_path):
    """Fresh pulls, pulls over the previous version and rollbacks from the next (4 -> 3 undoes
    keyframe 4's deltas from 3, with their reverse payloads)."""
    rollback = back and incremental and version == 3
    outcome = fuzz.run_case(world, m, tmp_path, incremental, version, rollback)
    kind = "rollback" if rollback else "incremental" if incremental else "fresh"
    assert not outcome.violation, f"{m} ({kind}): {outcome.kind}: {outcome.detail}"


def test_a_publish_stores_again_a_chunk_that_holds_other_bytes(tmp_path, ws):
    """A chunk damaged in the store (the right size, other bytes: a bad copy, a hostile writer) was
    taken as present by every later publish whose payloads pack to it (a keyframe re-using a frozen
    tensor), exit 0, and no fresh pull could build those versions again. A publish now asks the store
    whether the object holds its bytes (``Store.compare``: the file, or S3's ETag) and stores it again."""
    from safetensors.numpy import save_file

    from weightsync.sync.publish import PublishConfig

    rng = np.random.default_rng(0)
    frozen = rng.integers(0, 256, 3 << 20, dtype=np.uint8)  # never changes: its full payload's chunks recur
    train = rng.integers(0, 256, 1 << 16, dtype=np.uint8)
    store, cfg = tmp_path / "store", PublishConfig(chunk_bytes=1 << 20, keyframe_interval=2)
    ckpts = []
    for v in range(3):
        ck = tmp_path / f"ck{v}"
        ck.mkdir()
        train[v] ^= 1
        save_file({"emb": frozen}, str(ck / "a_frozen.safetensors"))
        save_file({"w": train.copy()}, str(ck / "b_train.safetensors"))
        ckpts.append(ck)
    weightsync.publish(ckpts[0], store, config=cfg, cache_dir=tmp_path / "cache")
    first = weightsync.open_repo(store).manifest(0).chunks[0]
    path = store / chunk_key(first.id)
    damaged = bytearray(path.read_bytes())
    damaged[100] ^= 0xFF
    path.write_bytes(bytes(damaged))
    for v in (1, 2):  # a delta (its base from the cache), then a keyframe that packs emb to the same chunks
        weightsync.publish(ckpts[v], store, config=cfg, cache_dir=tmp_path / "cache")
    assert first.id in {c.id for c in weightsync.open_repo(store).manifest(2).chunks}
    assert xxhash.xxh3_128_hexdigest(path.read_bytes()) == first.id  # stored again by version 2's publish
    out = tmp_path / "fresh"
    weightsync.pull(store, out, 2, config=NOFSYNC)
    ws.assert_replica(out, ckpts[2])
