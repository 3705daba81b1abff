"""The publisher and subscriber daemons as real processes (``python -m weightsync.cli ...``).

A trainer-like script drops checkpoints (folder first, then the ``COMPLETE`` marker); a publisher
publishes them; two subscribers converge byte for byte; pins roll them back and forward; the swap
hooks (a real aiohttp server, and a command) get their calls; the fleet ledger shows both; SIGTERM
exits 0 with ``current`` intact. Ports are picked free by binding port 0; waits poll with timeouts.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import cli_zygote
import pytest

import weightsync
from weightsync.demo import SyntheticTrainer, make_trajectory
from weightsync.local.checkpoint import scan_checkpoint
from weightsync.sync.selection import read_partial_state, verify_partial

TINY = dict(hidden=32, layers=1, experts=2, vocab=128)
TRAINER = """
import sys, time
from pathlib import Path
from weightsync.demo import SyntheticTrainer
root, first, steps, delay = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
t = SyntheticTrainer(hidden=32, layers=1, experts=2, vocab=128, seed=0)
for i in range(first + steps):
    if i:
        t.step()
    if i >= first:
        d = t.save(root / f"checkpoint-{i}")    # the folder first ...
        (d / "COMPLETE").write_text("")          # ... then the marker
        time.sleep(delay)
"""


# --- helpers (also used by test_api.py) ------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(pred, timeout: float = 30.0, what: str = "condition", interval: float = 0.05):
    """Poll ``pred()`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = pred()
        except (OSError, ValueError) as exc:  # not up yet
            last = exc
        if last and not isinstance(last, Exception):
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


def http(method: str, url: str, body: object = None, token: str | None = None, timeout: float = 10.0):
    """(status, parsed JSON or text, headers) of one request; HTTP errors are returned, not raised."""
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw, status, headers = resp.read(), resp.status, resp.headers
    except urllib.error.HTTPError as exc:
        raw, status, headers = exc.read(), exc.code, exc.headers
    try:
        return status, json.loads(raw), headers
    except ValueError:
        return status, raw.decode(), headers


class Daemon:
    """A daemon subprocess with its HTTP API on a free port; output goes to a log file."""

    _count = 0

    def __init__(self, role: str, args: list, tmp: Path, env: dict | None = None, token: str | None = None):
        self.role, self.token = role, token
        Daemon._count += 1
        self.port, self.url = 0, ""  # the daemon binds port 0 and logs the port it got: no races
        self.log_path = tmp / f"{role}-{Daemon._count}.log"
        self.args = [role, *map(str, args), "--listen", "127.0.0.1:0", "--poll-interval", "0.1"]
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None

    start_timeout = 60.0  # seconds to log the port and answer /healthz (another xdist worker may load the cores)

    def start(self) -> Daemon:
        seen = len(self.log())  # a restart appends to the same log: look only at what follows
        zygote, out = cli_zygote.current(), subprocess.STDOUT  # forked where it can be, as the tests' commands are
        self.proc = zygote and zygote.spawn(self.args, self.env, stdout=self.log_path, append=True, stderr=out)
        if self.proc is None:
            with open(self.log_path, "ab") as log:
                argv = [sys.executable, "-m", "weightsync.cli", *self.args]
                self.proc = subprocess.Popen(argv, stdout=log, stderr=out, env=self.env)
        bound = wait_for(
            lambda: self._alive() and re.search(r"listening.*?http://127\.0\.0\.1:(\d+)", self.log()[seen:]),
            self.start_timeout,
            f"{self.role} to log its port\n{self.log()}",
        )
        self.port = int(bound.group(1))
        self.url = f"http://127.0.0.1:{self.port}"
        wait_for(
            lambda: self._alive() and http("GET", self.url + "/healthz", timeout=1)[0] == 200,
            20,
            f"{self.role} to answer /healthz\n{self.log()}",
        )
        return self

    def _alive(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"{self.role} exited with {self.proc.returncode}:\n{self.log()}")
        return True

    def get(self, path: str, **kw):
        return http("GET", self.url + path, token=kw.pop("token", self.token), **kw)

    def status(self) -> dict:
        code, body, _ = self.get("/v1/status")
        assert code == 200, body
        return body

    def put_target(self, version) -> dict:
        code, body, _ = http("PUT", self.url + "/v1/target", {"version": version}, token=self.token)
        assert code == 200, body
        return body

    def wait_version(self, version: int, timeout: float = 30.0) -> dict:
        return wait_for(
            lambda: (s := self.status())["current_version"] == version and s["state"] in ("serving", "degraded") and s,
            timeout,
            f"{self.role} to serve version {version}\n{self.log()}",
        )

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGUSR2)  # the log then says where its threads are
            self.proc.send_signal(signal.SIGUSR1)  # and where its tasks wait (if its loop still runs)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(3)
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"{self.role} ignored signal {sig}:\n{self.log()}") from None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


@pytest.fixture
def daemons(tmp_path):
    """``start(role, args, **kw)`` starts a daemon; all are stopped (SIGTERM) at the end of the test."""
    started: list[Daemon] = []

    def start(role: str, args: list, **kw) -> Daemon:
        d = Daemon(role, args, tmp_path, **kw).start()
        started.append(d)
        return d

    yield start
    for d in started:
        if d.proc and d.proc.poll() is None:
            d.proc.kill()
            d.proc.wait()


class HookServer:
    """A real aiohttp server in a thread that records the JSON bodies of swap hook calls."""

    def __init__(self, fail_first: int = 0):
        from aiohttp import web

        self.calls: list[dict] = []
        self.fail_first = fail_first
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/hook"
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()

        async def hook(request: web.Request) -> web.Response:
            if self.fail_first > 0:
                self.fail_first -= 1
                return web.Response(status=503, text="not now")
            self.calls.append(await request.json())
            return web.json_response({"ok": True})

        async def main() -> None:
            app = web.Application()
            app.router.add_post("/hook", hook)
            self._runner = web.AppRunner(app)
            await self._runner.setup()
            await web.TCPSite(self._runner, "127.0.0.1", self.port).start()
            self._started.set()

        self._thread = threading.Thread(
            target=lambda: (self._loop.run_until_complete(main()), self._loop.run_forever()), daemon=True
        )
        self._thread.start()
        assert self._started.wait(10)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


def trainer(watch: Path, first: int, steps: int, delay: float = 0.05) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", TRAINER, str(watch), str(first), str(steps), str(delay)])


def tensor_bytes(folder: Path) -> dict[str, bytes]:
    """Every tensor of every safetensors file in ``folder``: name -> raw bytes."""
    out = {}
    for f in scan_checkpoint(folder):
        data = f.abspath.read_bytes()
        out.update({s.name: data[s.begin : s.end] for s in f.segments if s.role == "tensor"})
    return out


def verify_current(store: str, target: Path, version: int, checkpoint: Path) -> None:
    """``target/current`` holds ``version`` byte for byte: ``weightsync verify`` and a comparison with
    the checkpoint folder it was published from."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "weightsync.cli",
            "verify",
            "--store",
            store,
            "--version",
            str(version),
            str(target / "current"),
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    live = target / "current"
    assert os.readlink(live) in ("slots/a", "slots/b")
    files = sorted(
        p.relative_to(checkpoint).as_posix() for p in checkpoint.rglob("*") if p.is_file() and p.name != "COMPLETE"
    )
    assert (
        sorted(p.relative_to(live).as_posix() for p in live.rglob("*") if p.is_file() and ".weightsync" not in p.parts)
        == files
    )
    for f in files:
        assert (live / f).read_bytes() == (checkpoint / f).read_bytes(), f


# --- tests -----------------------------------------------------------------------------------------
def test_two_subscribers_converge_pin_roll_back_and_forward_hooks_fleet_sigterm(tmp_path, daemons):
    store, watch = f"file://{tmp_path / 'store'}", tmp_path / "watch"
    watch.mkdir()
    hook = HookServer(fail_first=1)  # the first call fails: retried, counted
    hook_log = tmp_path / "hook-command.log"
    try:
        pub = daemons(
            "publisher",
            ["--store", store, "--watch", watch, "--state-dir", tmp_path / "pubstate", "--id", "pub", "--region", "eu"],
        )
        common = ["--store", store, "--ledger-interval", "0.2", "--no-fsync", "--hook-backoff", "0.05"]
        a = daemons(
            "subscriber",
            [*common, "--target", tmp_path / "a", "--id", "sub-a", "--region", "us", "--hook-url", hook.url],
        )
        b = daemons(
            "subscriber",
            [
                *common,
                "--target",
                tmp_path / "b",
                "--id",
                "sub-b",
                "--region",
                "ap",
                "--hook-command",
                f"sh -c 'echo {{version}} {{path}} >> {hook_log}'",
            ],
        )
        assert trainer(watch, 0, 5).wait(60) == 0
        wait_for(lambda: pub.status()["head_version"] == 4, 30, f"publisher to publish step 4\n{pub.log()}")
        for sub, name in ((a, "a"), (b, "b")):
            sub.wait_version(4)
            verify_current(store, tmp_path / name, 4, watch / "checkpoint-4")

        # roll back, then forward, then follow the head again
        for target, expect in ((2, 2), (3, 3), ("latest", 4)):
            status = a.put_target(target)
            assert status["target"] == target
            a.wait_version(expect)
            verify_current(store, tmp_path / "a", expect, watch / f"checkpoint-{expect}")
        assert a.status()["latest_version"] == 4 and a.status()["lag"] == 0
        assert len(os.listdir(tmp_path / "a" / "slots")) == 2  # never more than two copies

        # hooks: every swap of A reached the server (after a failed first try), B ran its command
        wait_for(lambda: [c["version"] for c in hook.calls][-4:] == [4, 2, 3, 4], 10, f"hook calls, got {hook.calls}")
        assert all(Path(c["path"]).parent == tmp_path / "a" / "slots" for c in hook.calls)
        assert "weightsync_swap_hook_failures_total" in a.get("/metrics")[1]
        assert (
            'weightsync_swap_hook_failures_total{cluster="",region="us",subscriber="sub-a"} 1.0' in a.get("/metrics")[1]
        )
        wait_for(lambda: hook_log.exists() and hook_log.read_text().split()[-2] == "4", 10, "hook command")

        # metrics and the fleet ledger
        metrics = a.get("/metrics")[1]
        assert 'weightsync_current_version{cluster="",region="us",subscriber="sub-a"} 4.0' in metrics
        assert 'weightsync_version_lag{cluster="",region="us",subscriber="sub-a"} 0.0' in metrics
        fleet = wait_for(
            lambda: (
                (f := pub.get("/v1/fleet")[1])
                and len(f["subscribers"]) == 2
                and all(r["current_version"] == 4 for r in f["subscribers"])
                and f
            ),
            10,
            "fleet",
        )
        assert {r["id"]: (r["region"], r["lag"], r["staleness_seconds"]) for r in fleet["subscribers"]} == {
            "sub-a": ("us", 0, 0.0),
            "sub-b": ("ap", 0, 0.0),
        }
        out = subprocess.run(
            [sys.executable, "-m", "weightsync.cli", "fleet", "--store", store],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert "sub-a" in out and "sub-b" in out and "head version: 4" in out
        pub_metrics = pub.get("/metrics")[1]
        assert 'weightsync_published_version{cluster="",region="eu"} 4.0' in pub_metrics
        assert 'weightsync_publish_seconds_count{cluster="",phase="upload",region="eu"} 5.0' in pub_metrics

        for d in (a, b, pub):
            assert d.stop() == 0, d.log()
        for name in ("a", "b"):
            verify_current(store, tmp_path / name, 4, watch / "checkpoint-4")
        pub.start()  # restarted: the gauge reads the store's head (it said -1 until the next publish)
        wait_for(
            lambda: 'weightsync_published_version{cluster="",region="eu"} 4.0' in pub.get("/metrics")[1],
            20,
            "the restarted publisher's gauge",
        )
        assert pub.stop() == 0
        assert sum("swapped to version" in line for line in a.log().splitlines()) >= 4
    finally:
        hook.close()


def test_standby_is_seeded_from_current_so_each_sync_fetches_one_delta(tmp_path, daemons):
    """After a fresh start the standby slot is empty: it is filled from the current slot (a copy
    while idle, else hard links), so the next version costs one delta, not a full download (nor
    two deltas later). The codec's kernels are loaded at start, before any delta."""
    store = f"file://{tmp_path / 'store'}"
    traj = make_trajectory(tmp_path / "traj", steps=3, hidden=64, layers=1, experts=2, vocab=512)
    weightsync.publish(traj[0], store, 0)
    sub = daemons("subscriber", ["--store", store, "--target", tmp_path / "t", "--no-fsync"])
    full = sub.wait_version(0)["last_sync"]["fetched_bytes"]
    wait_for(lambda: "codec kernels ready" in sub.log(), 60, "the codec warm-up")
    for v in (1, 2, 3):
        weightsync.publish(traj[v], store, v, base_dir=traj[v - 1])
        last = sub.wait_version(v)["last_sync"]
        delta = weightsync.open_repo(store).manifest(v).payload_bytes
        assert last["from_version"] == v - 1 and last["fetched_bytes"] <= 2 * delta < full / 4, (last, delta, full)
        verify_current(store, tmp_path / "t", v, traj[v])

    # SIGUSR1: the log says where each task waits (down its chain of awaits) and each thread's stack
    sub.proc.send_signal(signal.SIGUSR1)
    # the loop's task (begun once the port is bound), and what it awaits (its iteration or its pause):
    # a chain, not one frame
    chain = re.compile(
        r'task subscriber:\n  File "[^"]*runtime\.py", line \d+, in after_listening\n.*\n'
        r'  File "[^"]*subscriber\.py", line \d+, in run\n.*\n  File "[^"]*", line \d+, in _'
    )

    def dump():  # the whole record (read while being written, it may end early)
        m = re.search(r"stacks of \d+ tasks.*?(?=\n\d{4}-|\Z)", sub.log(), re.S)
        return m and chain.search(m[0]) and "thread MainThread:" in m[0] and "in dump_stacks" in m[0]

    wait_for(dump, 10, f"the stacks of the loop's tasks and of the threads\n{sub.log()}")
    sub.proc.send_signal(signal.SIGUSR2)  # faulthandler: every thread, also where the loop is stuck
    wait_for(lambda: re.search(r"Current thread 0x[0-9a-f]+ \(most recent call first\)", sub.log()), 10, "a dump")
    assert sub.get("/healthz")[0] == 200 and sub.stop() == 0


def test_sigterm_mid_sync_leaves_current_intact_and_restart_resumes(tmp_path, daemons):
    """SIGTERM right after a new target is set (so mostly during the ~1 MB sync it starts): exit 0,
    ``current`` always a whole verified version, and a restart converges."""
    store = tmp_path / "store"
    traj = make_trajectory(tmp_path / "traj", steps=3, hidden=96, layers=2, experts=4, vocab=256)
    for ckpt in traj:
        weightsync.publish(ckpt, store)
    target = tmp_path / "sub"
    args = ["--store", store, "--target", target, "--id", "s1", "--no-fsync"]
    for pin, then in ((1, 3), (3, 0), (0, 2), (2, 1)):
        sub = daemons("subscriber", [*args, "--version", pin])
        sub.wait_version(pin)
        sub.put_target(then)
        assert sub.stop() == 0, sub.log()
        state = json.loads((target / "current" / ".weightsync" / "state.json").read_text())
        assert state["version"] in (pin, then)
        verify_current(str(store), target, state["version"], traj[state["version"]])
    sub = daemons("subscriber", args)  # without --version: the last pin set through the API (stored)
    assert sub.wait_version(1)["target_from"] == "stored"
    sub.put_target("latest")
    sub.wait_version(3)
    verify_current(str(store), target, 3, traj[3])
    assert sub.stop() == 0


def test_stop_token_aborts_pull_and_publish_before_they_commit(tmp_path):
    """The daemons' shutdown path: a set stop token makes a pull or publish raise from its progress
    callback, before anything is installed or committed."""
    from weightsync.local.state import read_state
    from weightsync.local.verify import verify_folder
    from weightsync.service.runtime import Stopped, StopToken

    store = tmp_path / "store"
    traj = make_trajectory(tmp_path / "traj", steps=3, **TINY)
    for ckpt in traj[:3]:
        weightsync.publish(ckpt, store)
    repo = weightsync.open_repo(store)
    slot = tmp_path / "slot"
    weightsync.pull(repo, slot, 1)
    token = StopToken()
    token.set()
    with pytest.raises(Stopped):
        weightsync.pull(repo, slot, 2, progress=token.check, on_bytes=token.check)
    assert read_state(slot).version == 1
    verify_folder(slot, repo.manifest(1))
    with pytest.raises(Stopped):
        weightsync.publish(traj[3], repo, progress=token.check)
    assert repo.head_version() == 2


def test_publisher_waits_for_unfinished_checkpoints_resumes_after_restart_and_survives_a_changed_base(
    tmp_path, daemons
):
    store, watch = f"file://{tmp_path / 'store'}", tmp_path / "watch"
    watch.mkdir()
    t = SyntheticTrainer(**TINY)
    dirs = []
    for i in range(5):
        if i:
            t.step()
        dirs.append(t.save(watch / f"step_{i:06d}"))
    for i in (0, 1, 3):
        (dirs[i] / "COMPLETE").write_text("")
    args = ["--store", store, "--watch", watch, "--state-dir", tmp_path / "state"]
    pub = daemons("publisher", args)
    status = wait_for(lambda: (s := pub.status())["head_version"] == 1 and s["state"] == "waiting" and s, 20, "head 1")
    assert status["pending"] == [2, 3, 4] and "checkpoint 2" in status["reason"]
    assert weightsync.open_repo(store).versions() == [0, 1]  # 3 is ready but must not skip 2
    assert pub.stop() == 0

    # the head version's folder changes behind the publisher's back: it falls back to the cache,
    # which (hard links!) changed too, and is rebuilt from the store
    with open(dirs[1] / "model.safetensors", "r+b") as f:  # in place: the same inode as the cache's link
        f.seek(-3, os.SEEK_END)
        byte = f.read(1)
        f.seek(-3, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))
    (dirs[2] / "COMPLETE").write_text("")
    (dirs[4] / "COMPLETE").write_text("")
    pub = daemons("publisher", args)
    wait_for(lambda: pub.status()["head_version"] == 4, 30, f"head 4\n{pub.log()}")
    assert weightsync.open_repo(store).versions() == [0, 1, 2, 3, 4]
    for i in (0, 2, 3, 4):
        (dirs[i] / "COMPLETE").unlink()  # the marker is not published
        weightsync.verify(store, dirs[i], i)
    assert "using the cache" in pub.log()

    # an explicit publish through the API, then a folder outside the allowed roots
    extra = t.save(watch / "manual-7")
    code, body, _ = http("POST", pub.url + "/v1/publish", {"path": str(extra)})
    assert code == 200 and body["version"] == 7 and not body["keyframe"], body
    code, body, _ = http("POST", pub.url + "/v1/publish", {"path": str(tmp_path)})
    assert code == 403 and "not under the watched folder" in body["error"]
    assert pub.stop() == 0


def test_partial_subscriber_fetches_and_materializes_only_selected_tensors(tmp_path, daemons):
    store = tmp_path / "store"
    traj = make_trajectory(tmp_path / "traj", steps=2, shards=2, hidden=128, layers=2, experts=4, vocab=256)
    for ckpt in traj:
        weightsync.publish(ckpt, store)
    target = tmp_path / "rank1"
    sub = daemons(
        "subscriber",
        [
            "--store",
            store,
            "--target",
            target,
            "--no-fsync",
            "--include",
            "model.layers.*.mlp.experts.1.*",
            "--include",
            "model.norm.weight",
            "--exclude",
            "*.down_proj.*",
        ],
    )
    status = sub.wait_version(2)
    repo = weightsync.open_repo(store)
    assert verify_partial(repo, target / "current", 2) == 2
    assert status["last_sync"]["fetched_bytes"] < repo.manifest(2).raw_bytes / 4
    got, expect = tensor_bytes(target / "current"), tensor_bytes(traj[2])
    want = {n for n in expect if (".mlp.experts.1." in n and ".down_proj." not in n) or n == "model.norm.weight"}
    assert set(got) == want and len(want) == 5
    assert all(got[n] == expect[n] for n in want)
    assert {p.name for p in (target / "current").iterdir()} >= {"config.json", "model.safetensors.index.json"}
    sub.put_target(0)  # roll back: the standby slot is rebuilt from its own bytes where they match
    sub.wait_version(0)
    assert verify_partial(repo, target / "current", 0) == 0
    assert read_partial_state(target / "current").selection.exclude == ("*.down_proj.*",)
    assert sub.stop() == 0


def test_auth_token_guards_v1_only_and_is_never_echoed(tmp_path, daemons):
    store = tmp_path / "store"
    for ckpt in make_trajectory(tmp_path / "traj", steps=1, **TINY):
        weightsync.publish(ckpt, store)
    token = "s3cr3t-token-value"
    sub = daemons(
        "subscriber",
        ["--store", store, "--target", tmp_path / "sub", "--no-fsync", "--log-json"],
        env={"WEIGHTSYNC_API_TOKEN": token},
        token=token,
    )
    token_file = tmp_path / "token"
    token_file.write_text(token + "\n")
    pub = daemons(
        "publisher",
        [
            "--store",
            store,
            "--watch",
            tmp_path / "traj",
            "--state-dir",
            tmp_path / "st",
            "--api-token-file",
            token_file,
        ],
        token=token,
    )
    sub.wait_version(1)
    for d, paths in ((sub, ["/v1/status", "/v1/versions"]), (pub, ["/v1/status", "/v1/versions", "/v1/fleet"])):
        for path in paths:
            for bad in (None, "wrong", token + "x", ""):
                code, body, headers = d.get(path, token=bad)
                assert code == 401 and token not in json.dumps(body), (path, bad, code)
                assert headers["WWW-Authenticate"].startswith("Bearer")
            assert d.get(path)[0] == 200
        for path in ("/healthz", "/readyz", "/metrics", "/openapi.json"):
            assert d.get(path, token=None)[0] == 200
        assert d.get("/openapi.json")[1]["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    code, _, _ = http("PUT", sub.url + "/v1/target", {"version": 0}, token="wrong")
    assert code == 401 and sub.status()["target"] == "latest"
    for d in (sub, pub):
        assert d.stop() == 0
        assert token not in d.log()
    assert all(json.loads(line)["msg"] for line in sub.log().splitlines())  # --log-json: one object per line


@pytest.mark.integration
def test_publisher_and_subscriber_converge_on_s3(s3_url, seaweed, tmp_path, daemons):
    watch = tmp_path / "watch"
    watch.mkdir()
    env = seaweed.env()
    pub = daemons("publisher", ["--store", s3_url, "--watch", watch, "--state-dir", tmp_path / "st"], env=env)
    sub = daemons(
        "subscriber",
        ["--store", s3_url, "--target", tmp_path / "sub", "--no-fsync", "--ledger-interval", "0.2"],
        env=env,
    )
    assert trainer(watch, 0, 3).wait(60) == 0
    sub.wait_version(2, timeout=60)
    verify = subprocess.run(
        [
            sys.executable,
            "-m",
            "weightsync.cli",
            "verify",
            "--store",
            s3_url,
            "--version",
            "2",
            str(tmp_path / "sub" / "current"),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
    )
    assert verify.returncode == 0, verify.stderr
    wait_for(lambda: [r["current_version"] for r in pub.get("/v1/fleet")[1]["subscribers"]] == [2], 10, "fleet on S3")
    assert pub.stop() == 0 and sub.stop() == 0


def test_publisher_reports_watched_steps_whose_numbers_another_writer_took(tmp_path, daemons):
    """A CLI publish takes the next number (2) before the trainer's step 2 is complete, then one takes
    5 past steps 3 and 4: the watcher must not take those steps for published. Each is reported once
    (ERROR, ``last_error``), and a restart does not report the steps complete at its first look."""
    store, watch = f"file://{tmp_path / 'store'}", tmp_path / "watch"
    watch.mkdir()
    t = SyntheticTrainer(**TINY)

    def step(i: int) -> Path:
        if i:
            t.step()
        d = t.save(watch / f"step_{i:06d}")
        (d / "COMPLETE").write_text("")
        return d

    step(0)
    step(1)
    args = ["--store", store, "--watch", watch, "--state-dir", tmp_path / "state", "--poll-interval", 0.1]
    pub = daemons("publisher", args)
    wait_for(lambda: pub.status()["head_version"] == 1, 20, f"head 1\n{pub.log()}")
    pub.stop()
    pub.start()  # what it published before: nothing to report
    wait_for(lambda: pub.status()["state"] == "idle", 20, f"idle\n{pub.log()}")
    other = make_trajectory(tmp_path / "other", steps=0, **{**TINY, "seed": 9})[0]
    weightsync.publish(other, store)  # takes 2
    step(2)
    s = wait_for(lambda: (s := pub.status())["last_error"] and s, 20, f"step 2 reported\n{pub.log()}")
    assert s["last_error"].startswith(
        f"checkpoint {watch / 'step_000002'} is not published: the head is 2, and this publisher did not publish step 2"
    )
    weightsync.publish(other, store, 5)
    step(3)
    wait_for(
        lambda: "the head is 5, and this publisher did not publish step 3" in (pub.status()["last_error"] or ""), 20
    )
    assert pub.stop() == 0
    assert pub.log().count("is not published") == 2 and "step_000001 is not published" not in pub.log()
