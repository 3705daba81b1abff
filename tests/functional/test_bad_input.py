"""Bad input through the command line: one clear line on stderr, a non-zero exit, nothing changed.

Every case snapshots the store directory and the replica folder (every entry, hidden ones included,
with sha256 of every file) before and after the failing command and requires them equal.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from weightsync.demo import write_safetensors


@pytest.fixture
def world(published, tmp_path, ok_cli):
    """A store with versions 0..5 and a replica folder holding version 1."""
    store, traj = published
    out = tmp_path / "replica"
    ok_cli("pull", "--store", f"file://{store}", "--version", 1, out)
    return store, traj, out


def _fails(ws, run_cli, watched: list[Path], *args) -> str:
    """Run a command that must fail cleanly without changing anything under ``watched``; its error line."""
    before = [ws.snapshot(p) for p in watched]
    rc, stdout, stderr = run_cli(*args)
    assert rc != 0, f"expected failure: {args}\nstdout: {stdout}"
    line = ws.error_line(stderr)
    after = [ws.snapshot(p) for p in watched]
    for p, b, a in zip(watched, before, after):
        assert a == b, f"{p} changed by a failing command"
    return line


# --- broken checkpoints ---------------------------------------------------------------------------
def _shard(ckpt: Path) -> Path:
    return ckpt / "model-00001-of-00002.safetensors"


def _header(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _rewrite(path: Path, header: dict | bytes, data: bytes) -> None:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data)


def _tensors_by_offset(header: dict) -> list[str]:
    names = [k for k in header if k != "__metadata__"]
    return sorted(names, key=lambda k: header[k]["data_offsets"][0])


def _truncate_half(p: Path) -> None:
    raw = p.read_bytes()
    p.write_bytes(raw[: len(raw) // 2])


def _truncate_tail(p: Path) -> None:
    raw = p.read_bytes()
    p.write_bytes(raw[:-1])


def _tiny_file(p: Path) -> None:
    p.write_bytes(b"\x10\x00\x00")


def _huge_header_length(p: Path) -> None:
    raw = p.read_bytes()
    p.write_bytes((2**63).to_bytes(8, "little") + raw[8:])


def _garbage_header(p: Path) -> None:
    h, data = _header(p)
    raw = json.dumps(h).encode()
    _rewrite(p, b"{not json" + raw[9:], data)


def _header_not_utf8(p: Path) -> None:
    h, data = _header(p)
    raw = json.dumps(h).encode()
    _rewrite(p, raw[:-1] + b"\xff}", data)


def _offsets_past_end(p: Path) -> None:
    h, data = _header(p)
    last = _tensors_by_offset(h)[-1]
    b, e = h[last]["data_offsets"]
    h[last]["data_offsets"] = [b + 2, e + 2]  # a hole before it and past the end of the file
    _rewrite(p, h, data)


def _offsets_overlap(p: Path) -> None:
    h, data = _header(p)
    names = _tensors_by_offset(h)
    a, b = names[-2], names[-1]
    # the last tensor claims to start inside the one before it; keep the total length consistent
    span = h[b]["data_offsets"][1] - h[b]["data_offsets"][0]
    h[b]["data_offsets"] = [h[a]["data_offsets"][0], h[a]["data_offsets"][0] + span]
    _rewrite(p, h, data)


def _offsets_swapped(p: Path) -> None:
    h, data = _header(p)
    name = _tensors_by_offset(h)[0]
    b, e = h[name]["data_offsets"]
    h[name]["data_offsets"] = [e, b]
    _rewrite(p, h, data)


def _offsets_do_not_fit_shape(p: Path) -> None:
    h, data = _header(p)
    name = next(n for n in _tensors_by_offset(h) if h[n]["shape"])
    h[name]["shape"] = [*h[name]["shape"][:-1], h[name]["shape"][-1] + 1]
    _rewrite(p, h, data)


def _unknown_dtype(p: Path) -> None:
    h, data = _header(p)
    h[_tensors_by_offset(h)[0]]["dtype"] = "F128"
    _rewrite(p, h, data)


def _duplicate_tensor(p: Path) -> None:
    h, data = _header(p)
    name = _tensors_by_offset(h)[0]
    raw = json.dumps(h).encode()
    dup = json.dumps({name: h[name]})[1:-1].encode()
    _rewrite(p, raw[:-1] + b"," + dup + b"}", data)


def _trailing_bytes(p: Path) -> None:
    with open(p, "ab") as f:
        f.write(b"\x00" * 16)


def _bad_metadata(p: Path) -> None:
    h, data = _header(p)
    h["__metadata__"] = {"format": 5}
    _rewrite(p, h, data)


CORRUPTIONS = [
    _truncate_half,
    _truncate_tail,
    _tiny_file,
    _huge_header_length,
    _garbage_header,
    _header_not_utf8,
    _offsets_past_end,
    _offsets_overlap,
    _offsets_swapped,
    _offsets_do_not_fit_shape,
    _unknown_dtype,
    _duplicate_tensor,
    _trailing_bytes,
    _bad_metadata,
]


@pytest.mark.parametrize("corrupt", CORRUPTIONS, ids=lambda f: f.__name__.lstrip("_"))
def test_publish_corrupt_safetensors(corrupt, published, tmp_path, run_cli, ws):
    store, traj = published
    bad = tmp_path / "bad"
    shutil.copytree(traj[2], bad)
    corrupt(_shard(bad))
    line = _fails(ws, run_cli, [store, bad], "publish", bad, "--store", f"file://{store}")
    assert "model-00001-of-00002.safetensors" in line


def test_publish_corrupt_checkpoint_into_new_store(trajectory, tmp_path, run_cli, ws):
    """A first publish that fails creates no store at all."""
    bad = tmp_path / "bad"
    shutil.copytree(trajectory[0], bad)
    _truncate_half(_shard(bad))
    for store in (tmp_path / "new_store", tmp_path / "empty_store"):
        if store.name == "empty_store":
            store.mkdir()
        _fails(ws, run_cli, [store, bad], "publish", bad, "--store", f"file://{store}")


def test_publish_bad_file_in_subfolder(published, tmp_path, run_cli, ws):
    store, traj = published
    bad = tmp_path / "bad"
    shutil.copytree(traj[2], bad)
    (bad / "extra").mkdir()
    write_safetensors(bad / "extra" / "adapter.safetensors", {"x": ("F32", (4,), b"\x00" * 16)})
    _truncate_tail(bad / "extra" / "adapter.safetensors")
    line = _fails(ws, run_cli, [store, bad], "publish", bad, "--store", f"file://{store}")
    assert "adapter.safetensors" in line


def test_publish_missing_or_empty_folder(published, tmp_path, run_cli, ws):
    store, traj = published
    _fails(ws, run_cli, [store], "publish", tmp_path / "no_such_dir", "--store", f"file://{store}")
    (tmp_path / "empty").mkdir()
    _fails(ws, run_cli, [store], "publish", tmp_path / "empty", "--store", f"file://{store}")
    line = _fails(ws, run_cli, [store], "publish", traj[2] / "config.json", "--store", f"file://{store}")
    assert line == f"weightsync: error: checkpoint {traj[2] / 'config.json'} is not a directory"


def test_publish_existing_version(published, run_cli, ws):
    store, traj = published
    for v in (0, 5):
        line = _fails(ws, run_cli, [store], "publish", traj[1], "--store", f"file://{store}", "--version", v)
        assert "already exists" in line


def test_publish_version_lower_than_head(trajectory, tmp_path, run_cli, ok_cli, ws):
    store = tmp_path / "store"
    ok_cli("publish", trajectory[0], "--store", store, "--version", 2)
    ok_cli("publish", trajectory[1], "--store", store, "--version", 7)
    for v in (3, 7):
        _fails(ws, run_cli, [store], "publish", trajectory[2], "--store", store, "--version", v)
    assert ok_cli("publish", trajectory[2], "--store", store).strip().splitlines()[-1] == "8"


def test_publish_with_wrong_base(published, tmp_path, run_cli, ws):
    """--base must hold exactly the parent version; another checkpoint is refused, nothing stored."""
    store, traj = published
    bad_base = tmp_path / "base"
    shutil.copytree(traj[3], bad_base)  # the parent (head) is version 5
    new = tmp_path / "new"
    shutil.copytree(traj[4], new)
    _fails(ws, run_cli, [store, bad_base, new], "publish", new, "--store", store, "--base", bad_base)


def test_publish_cache_inside_the_checkpoint_or_a_pulled_folder(world, tmp_path, run_cli, ok_cli, ws):
    """A cache in the checkpoint would be published with it (before, a publish failed and left it
    there); one in a pulled folder made that folder's next pull refuse it. Both are refused
    before anything is written; a cache beside them works."""
    store, traj, replica = world
    new = tmp_path / "new"
    shutil.copytree(traj[4], new)
    for cache, says in ((new, "overlap"), (new / "sub", "overlap"), (replica, f"inside {replica}, which holds")):
        line = _fails(ws, run_cli, [store, new, replica], "publish", new, "--store", store, "--cache-dir", cache)
        assert says in line, line
    ok_cli("pull", "--store", store, "--version", 2, replica)
    ok_cli("publish", new, "--store", store, "--cache-dir", tmp_path / "cache")


# --- stores that are not weightsync stores, or hold no versions -----------------------------------
def _foreign_store(root: Path) -> Path:
    (root / "data").mkdir(parents=True)
    (root / "notes.txt").write_text("my precious files\n")
    (root / "data" / "x.bin").write_bytes(b"\x00\x01\x02")
    return root


@pytest.mark.parametrize("kind", ["unrelated_files", "bad_marker", "only_marker_dir"])
def test_not_a_weightsync_store(kind, world, tmp_path, run_cli, ws):
    _, traj, out = world
    foreign = _foreign_store(tmp_path / "foreign")
    if kind == "bad_marker":
        (foreign / "weightsync.json").write_text('{"format": "something-else"}')
    elif kind == "only_marker_dir":
        shutil.rmtree(foreign)
        (foreign / "weightsync.json").mkdir(parents=True)
    url = f"file://{foreign}"
    fresh = tmp_path / "fresh"
    watched = [foreign, out, fresh]
    _fails(ws, run_cli, watched, "publish", traj[0], "--store", url)
    _fails(ws, run_cli, watched, "pull", "--store", url, out)
    if kind == "unrelated_files":
        _fails(ws, run_cli, watched, "pull", "--store", url, fresh)
        _fails(ws, run_cli, watched, "versions", "--store", url, "--json")
        _fails(ws, run_cli, watched, "verify", "--store", url, out)


def test_empty_or_missing_store(world, tmp_path, run_cli, ws):
    _, _, out = world
    empty = tmp_path / "empty_store"
    empty.mkdir()
    missing = tmp_path / "missing_store"
    fresh = tmp_path / "fresh"
    for store in (empty, missing):
        watched = [store, out, fresh]
        _fails(ws, run_cli, watched, "pull", "--store", f"file://{store}", fresh)
        _fails(ws, run_cli, watched, "pull", "--store", store, "--version", 0, out)
        _fails(ws, run_cli, watched, "versions", "--store", store)
    _fails(ws, run_cli, [missing, out], "verify", "--store", missing, out)


def test_bad_store_urls(tmp_path, run_cli, ws):
    fresh = tmp_path / "fresh"
    for url in ("file://relative/path", "ftp://host/x", "", "s3://[::1/x", "s3://bucket:port/x"):
        _fails(ws, run_cli, [tmp_path], "pull", "--store", url, fresh)
    # an endpoint that is not a URL (the flag; AWS_ENDPOINT_URL takes the same path): one line, no traceback
    for endpoint, says in (("not a url", "Invalid endpoint"), ("http://[::1", "Invalid IPv6 URL")):
        line = _fails(ws, run_cli, [tmp_path], "pull", "--store", "s3://b/x", "--endpoint-url", endpoint, fresh)
        assert says in line, line


def test_store_urls_with_a_typo_in_the_scheme_are_refused(trajectory, tmp_path, run_cli, ok_cli, ws):
    """``s3:bucket/run``, ``s3:/bucket/run`` and ``file:/x`` published "successfully" into folders of
    those names under the working directory (nothing reached the store); an ``s3://`` prefix with a
    tab or newline was stored without it. Each is one line now, and nothing is written; a folder whose
    name has a ':' is still a folder, written ``./name``."""
    work = tmp_path / "cwd"
    work.mkdir()
    for url in ("s3:wbucket/run", "s3:/wbucket/run", "file:/tmp/x", "S3:wbucket"):
        rc, _, err = run_cli("publish", trajectory[0], "--store", url, cwd=work)
        assert rc != 0 and "is neither s3://bucket/prefix nor file:///path" in ws.error_line(err), err
    for url in ("s3://wbucket/tab\trun", "s3://wbucket/new\nline"):
        rc, _, err = run_cli("publish", trajectory[0], "--store", url, cwd=work)
        assert rc != 0 and "holds a control character" in ws.error_line(err), err
    assert list(work.iterdir()) == []
    ok_cli("publish", trajectory[0], "--store", "run-2026-12-05T22:00/store", cwd=work)  # a ':' in a folder's name
    ok_cli("publish", trajectory[0], "--store", "./s3:local", cwd=work)
    assert (work / "s3:local" / "HEAD").is_file() and "0" in ok_cli("versions", "--store", "./s3:local", cwd=work)


@pytest.mark.parametrize("answer", ["portal", "redirect"])
def test_an_endpoint_that_is_no_s3_server_is_one_line(answer, tmp_path, cli_env, ws):
    """A captive portal (200 with an HTML page, no ETag) gave a traceback ending in ``KeyError:
    'ETag'``; an endpoint answering 302 to itself a ``RecursionError`` of ~3,000 lines. Each is one
    line saying the endpoint seems no S3 server, exit 1."""
    import http.server
    import subprocess
    import sys
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def _answer(self):
            if answer == "redirect":
                self.send_response(302)
                self.send_header("Location", f"http://127.0.0.1:{self.server.server_port}{self.path}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            body = b"<html><body>Sign in to the hotel wifi</body></html>"
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        do_GET = do_HEAD = do_PUT = do_POST = _answer

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    env = dict(cli_env, AWS_ACCESS_KEY_ID="k", AWS_SECRET_ACCESS_KEY="s", AWS_DEFAULT_REGION="us-east-1")
    url = f"http://127.0.0.1:{server.server_port}"
    try:
        r = subprocess.run(
            [sys.executable, "-m", "weightsync.cli", "versions", "--store", "s3://b/run", "--endpoint-url", url],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        server.shutdown()
    assert r.returncode == 1, r.stderr
    line = ws.error_line(r.stderr)
    assert "is the endpoint an S3 server?" in line or "is it an S3 server?" in line, line


def test_a_store_or_pull_target_inside_a_folder_holding_a_version_is_refused(published, tmp_path, run_cli, ok_cli, ws):
    """A new store published into a subscriber's served slot (``T/current/S2``), or a pull target put
    there, exited 0; the slot's next update removed them with every version they held. Each is
    refused before anything is written, whatever the spelling (the link, ``..``)."""
    from weightsync.errors import UsageError
    from weightsync.store.repo import open_repo
    from weightsync.sync.selection import Selection, materialize

    store, traj = published
    held = tmp_path / "held"
    ok_cli("pull", "--store", store, held, "--version", 1)
    link = tmp_path / "current"
    link.symlink_to(held)
    before = ws.snapshot(held)
    for inner in (link / "S2", held / "sub" / "S2", tmp_path / "x" / ".." / "held" / "S2"):
        rc, _, err = run_cli("publish", traj[0], "--store", f"file://{inner}")
        assert rc != 0 and f"is inside {held}, which holds a weightsync version" in ws.error_line(err), err
        rc, _, err = run_cli("pull", "--store", store, inner, "--version", 0)
        assert rc != 0 and f"is inside {held}, which holds a weightsync version" in ws.error_line(err), err
        with pytest.raises(UsageError, match=f"is inside {held}, which holds a weightsync version"):
            materialize(open_repo(store), inner, 0, Selection(include=("*",)))  # as a partial subscriber
    assert ws.snapshot(held) == before
    ok_cli("verify", "--store", store, held, "--version", 1)
    from weightsync.errors import VersionError

    with pytest.raises(VersionError, match="version 6 does not exist .*head is 5"):  # as a pull: none above the head
        materialize(open_repo(store), tmp_path / "partial", 6, Selection(include=("*",)))


def test_a_bind_mount_of_the_checkpoint_hides_neither_a_store_nor_a_cache_in_it(published, tmp_path, run_cli, ws):
    """A store or a cache reached through a bind mount of the checkpoint passed the checks (real
    paths differ): chunks, or a pulled copy of the head, were written into the checkpoint, and every
    publish of it failed after. Folders compare by device and inode now: refused, nothing written."""
    import subprocess

    from weightsync.local.state import holds

    store, traj = published
    bind = tmp_path / "bind"
    bind.mkdir()
    r = subprocess.run(["mount", "--bind", str(traj[1]), str(bind)], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot bind-mount here (needs root or CAP_SYS_ADMIN): {r.stderr.strip()}")
    try:
        before = ws.snapshot(traj[1])
        line = _fails(ws, run_cli, [traj[1], store], "publish", traj[1], "--store", f"file://{bind}/store")
        assert "is inside the checkpoint folder" in line, line
        line = _fails(ws, run_cli, [traj[1], store], "publish", traj[1], "--store", store, "--cache-dir", bind / "c")
        assert "overlap" in line, line
        assert ws.snapshot(traj[1]) == before
        assert holds(bind, traj[1]) and holds(traj[1], bind / "new") and not holds(bind, traj[0])
    finally:
        subprocess.run(["umount", "-l", str(bind)], check=False)


# --- versions that do not exist, folders weightsync does not own ----------------------------------
def test_pull_missing_version(world, tmp_path, run_cli, ws):
    store, _, out = world
    fresh = tmp_path / "fresh"
    watched = [store, out, fresh]
    _fails(ws, run_cli, watched, "pull", "--store", store, "--version", 6, out)
    _fails(ws, run_cli, watched, "pull", "--store", store, "--version", 99, fresh)
    _fails(ws, run_cli, watched, "verify", "--store", store, "--version", 6, out)


def test_pull_version_in_a_gap(trajectory, tmp_path, run_cli, ok_cli, ws):
    store = tmp_path / "store"
    ok_cli("publish", trajectory[0], "--store", store, "--version", 0)
    ok_cli("publish", trajectory[1], "--store", store, "--version", 5)
    out = tmp_path / "out"
    ok_cli("pull", "--store", store, "--version", 0, out)
    _fails(ws, run_cli, [store, out], "pull", "--store", store, "--version", 3, out)
    _fails(ws, run_cli, [store, out, tmp_path / "fresh"], "pull", "--store", store, "--version", 3, tmp_path / "fresh")
    ws.assert_replica(out, trajectory[0])


def test_verify_missing_dir(published, tmp_path, run_cli, ws):
    store, _ = published
    _fails(ws, run_cli, [store, tmp_path / "nope"], "verify", "--store", store, tmp_path / "nope")
    (tmp_path / "a_file").write_text("x")
    _fails(ws, run_cli, [store, tmp_path / "a_file"], "verify", "--store", store, tmp_path / "a_file")


def test_verify_or_pull_on_a_subscribers_target_points_at_its_current_folder(published, tmp_path, run_cli, ok_cli, ws):
    """``verify`` of a subscriber's --target said it lacked files, and ``pull`` into it that it held
    no version, without a word of the ``current`` folder that holds the version."""
    store, _ = published
    target = tmp_path / "target"
    ok_cli("pull", "--store", store, target / "slots" / "a")
    (target / "current").symlink_to("slots/a")
    hint = f"({target} is a subscriber's target: its version is in {target / 'current'})"
    for args in (("verify", "--store", store, target), ("pull", "--store", store, target)):
        assert _fails(ws, run_cli, [store, target], *args).endswith(hint)
    ok_cli("verify", "--store", store, target / "current")


def test_verify_mismatch_is_one_line(published, run_cli, ws):
    store, traj = published
    _fails(ws, run_cli, [store, traj[1]], "verify", "--store", store, "--version", 4, traj[1])


def test_pull_into_foreign_folder(published, tmp_path, run_cli, ws):
    store, _ = published
    mine = tmp_path / "mine"
    (mine / "sub").mkdir(parents=True)
    (mine / "model.safetensors").write_bytes(b"precious, not from weightsync")
    (mine / "sub" / "x.txt").write_text("keep me")
    line = _fails(ws, run_cli, [store, mine], "pull", "--store", store, mine)
    assert str(mine) in line
    only_hidden = tmp_path / "only_hidden"
    only_hidden.mkdir()
    (only_hidden / ".cache").write_text("x")
    _fails(ws, run_cli, [store, only_hidden], "pull", "--store", store, only_hidden)


def test_pull_with_corrupt_local_state(world, run_cli, ws):
    store, _, out = world
    (out / ".weightsync" / "state.json").write_text("{ not json")
    _fails(ws, run_cli, [store, out], "pull", "--store", store, "--version", 2, out)


def test_pull_into_a_file(published, tmp_path, run_cli, ws):
    store, _ = published
    target = tmp_path / "a_file"
    target.write_text("not a folder")
    _fails(ws, run_cli, [store, tmp_path / "a_file"], "pull", "--store", store, target)


# --- corrupted stored objects ---------------------------------------------------------------------
def _chunk_files(store: Path, version: int) -> list[Path]:
    doc = json.loads((store / "versions" / f"{version:020d}.json").read_bytes())
    return [store / "chunks" / c["id"][:2] / c["id"] for c in doc["chunks"]]


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_corrupt_chunk_incremental_pull(damage, world, tmp_path, run_cli, ok_cli, ws):
    store, traj, out = world
    chunk = _chunk_files(store, 2)[-1]
    original = chunk.read_bytes()
    if damage == "flip":
        ws.flip_byte(chunk, len(original) // 2)
    elif damage == "truncate":
        chunk.write_bytes(original[:-1])
    else:
        chunk.unlink()
    files_before = ws.content(out)
    rc, _, stderr = run_cli("pull", "--store", store, "--version", 2, out)
    assert rc != 0
    line = ws.error_line(stderr)
    assert chunk.name in line
    if damage != "delete":
        assert "checksum" in line
    assert ws.content(out) == files_before
    ws.assert_replica(out, traj[1])
    # once the chunk is repaired the same pull goes through
    chunk.write_bytes(original)
    ok_cli("pull", "--store", store, "--version", 2, out)
    ws.assert_replica(out, traj[2])


def test_corrupt_chunk_fresh_pull(published, tmp_path, run_cli, ws):
    store, _ = published
    chunks = _chunk_files(store, 0)
    ws.flip_byte(chunks[0], 100)
    fresh = tmp_path / "fresh"
    rc, _, stderr = run_cli("pull", "--store", store, "--version", 0, fresh)
    assert rc != 0
    line = ws.error_line(stderr)
    assert "checksum" in line and chunks[0].name in line
    assert ws.content(fresh) == {}  # no file at all, so no wrong byte


def test_corrupt_manifest(world, tmp_path, run_cli, ws):
    store, _, out = world
    manifest = store / "versions" / f"{2:020d}.json"
    manifest.write_bytes(manifest.read_bytes()[:-10])
    _fails(ws, run_cli, [store, out], "pull", "--store", store, "--version", 2, out)
    _fails(ws, run_cli, [store, out], "versions", "--store", store)


@pytest.mark.parametrize("keep", ["0", "-1"])
def test_gc_keeps_at_least_one_version(keep, world, run_cli, ws):
    """``--keep 0`` would delete the head itself: refused before anything is listed or deleted."""
    store, _, out = world
    line = _fails(ws, run_cli, [store, out], "gc", "--store", f"file://{store}", "--keep", keep, "--grace-seconds", "0")
    assert line == f"weightsync: error: gc must keep at least 1 version, got --keep {keep}"


@pytest.mark.parametrize(
    "args, line",
    [
        (["fleet", "--expire-after", "-5"], "--expire-after must be a positive number of seconds, not -5"),
        (["demo", "--steps", "-1"], "--steps and --hidden must be at least 1, got -1 and 256"),
        (["demo", "--hidden", "0"], "--steps and --hidden must be at least 1, got 8 and 0"),
    ],
)
def test_numbers_out_of_range_are_refused(args, line, world, tmp_path, run_cli, ws):
    """They ran: a fleet whose records expire before they are written, a demo that did nothing (or
    divided by zero) and exited 0."""
    store, _, out = world
    extra = ["--store", f"file://{store}"] if args[0] == "fleet" else ["--workdir", str(tmp_path / "demo")]
    assert _fails(ws, run_cli, [store, out], *args, *extra) == f"weightsync: error: {line}"
    assert not (tmp_path / "demo").exists()


def test_a_demo_workdir_that_is_a_file_or_not_empty_is_refused_before_anything_runs(tmp_path, run_cli, ws):
    """A second demo in one folder printed its table's header, then failed: version 0 already existed."""
    (tmp_path / "afile").write_text("x")
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "store").mkdir()
    for work, line in (("afile", "not a directory"), ("used", "is not empty: give a new or empty folder")):
        out = _fails(ws, run_cli, [tmp_path], "demo", "--workdir", tmp_path / work)
        assert out == f"weightsync: error: --workdir {tmp_path / work}{':' if work == 'afile' else ''} {line}"


def test_a_store_inside_the_checkpoint_is_refused(trajectory, tmp_path, run_cli, ws):
    """Every try failed with "appeared in the checkpoint while it was published ... publish it again
    once it is complete" (the publish's own chunks) and left more chunks in the checkpoint."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(trajectory[0], ckpt)
    for store in (ckpt / "store", ckpt):
        line = _fails(ws, run_cli, [ckpt], "publish", str(ckpt), "--store", f"file://{store}")
        assert line == f"weightsync: error: the store file://{store} is inside the checkpoint folder {ckpt}; " + (
            "keep the store elsewhere"
        )
    # reached through a link the scan follows (to the store, or to a folder above it): the same, in the
    # scan, for publish and publish-part; the store, empty or not, gets nothing
    outside = tmp_path / "outside"
    store = outside / "store"
    store.mkdir(parents=True)
    (store / "chunks").mkdir()
    links = (("storelink", store, "storelink"), ("up", outside, "up/store"), ("inner", store / "chunks", "inner"))
    for link, target, seen in links:
        (ckpt / link).symlink_to(target)
        for cmd in (["publish"], ["publish-part", "--rank", "0", "--world", "1"]):
            line = _fails(ws, run_cli, [ckpt, outside], *cmd, str(ckpt), "--store", f"file://{store}")
            assert f"cannot publish {seen!r}: it is, or links into, the store's folder" in line, line
        (ckpt / link).unlink()
