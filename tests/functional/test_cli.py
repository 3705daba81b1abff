"""The ``weightsync`` command line end to end on a file store: publish, versions, pull, verify, demo.

Every pulled folder is compared with its source checkpoint by sha256 of every file, and its listing
must hold nothing but those files and the hidden ``.weightsync`` entry.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from weightsync.demo import write_safetensors

DTYPES = [
    "BOOL",
    "U8",
    "I8",
    "I16",
    "U16",
    "I32",
    "U32",
    "I64",
    "U64",
    "F16",
    "BF16",
    "F32",
    "F64",
    "F8_E4M3",
    "F8_E5M2",
]
WIDTH = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}
UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}

# Bit patterns that float arithmetic would lose or merge: NaNs with payloads and signs, -0.0, +0.0,
# infinities, the smallest subnormals. As unsigned integers of the dtype's width.
SPECIALS = {
    "F16": [0x7E01, 0xFE02, 0x7C01, 0x8000, 0x0000, 0x7C00, 0xFC00, 0x0001, 0x8001],
    "BF16": [0x7FC1, 0xFFC2, 0x7F81, 0x8000, 0x0000, 0x7F80, 0xFF80, 0x0001, 0x8001],
    "F32": [0x7FC00001, 0xFFC00002, 0x7F800001, 0x80000000, 0, 0x7F800000, 0xFF800000, 1, 0x80000001],
    "F64": [
        0x7FF8000000000001,
        0xFFF8000000000002,
        0x7FF0000000000001,
        0x8000000000000000,
        0,
        0x7FF0000000000000,
        0xFFF0000000000000,
        1,
        0x8000000000000001,
    ],
    "F8_E4M3": [0x7F, 0xFF, 0x80, 0x00, 0x01, 0x81],
    "F8_E5M2": [0x7D, 0xFE, 0x7F, 0x80, 0x00, 0x7C, 0xFC, 0x01, 0x81],
}


def _store_arg(store: Path, form: str) -> str:
    return f"file://{store}" if form == "url" else str(store)


def _last_line(stdout: str) -> str:
    return stdout.strip().splitlines()[-1]


# --- the synthetic trajectory ---------------------------------------------------------------------
def test_publish_versions_and_pull_each(trajectory, tmp_path, ok_cli, ws):
    """Versions published through both spellings of the store (file:// URL and plain path)."""
    store = tmp_path / "store"
    forms = [_store_arg(store, "url" if i % 2 == 0 else "plain") for i in range(len(trajectory))]
    assert (trajectory[0] / "model.safetensors.index.json").exists()
    for i, ckpt in enumerate(trajectory):
        out = ok_cli("publish", ckpt, "--store", forms[i], "--keyframe-interval", 3)
        assert _last_line(out) == str(i)

    infos = json.loads(ok_cli("versions", "--store", forms[0], "--json"))
    assert [i["version"] for i in infos] == [0, 1, 2, 3, 4, 5]
    assert [i["keyframe"] for i in infos] == [True, False, False, True, False, False]
    assert infos[0]["parent"] is None
    assert [i["parent"] for i in infos if not i["keyframe"]] == [0, 1, 3, 4]
    for i in infos:
        assert i["raw_bytes"] == sum(p.stat().st_size for p in trajectory[i["version"]].iterdir())
    deltas = [i["payload_bytes"] for i in infos if not i["keyframe"]]
    assert max(deltas) < min(i["payload_bytes"] for i in infos if i["keyframe"])

    table = ok_cli("versions", "--store", forms[1]).strip().splitlines()
    rows = {int(line.split()[0]): line.split()[2] for line in table[1:]}
    assert rows == {0: "keyframe", 1: "delta", 2: "delta", 3: "keyframe", 4: "delta", 5: "delta"}

    for i in (0, 2, 3):  # a keyframe, the end of a chain, the second keyframe
        dest = tmp_path / f"fresh_{i}"
        assert _last_line(ok_cli("pull", "--store", forms[(i + 1) % 2], "--version", i, dest)) == str(i)
        ws.assert_replica(dest, trajectory[i])
    ok_cli("verify", "--store", forms[0], "--version", 2, tmp_path / "fresh_2")

    latest = tmp_path / "latest"
    assert _last_line(ok_cli("pull", "--store", forms[1], latest)) == "5"  # default: latest
    ws.assert_replica(latest, trajectory[5])
    ok_cli("verify", "--store", forms[0], latest)  # default: latest


def _pull_counts(stderr: str) -> tuple[str, float, int, int]:
    """(source, bytes fetched, files written, files kept) from pull's summary line."""
    m = re.search(
        r"from (empty folder|version \d+): ([\d.]+) (B|KiB|MiB|GiB) fetched, (\d+) files? written, (\d+) kept", stderr
    )
    assert m, stderr
    fetched = float(m.group(2)) * 1024 ** ["B", "KiB", "MiB", "GiB"].index(m.group(3))
    return m.group(1), fetched, int(m.group(4)), int(m.group(5))


def test_incremental_pull_forward_and_rollback(published, tmp_path, run_cli, ok_cli, ws):
    """One folder moves forward by one, across a keyframe, back by one, back across a keyframe."""
    store, traj = published
    url = f"file://{store}"
    out = tmp_path / "replica"
    inodes = {}
    prev = None
    for v in [1, 2, 5, 4, 0, 0, "latest"]:
        rc, stdout, stderr = run_cli("pull", "--store", url, "--version", v, out)
        assert rc == 0, stderr
        v = int(_last_line(stdout))
        ws.assert_replica(out, traj[v])
        src, fetched, written, kept = _pull_counts(stderr)
        if prev is None:
            assert src == "empty folder" and written == 4
            full = fetched
        else:
            assert src == f"version {prev}"
            if (prev, v) == (1, 2):  # forward on a delta chain: only the delta is fetched
                assert 0 < fetched < full / 4
            # config.json and the index never change along the trajectory: kept in place, not rewritten
            assert kept >= 2 and written <= 2
            assert inodes == {n: (out / n).stat().st_ino for n in inodes}
            if prev == v:
                assert written == 0
        inodes = {n: (out / n).stat().st_ino for n in ("config.json", "model.safetensors.index.json")}
        prev = v
    assert prev == 5
    ok_cli("verify", "--store", url, "--version", 5, out)


VERIFY_DIFFERS, VERIFY_UNCHECKED = 1, 3  # the documented exit codes of `weightsync verify`


def _verify_rc(run_cli, url, version, folder, says: str = "") -> int:
    rc, _, err = run_cli("verify", "--store", url, "--version", version, folder)
    if rc:
        assert err.startswith("weightsync: error:") and says in err, err
    return rc


def test_verify(published, tmp_path, run_cli, ok_cli, ws):
    store, traj = published
    url = f"file://{store}"
    out = tmp_path / "replica"
    ok_cli("pull", "--store", url, "--version", 4, out)
    assert _verify_rc(run_cli, url, 4, out) == 0
    assert _verify_rc(run_cli, url, "latest", out) == VERIFY_DIFFERS
    assert _verify_rc(run_cli, url, 3, out) == VERIFY_DIFFERS

    shard = out / "model-00002-of-00002.safetensors"
    pos = ws.tensor_data_offset(shard) + 5
    ws.flip_byte(shard, pos)  # one byte of a tensor
    assert _verify_rc(run_cli, url, 4, out) == VERIFY_DIFFERS
    ws.flip_byte(shard, pos)  # back to the original byte
    assert _verify_rc(run_cli, url, 4, out) == 0

    ws.flip_byte(out / "model-00001-of-00002.safetensors", 20)  # inside the JSON header
    assert _verify_rc(run_cli, url, 4, out) == VERIFY_DIFFERS
    (out / "config.json").unlink()
    assert _verify_rc(run_cli, url, 4, out, f"{out} lacks files of version 4: config.json\n") == VERIFY_DIFFERS
    ok_cli("pull", "--store", url, "--version", 4, out)  # a pull repairs the folder
    ws.assert_replica(out, traj[4])

    (out / "stray.txt").write_text("x")
    assert _verify_rc(run_cli, url, 4, out, f"{out} holds entries version 4 lacks: stray.txt\n") == VERIFY_DIFFERS
    (out / "stray.txt").unlink()
    (out / "sub").mkdir()
    (out / "sub" / "stray.bin").write_bytes(b"")
    assert _verify_rc(run_cli, url, 4, out) == VERIFY_DIFFERS
    shutil.rmtree(out / "sub")
    with open(out / "config.json", "ab") as f:
        f.write(b"\n")  # a longer file with the same prefix
    assert _verify_rc(run_cli, url, 4, out) == VERIFY_DIFFERS

    # verify also checks a plain checkpoint directory (no .weightsync at all)
    assert _verify_rc(run_cli, url, 2, traj[2]) == 0


@pytest.mark.parametrize("stray", ["empty_dir", "dir_symlink"])
def test_verify_rejects_stray_directory(stray, published, tmp_path, run_cli, ok_cli):
    """A folder byte-identical to a version holds nothing else: no extra directory, no link to one."""
    store, _ = published
    url = f"file://{store}"
    out = tmp_path / "replica"
    ok_cli("pull", "--store", url, "--version", 1, out)
    if stray == "empty_dir":
        (out / "extra").mkdir()
    else:
        (tmp_path / "elsewhere").mkdir()
        (tmp_path / "elsewhere" / "weights.bin").write_bytes(b"not part of version 1")
        (out / "extra").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    assert _verify_rc(run_cli, url, 1, out) == VERIFY_DIFFERS


def test_verify_exit_code_tells_could_not_check_from_differs(published, tmp_path, run_cli, ok_cli):
    """1: the folder does not hold the version; 3: verify could not tell (and says why); 2: bad usage."""
    store, _ = published
    url = f"file://{store}"
    out = tmp_path / "replica"
    ok_cli("pull", "--store", url, "--version", 2, out)
    assert _verify_rc(run_cli, url, 2, out) == 0
    assert _verify_rc(run_cli, url, 1, out) == VERIFY_DIFFERS
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "not_a_store").mkdir()
    (tmp_path / "not_a_store" / "data.bin").write_text("x")
    unchecked = {
        "no such store": (f"file://{tmp_path / 'nowhere'}", 2, out),
        "not a store": (f"file://{tmp_path / 'not_a_store'}", 2, out),
        "no such version": (url, 99, out),
        "no such folder": (url, 2, tmp_path / "missing"),
        "a file, not a folder": (url, 2, tmp_path / "a_file"),
        "a bad store URL": ("ftp://host/x", 2, out),
    }
    for what, (store_url, version, folder) in unchecked.items():
        assert _verify_rc(run_cli, store_url, version, folder) == VERIFY_UNCHECKED, what
    (out / ".weightsync" / "journal.json").write_text("{}")  # an install into the folder was interrupted
    rc, _, err = run_cli("verify", "--store", url, "--version", 2, out)
    assert rc == VERIFY_UNCHECKED and "interrupted" in err, err
    rc, _, err = run_cli("verify", "--store", url, "--version", "two", out)
    assert rc == 2 and "usage:" in err, err
    rc, help_text, _ = run_cli("verify", "--help")
    assert (
        rc == 0
        and f"{VERIFY_DIFFERS}  DIR does not hold it" in help_text
        and f"{VERIFY_UNCHECKED}  could not check" in help_text
    )


def test_verify_exits_3_when_a_file_cannot_be_read(published, tmp_path, ok_cli, monkeypatch, capsys):
    """An OSError while reading the folder (EACCES, EIO: not producible as root, so injected) is
    "could not check", not "differs"."""
    from weightsync import cli
    from weightsync.local import verify as integrity

    store, _ = published
    out = tmp_path / "replica"
    ok_cli("pull", "--store", f"file://{store}", "--version", 2, out)

    def unreadable(path, *a, **kw):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(integrity, "hash_file", unreadable)
    assert cli.main(["verify", "--store", f"file://{store}", "--version", "2", str(out)]) == VERIFY_UNCHECKED
    err = capsys.readouterr().err
    assert err.startswith("weightsync: error: could not check") and "Permission denied" in err, err


# --- explicit and default version numbers --------------------------------------------------------
def test_version_explicit_and_default(trajectory, tmp_path, ok_cli, ws):
    url = f"file://{tmp_path / 'store'}"
    assert _last_line(ok_cli("publish", trajectory[0], "--store", url, "--version", 10)) == "10"
    assert _last_line(ok_cli("publish", trajectory[1], "--store", url)) == "11"
    assert _last_line(ok_cli("publish", trajectory[2], "--store", url, "--version", 20)) == "20"
    assert _last_line(ok_cli("publish", trajectory[3], "--store", url)) == "21"
    assert _last_line(ok_cli("publish", trajectory[3], "--store", url)) == "22"  # unchanged checkpoint
    infos = json.loads(ok_cli("versions", "--store", url, "--json"))
    assert [i["version"] for i in infos] == [10, 11, 20, 21, 22]
    assert [i["parent"] for i in infos] == [None, 10, 11, 20, 21]
    assert infos[-1]["changed_fraction"] == 0
    inc = tmp_path / "inc"
    for v, ckpt in [(22, trajectory[3]), (11, trajectory[1]), (21, trajectory[3])]:
        ok_cli("pull", "--store", url, "--version", v, inc)
        ws.assert_replica(inc, ckpt)


def test_publish_without_cache_and_with_base(trajectory, tmp_path, ok_cli, ws):
    url = f"file://{tmp_path / 'store'}"
    ok_cli("publish", trajectory[0], "--store", url, "--no-cache")
    ok_cli("publish", trajectory[1], "--store", url, "--no-cache")
    ok_cli("publish", trajectory[2], "--store", url, "--base", trajectory[1])
    ok_cli("publish", trajectory[3], "--store", url, "--cache-dir", tmp_path / "cache")
    ok_cli("publish", trajectory[4], "--store", url, "--cache-dir", tmp_path / "cache")
    infos = json.loads(ok_cli("versions", "--store", url, "--json"))
    assert [i["keyframe"] for i in infos] == [True, False, False, False, False]
    out = tmp_path / "replica"
    for v in (4, 2):
        ok_cli("pull", "--store", url, "--version", v, out)
        ws.assert_replica(out, trajectory[v])


def test_relative_store_and_folder_paths(trajectory, tmp_path, ok_cli, ws):
    """A plain relative --store and a relative OUT_DIR resolve against the working directory."""
    work = tmp_path / "work"
    work.mkdir()
    for i in (0, 1):
        assert _last_line(ok_cli("publish", trajectory[i], "--store", "store", cwd=work)) == str(i)
    assert (work / "store" / "weightsync.json").is_file()
    ok_cli("pull", "--store", "./store", "--version", 0, "out", cwd=work)
    ok_cli("pull", "--store", f"file://{work / 'store'}", "out", cwd=work)
    ws.assert_replica(work / "out", trajectory[1])
    ok_cli("verify", "--store", "store", "out", cwd=work)


def test_publish_hf_cache_snapshots_with_symlinks(trajectory, tmp_path, ok_cli, ws):
    """Hugging Face cache snapshots: every file is a relative symlink into ../../blobs. The contents
    are published (with the default publish cache), one snapshot after the other."""
    repo = tmp_path / "hub" / "models--x--y"
    (repo / "blobs").mkdir(parents=True)
    url = f"file://{tmp_path / 'store'}"
    out = tmp_path / "out"
    for step in (1, 2):
        snap = repo / "snapshots" / f"rev{step}"
        snap.mkdir(parents=True)
        for f in sorted(trajectory[step].iterdir()):
            blob = repo / "blobs" / ws.sha256_file(f)
            if not blob.exists():
                shutil.copyfile(f, blob)
            (snap / f.name).symlink_to(Path("../..") / "blobs" / blob.name)
        assert _last_line(ok_cli("publish", snap, "--store", url)) == str(step - 1)
        ok_cli("pull", "--store", url, out)
        ws.assert_replica(out, trajectory[step])
        assert not any(p.is_symlink() for p in out.iterdir())


def test_publish_a_replica_folder(published, tmp_path, ok_cli, ws):
    """A pulled folder (with its .weightsync) can itself be published, e.g. to a second region."""
    store, traj = published
    replica = tmp_path / "replica"
    ok_cli("pull", "--store", store, "--version", 2, replica)
    second = tmp_path / "second"
    assert _last_line(ok_cli("publish", replica, "--store", second)) == "0"
    out = tmp_path / "out"
    ok_cli("pull", "--store", second, out)
    ws.assert_replica(out, traj[2])


def test_pull_over_user_added_file(published, tmp_path, run_cli, ok_cli, ws):
    """After a pull that succeeds the folder holds the version and nothing else (or the pull refuses)."""
    store, traj = published
    out = tmp_path / "replica"
    ok_cli("pull", "--store", store, "--version", 1, out)
    (out / "notes.txt").write_text("added by hand")
    before = ws.snapshot(out)
    rc, _, stderr = run_cli("pull", "--store", store, "--version", 2, out)
    if rc == 0:
        ws.assert_replica(out, traj[2])
        ok_cli("verify", "--store", store, "--version", 2, out)
    else:
        ws.error_line(stderr)
        assert ws.snapshot(out) == before


# --- tensors that appear, disappear, change shape or dtype; files that come and go -----------------
def _rand(rng, n: int) -> bytes:
    return rng.integers(0, 256, n, dtype=np.uint8).tobytes()


def _evolving_checkpoints(root: Path) -> list[Path]:
    rng = np.random.default_rng(7)
    a = _rand(rng, 4 * 64)
    b = _rand(rng, 2 * 32)
    w = np.frombuffer(_rand(rng, 4 * 256), dtype=np.uint32).copy()
    versions = []

    def ckpt(i: int) -> Path:
        d = root / f"v{i}"
        d.mkdir(parents=True)
        versions.append(d)
        return d

    d = ckpt(0)  # a (F32 8x8), b (BF16 32), step (I64 scalar), w (F32 256); tokenizer files
    write_safetensors(
        d / "model.safetensors",
        {
            "a": ("F32", (8, 8), a),
            "b": ("BF16", (32,), b),
            "step": ("I64", (), np.int64(0).tobytes()),
            "w": ("F32", (256,), w.tobytes()),
        },
        {"format": "pt"},
    )
    (d / "config.json").write_text('{"v": 0}\n')
    (d / "tokenizer").mkdir()
    (d / "tokenizer" / "vocab.txt").write_text("a\nb\nc\n")
    (d / "tokenizer" / "spécial name.json").write_text('{"x": 1}')
    (d / ".gitattributes").write_text("*.safetensors filter=lfs\n")

    d = ckpt(1)  # a reshaped, b becomes F16, step disappears, c appears, w slightly changed
    w[::17] ^= 1
    write_safetensors(
        d / "model.safetensors",
        {
            "c": ("I32", (3, 2), _rand(rng, 24)),
            "w": ("F32", (256,), w.tobytes()),
            "a": ("F32", (4, 16), a),
            "b": ("F16", (32,), b),
        },
        {"format": "pt"},
    )
    (d / "config.json").write_text('{"v": 1, "more": true}\n')
    (d / "tokenizer").mkdir()
    (d / "tokenizer" / "vocab.txt").write_text("a\nb\nc\n")
    write_safetensors(d / "extra.safetensors", {"e": ("U8", (5,), b"hello")})
    (d / ".gitattributes").write_text("*.safetensors filter=lfs diff=lfs\n")

    d = ckpt(2)  # a grows, b changes dtype and shape, extra file gone, tokenizer dir gone, w again
    w[::5] += 3
    write_safetensors(
        d / "model.safetensors",
        {
            "a": ("F32", (8, 16), a + a),
            "b": ("U16", (2, 16), b),
            "c": ("I32", (3, 2), _rand(rng, 24)),
            "w": ("F32", (256,), w.tobytes()),
        },
        {"format": "pt", "step": "2"},
    )
    (d / "config.json").write_text('{"v": 2}\n')

    d = ckpt(3)  # tensors all replaced by empty and scalar ones, a zero-byte file, a nested shard
    write_safetensors(d / "model.safetensors", {"empty": ("F32", (0, 7), b""), "s": ("BF16", (), b"\x80\x3f")})
    (d / "config.json").write_text('{"v": 3}\n')
    (d / "empty.txt").write_bytes(b"")
    (d / "sub" / "deeper").mkdir(parents=True)
    write_safetensors(d / "sub" / "deeper" / "w.safetensors", {"w": ("F32", (16, 16), w.tobytes())})

    d = ckpt(4)  # back to something like v1
    write_safetensors(
        d / "model.safetensors",
        {
            "c": ("I32", (3, 2), _rand(rng, 24)),
            "w": ("F32", (256,), w.tobytes()),
            "a": ("F32", (4, 16), a),
            "b": ("F16", (32,), b),
        },
        {"format": "pt"},
    )
    (d / "config.json").write_text('{"v": 4}\n')
    return versions


def test_tensors_appear_disappear_change_shape_and_dtype(tmp_path, ok_cli, ws):
    ckpts = _evolving_checkpoints(tmp_path / "src")
    url = f"file://{tmp_path / 'store'}"
    for i, d in enumerate(ckpts):
        assert _last_line(ok_cli("publish", d, "--store", url, "--keyframe-interval", 100)) == str(i)
    infos = json.loads(ok_cli("versions", "--store", url, "--json"))
    assert [i["keyframe"] for i in infos] == [True] + [False] * (len(ckpts) - 1)
    ok_cli("pull", "--store", url, "--version", 2, tmp_path / "fresh")
    ws.assert_replica(tmp_path / "fresh", ckpts[2])
    inc = tmp_path / "inc"
    for v in [0, 1, 2, 3, 4, 0, 3]:
        ok_cli("pull", "--store", url, "--version", v, inc)
        ws.assert_replica(inc, ckpts[v])
    ok_cli("verify", "--store", url, "--version", 3, inc)


def _file_and_dir_versions(root: Path) -> list[Path]:
    """Version 0 has a file ``extra``; version 1 a directory ``extra`` holding a file."""
    a, b = root / "a", root / "b"
    (b / "extra").mkdir(parents=True)
    a.mkdir()
    for d in (a, b):
        write_safetensors(d / "model.safetensors", {"w": ("U8", (4,), b"abcd")})
    (a / "extra").write_text("a file\n")
    (b / "extra" / "file.txt").write_text("a file in a directory\n")
    return [a, b]


def test_file_becomes_directory_publish(tmp_path, ok_cli):
    """Publishing with the default cache, where a file of the parent is a directory now, and back."""
    a, b = _file_and_dir_versions(tmp_path / "src")
    store = tmp_path / "store"
    for i, d in enumerate([a, b, a]):
        assert _last_line(ok_cli("publish", d, "--store", store)) == str(i)


def test_file_becomes_directory_pull(tmp_path, ok_cli, ws):
    """One folder updated across a file <-> directory swap, both ways."""
    a, b = _file_and_dir_versions(tmp_path / "src")
    store = tmp_path / "store"
    for d in (a, b):
        ok_cli("publish", d, "--store", store, "--no-cache")
    for name, order in (("forward", [0, 1, 0]), ("backward", [1, 0])):
        out = tmp_path / name
        for v in order:
            ok_cli("pull", "--store", store, "--version", v, out)
            ws.assert_replica(out, [a, b][v])


# --- every dtype, scalars, empty tensors, NaN payloads and -0.0 -----------------------------------
def _dtype_tensors(seed: int, mutate: bool) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    rng = np.random.default_rng(seed)
    tensors = {}
    for dt in DTYPES:
        width = WIDTH[dt]
        u = UINT[width]
        base = np.random.default_rng(100 + DTYPES.index(dt))
        if dt == "BOOL":
            vec = base.integers(0, 2, 4096, dtype=np.uint8)
        else:
            vec = np.frombuffer(base.integers(0, 256, 4096 * width, dtype=np.uint8).tobytes(), dtype=u).copy()
        specials = np.array(SPECIALS.get(dt, []), dtype=u)
        vec[: len(specials)] = specials
        scalar = vec[100:101].copy()
        if mutate:
            if dt == "BOOL":
                vec[rng.choice(4096, 40, replace=False)] ^= 1
            else:
                vec[rng.choice(np.arange(len(specials), 4096), 40, replace=False)] ^= u(1)
                if len(specials):  # change only the payload or sign bits of the special values
                    vec[0] ^= u(0b10)  # a NaN with another payload
                    vec[3] = u(0)  # -0.0 becomes +0.0
                    vec[4] = u(1 << (8 * width - 1))  # +0.0 becomes -0.0
            scalar = scalar ^ u(1) if dt != "BOOL" else scalar ^ 1
        tensors[f"{dt}.vec"] = (dt, (64, 64), vec.tobytes())
        tensors[f"{dt}.scalar"] = (dt, (), scalar.tobytes())
        tensors[f"{dt}.empty"] = (dt, (0,), b"")
        tensors[f"{dt}.empty2d"] = (dt, (3, 0, 2), b"")
        dense = rng.integers(0, 256, 33 * width, dtype=np.uint8).tobytes()
        tensors[f"{dt}.dense"] = (dt, (3, 11), bytes(x & 1 for x in dense) if dt == "BOOL" else dense)
    return tensors


def _safetensors_lib_file(path: Path, mutate: bool) -> None:
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(3)
    t = {
        "bf16": torch.randn(17, 5, generator=g).to(torch.bfloat16),
        "f16": torch.randn(9, generator=g).to(torch.float16),
        "f8_e4m3": torch.randn(31, generator=g).to(torch.float8_e4m3fn),
        "f8_e5m2": torch.randn(31, generator=g).to(torch.float8_e5m2),
        "bool": torch.randn(13, generator=g) > 0,
        "u16": torch.randint(0, 60000, (7,), generator=g).to(torch.uint16),
        "u32": torch.randint(0, 2**31, (7,), generator=g).to(torch.uint32),
        "u64": torch.randint(0, 2**62, (7,), generator=g).to(torch.uint64),
        "i8": torch.randint(-128, 127, (6, 2), generator=g).to(torch.int8),
        "f64": torch.tensor(float("nan"), dtype=torch.float64),
        "neg0": torch.tensor([-0.0, 0.0, -0.0], dtype=torch.float32),
        "empty": torch.zeros(0, 4, dtype=torch.bfloat16),
    }
    if mutate:
        t["bf16"][3, 1] = 7.0
        t["neg0"] = torch.tensor([0.0, -0.0, -0.0], dtype=torch.float32)
        t["new"] = torch.ones(2, 2, dtype=torch.int16)
        del t["u32"]
    save_file(t, str(path), metadata={"format": "pt", "mutated": str(mutate)})


def _raw_safetensors(path: Path, mutate: bool) -> None:
    """A legal file in an unusual spelling: spaces in the JSON, keys not in offset order, odd padding."""
    data = bytes(range(48)) if not mutate else bytes(range(1, 49))
    header = (
        b'{ "z_first" : {"data_offsets":[16,48], "shape":[8], "dtype":"F32"},\n'
        b'  "__metadata__": {"note": "h\\u00e9llo", "empty": ""},\n'
        b'  "a_last": {"dtype":"I64","shape":[2],"data_offsets":[0,16]} }'
    )
    header += b"\t" * (-len(header) % 8)
    path.write_bytes(len(header).to_bytes(8, "little") + header + data)


def _dtype_checkpoint(d: Path, mutate: bool) -> Path:
    d.mkdir(parents=True)
    write_safetensors(d / "all_dtypes.safetensors", _dtype_tensors(1, mutate), {"format": "np", "v": str(int(mutate))})
    _safetensors_lib_file(d / "lib.safetensors", mutate)
    _raw_safetensors(d / "raw.safetensors", mutate)
    write_safetensors(d / "only_metadata.safetensors", {}, {"kind": "no tensors"})
    (d / "notes.bin").write_bytes(bytes(range(256)) * (3 if mutate else 2))
    return d


def test_every_dtype_bit_exact(tmp_path, ok_cli, ws):
    v0 = _dtype_checkpoint(tmp_path / "v0", False)
    v1 = _dtype_checkpoint(tmp_path / "v1", True)
    assert ws.content(v0) != ws.content(v1)
    url = f"file://{tmp_path / 'store'}"
    ok_cli("publish", v0, "--store", url)
    ok_cli("publish", v1, "--store", url)
    ok_cli("publish", v0, "--store", url)  # back again, as a delta
    infos = json.loads(ok_cli("versions", "--store", url, "--json"))
    assert [i["keyframe"] for i in infos] == [True, False, False]
    ok_cli("pull", "--store", url, "--version", 2, tmp_path / "fresh")
    ws.assert_replica(tmp_path / "fresh", v0)
    inc = tmp_path / "inc"
    for v, src in [(0, v0), (1, v1), (2, v0), (1, v1)]:
        ok_cli("pull", "--store", url, "--version", v, inc)
        ws.assert_replica(inc, src)
    ok_cli("verify", "--store", url, "--version", 1, inc)


def test_bit_flips_in_special_floats_are_deltas(tmp_path, ok_cli, ws):
    """A version differing from its parent only by -0.0 vs +0.0 and NaN payload bits."""
    d0, d1 = tmp_path / "a", tmp_path / "b"
    d0.mkdir()
    d1.mkdir()
    x = np.array([0x80000000, 0x7FC00001, 0x3F800000] * 100, dtype=np.uint32)
    y = x.copy()
    y[::3] = 0  # -0.0 -> +0.0
    y[1::3] = 0x7FC00002  # another NaN
    write_safetensors(d0 / "model.safetensors", {"x": ("F32", x.shape, x.tobytes())})
    write_safetensors(d1 / "model.safetensors", {"x": ("F32", y.shape, y.tobytes())})
    url = f"file://{tmp_path / 'store'}"
    ok_cli("publish", d0, "--store", url)
    ok_cli("publish", d1, "--store", url)
    out = tmp_path / "out"
    ok_cli("pull", "--store", url, "--version", 0, out)
    ws.assert_replica(out, d0)
    ok_cli("pull", "--store", url, "--version", 1, out)
    ws.assert_replica(out, d1)
    infos = json.loads(ok_cli("versions", "--store", url, "--json"))
    assert infos[1]["changed_fraction"] == pytest.approx(2 / 3)


def test_a_version_that_stores_nothing_shows_no_ratio(published, run_cli, ok_cli):
    """The head's checkpoint published again stores no payload: its ratio was its size over one
    byte (35685009.0x in publish's line, 198912.0x in the table)."""
    store, traj = published
    rc, _, err = run_cli("publish", traj[-1], "--store", f"file://{store}", "--no-cache")
    assert rc == 0 and " -> 0 B (-), 0.00% elements changed" in err, err
    rows = {int(r.split()[0]): r.split() for r in ok_cli("versions", "--store", store).strip().splitlines()[1:]}
    assert rows[6][5:8] == ["0", "B", "-"] and rows[5][7].endswith("x")  # stored "0 B", ratio


# --- demo -----------------------------------------------------------------------------------------
def test_demo_small(tmp_path, ok_cli):
    work = tmp_path / "demo"
    out = ok_cli("demo", "--workdir", work, "--steps", 3, "--hidden", 32)
    lines = _demo_summary(out)
    assert lines[-1].startswith("deltas:") and "verified byte for byte" in lines[-1]
    assert (work / "store").is_dir() and (work / "replica").is_dir()


def _demo_summary(out: str) -> list[str]:
    """The demo's lines but its last, which says how long the kernels took to compile, if they did."""
    lines = out.strip().splitlines()
    assert lines[1].split()[-1] == "compile"  # the header: a column of each step's compile time
    if lines[-1].startswith("compile: "):
        assert float(lines[-1].split()[1].rstrip("s")) > 0
        return lines[:-1]
    return lines


@pytest.mark.slow
def test_demo_default(tmp_path, ok_cli):
    work = tmp_path / "demo"
    out = ok_cli("demo", "--workdir", work, timeout=600)
    assert _demo_summary(out)[-1].startswith("deltas:")


# --- memory: publish and pull stream tensor by tensor ----------------------------------------------
def _peak_rss_bytes(cli_env, *args) -> int:
    """Run one CLI command alone and return its peak resident set size."""
    # a parent that waits for the command alone: its RUSAGE_CHILDREN peak is the command's (KiB on Linux)
    code = (
        "import resource, subprocess, sys; "
        "rc = subprocess.call(sys.argv[1:]); "
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(rc)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, sys.executable, "-m", "weightsync.cli", *map(str, args)],
        check=False,
        capture_output=True,
        text=True,
        env=cli_env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    return int(proc.stdout.strip().splitlines()[-1]) * 1024


@pytest.mark.slow
def test_memory_bounded_by_largest_tensor(tmp_path, cli_env, ws):
    """One 200 MB tensor: publish and pull stay within 1 GiB + 2x the largest tensor."""
    n = 50 << 20  # 50 Mi float32 elements = 200 MiB
    rng = np.random.default_rng(0)
    big = rng.standard_normal(n, dtype=np.float32)
    small = rng.standard_normal(1000, dtype=np.float32)
    dirs = []
    for v in range(2):
        d = tmp_path / f"v{v}"
        d.mkdir()
        if v:
            idx = rng.integers(0, n, n // 10)
            big[idx] += np.float32(1e-3)
        write_safetensors(
            d / "model.safetensors",
            {"big": ("F32", (n,), big.view(np.uint8).data), "small": ("F32", (1000,), small.tobytes())},
        )
        (d / "config.json").write_text("{}")
        dirs.append(d)
    del big
    limit = (1 << 30) + 2 * 4 * n
    store, out = tmp_path / "store", tmp_path / "out"
    peaks = {
        "publish keyframe": _peak_rss_bytes(cli_env, "publish", dirs[0], "--store", store),
        "publish delta": _peak_rss_bytes(cli_env, "publish", dirs[1], "--store", store),
        "pull keyframe": _peak_rss_bytes(cli_env, "pull", "--store", store, "--version", 0, out),
        "pull delta": _peak_rss_bytes(cli_env, "pull", "--store", store, "--version", 1, out),
        "pull fresh from chain": _peak_rss_bytes(cli_env, "pull", "--store", store, "--version", 1, tmp_path / "fresh"),
    }
    ws.assert_replica(out, dirs[1])
    ws.assert_replica(tmp_path / "fresh", dirs[1])
    print({k: f"{v / 2**20:.0f} MiB" for k, v in peaks.items()})
    assert all(v <= limit for v in peaks.values()), (peaks, limit)
