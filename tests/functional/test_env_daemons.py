"""Daemons configured from the environment alone, as the deploy files run them (real processes).

A subscriber started as plain ``weightsync subscriber`` with every setting in ``WEIGHTSYNC_*``
variables serves the store's head, logs JSON, and calls its swap hook with the configured headers
(an ``Authorization`` among them) on a real HTTP server on 127.0.0.1, never logging their values.
A bad variable stops a daemon at once with one line naming it (exit 2). The mirror, also configured
from the environment, answers ``/healthz`` and ``/readyz``: 503 while its passes fail (a source
chunk is missing), 200 once one succeeded.
"""

from __future__ import annotations

import http.server
import json
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

SECRET = "hook-secret-0f7c2b"  # sent as a hook header; must never appear in a log
API_TOKEN = "api-token-5d1e9a"


def _env(cli_env: dict, **settings: str) -> dict[str, str]:
    env = {k: v for k, v in cli_env.items() if not k.startswith("WEIGHTSYNC_")}
    return {**env, **settings}


def _get(url: str, token: str | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(url)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


def _wait(pred, what: str, proc: subprocess.Popen, log: Path, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(
                f"exited with {proc.returncode} waiting for {what}:\n{log.read_text(errors='replace')}"
            )
        try:
            if result := pred():
                return result
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}:\n{log.read_text(errors='replace')}")


class _Process:
    """``weightsync COMMAND`` with no flags at all: its settings come from ``env``; output to a log."""

    def __init__(self, command: str, env: dict, log: Path):
        self.log = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "weightsync.cli", command],
                env=env,
                stdout=subprocess.PIPE,
                stderr=out,
                stdin=subprocess.DEVNULL,
            )

    def url(self) -> str:
        m = _wait(
            lambda: re.search(r"listening.*?(http://127\.0\.0\.1:\d+)", self.log.read_text()),
            "the port",
            self.proc,
            self.log,
        )
        return m.group(1)

    def wait(self, pred, what: str, timeout: float = 60.0):
        return _wait(pred, what, self.proc, self.log, timeout)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stdout.close()
        return self.proc.returncode


class _HookServer:
    """A plain HTTP server on 127.0.0.1 recording each request's headers and JSON body; 401
    unless the expected ``Authorization`` header came, echoing the one that did (as debugging
    servers do: the daemon must not log it from the answer either)."""

    def __init__(self, expected_auth: str):
        calls = self.calls = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                calls.append((dict(self.headers.items()), json.loads(body)))
                ok = self.headers.get("Authorization") == expected_auth
                answer = b"" if ok else f"refused Authorization: {self.headers.get('Authorization')}".encode()
                self.send_response(200 if ok else 401)
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/reload"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_a_subscriber_from_the_environment_alone_sends_its_hook_headers(published, cli_env, tmp_path):
    store, _ = published
    hook = _HookServer(f"Bearer {SECRET}")
    env = _env(
        cli_env,
        WEIGHTSYNC_STORE=f"file://{store}",
        WEIGHTSYNC_TARGET=str(tmp_path / "sub"),
        WEIGHTSYNC_LISTEN="127.0.0.1:0",
        WEIGHTSYNC_POLL_INTERVAL="0.1",
        WEIGHTSYNC_NO_FSYNC="true",
        WEIGHTSYNC_ID="env-sub",
        WEIGHTSYNC_REGION="region-e",
        WEIGHTSYNC_LOG_JSON="1",
        WEIGHTSYNC_API_TOKEN=API_TOKEN,
        WEIGHTSYNC_HOOK_URL=hook.url,
        WEIGHTSYNC_HOOK_BODY='{"v": {version}, "path": "{path}"}',
        WEIGHTSYNC_HOOK_BACKOFF="0.05",
        WEIGHTSYNC_HOOK_HEADER=f"Authorization: Bearer {SECRET}\nX-Weightsync-Run: run-7\n",
    )
    sub = _Process("subscriber", env, tmp_path / "subscriber.log")
    try:
        url = sub.url()
        status = sub.wait(
            lambda: (s := _get(url + "/v1/status", API_TOKEN)[1])["current_version"] == 5 and s, "version 5"
        )
        assert status["id"] == "env-sub" and _get(url + "/readyz")[0] == 200
        assert _get(url + "/v1/status")[0] == 401, "the token came from WEIGHTSYNC_API_TOKEN"
        sub.wait(lambda: hook.calls, "the swap hook")
        headers, body = hook.calls[0]
        assert headers["Authorization"] == f"Bearer {SECRET}" and headers["X-Weightsync-Run"] == "run-7"
        assert headers["Content-Type"] == "application/json" and body["v"] == 5
        sub.wait(lambda: _get(url + "/v1/status", API_TOKEN)[1]["hook"]["ok"], "the hook to succeed")
    finally:
        hook.close()
        code = sub.stop()
    assert code == 0
    log = sub.log.read_text()
    assert SECRET not in log and API_TOKEN not in log
    records = [json.loads(line) for line in log.splitlines() if line.strip()]  # --log-json from WEIGHTSYNC_LOG_JSON
    assert any(r["msg"] == "listening" for r in records)


def test_a_hook_refused_without_its_header_is_retried_and_logged_without_values(published, cli_env, tmp_path):
    store, _ = published
    hook = _HookServer("Bearer something-else")
    env = _env(
        cli_env,
        WEIGHTSYNC_STORE=f"file://{store}",
        WEIGHTSYNC_TARGET=str(tmp_path / "sub"),
        WEIGHTSYNC_LISTEN="127.0.0.1:0",
        WEIGHTSYNC_POLL_INTERVAL="0.1",
        WEIGHTSYNC_NO_FSYNC="1",
        WEIGHTSYNC_HOOK_URL=hook.url,
        WEIGHTSYNC_HOOK_ATTEMPTS="2",
        WEIGHTSYNC_HOOK_BACKOFF="0.05",
        WEIGHTSYNC_HOOK_HEADER=f"Authorization: Bearer {SECRET}",
    )
    sub = _Process("subscriber", env, tmp_path / "subscriber.log")
    try:
        url = sub.url()
        sub.wait(lambda: (h := _get(url + "/v1/status")[1]["hook"]) and h["state"] == "failed", "the hook to give up")
        assert len(hook.calls) == 2 and all(h["Authorization"] == f"Bearer {SECRET}" for h, _ in hook.calls)
    finally:
        hook.close()
        sub.stop()
    log = sub.log.read_text()
    assert "HTTP 401 from hook" in log and SECRET not in log


@pytest.mark.parametrize(
    "role, settings, var",
    [
        ("subscriber", {"WEIGHTSYNC_POLL_INTERVAL": "0"}, "WEIGHTSYNC_POLL_INTERVAL"),
        ("subscriber", {"WEIGHTSYNC_NO_FSYNC": "maybe"}, "WEIGHTSYNC_NO_FSYNC"),
        ("publisher", {"WEIGHTSYNC_CHUNK_MIB": "lots"}, "WEIGHTSYNC_CHUNK_MIB"),
        ("mirror", {"WEIGHTSYNC_METRICS_LISTEN": "127.0.0.1:99999"}, "WEIGHTSYNC_METRICS_LISTEN"),
    ],
)
def test_a_bad_variable_stops_the_daemon_with_one_line(published, cli_env, tmp_path, role, settings, var):
    store, _ = published
    (tmp_path / "watch").mkdir()
    env = _env(
        cli_env,
        WEIGHTSYNC_STORE=str(store),
        WEIGHTSYNC_TARGET=str(tmp_path / "sub"),
        WEIGHTSYNC_WATCH=str(tmp_path / "watch"),
        WEIGHTSYNC_STATE_DIR=str(tmp_path / "state"),
        WEIGHTSYNC_FROM=str(store),
        WEIGHTSYNC_TO=str(tmp_path / "dst"),
        WEIGHTSYNC_LISTEN="127.0.0.1:0",
        **settings,
    )
    r = subprocess.run(
        [sys.executable, "-m", "weightsync.cli", role], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    lines = r.stderr.splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0].startswith(f"weightsync: error: {var}"), lines[0]
    assert not (tmp_path / "sub").exists() and not (tmp_path / "dst").exists()


def test_the_mirror_answers_healthz_and_readyz(published, cli_env, tmp_path):
    store, _ = published
    chunks, hidden = store / "chunks", tmp_path / "chunks-aside"
    shutil.move(chunks, hidden)  # every pass fails (a missing source chunk) until they are back
    env = _env(
        cli_env,
        WEIGHTSYNC_FROM=f"file://{store}",
        WEIGHTSYNC_TO=f"file://{tmp_path / 'regional'}",
        WEIGHTSYNC_FOLLOW="yes",
        WEIGHTSYNC_INTERVAL="0.1",
        WEIGHTSYNC_METRICS_LISTEN="127.0.0.1:0",
        WEIGHTSYNC_REGION="region-b",
        WEIGHTSYNC_LOG_JSON="on",
        WEIGHTSYNC_LOG_LEVEL="info",
    )
    mirror = _Process("mirror", env, tmp_path / "mirror.log")
    try:
        url = mirror.url()
        assert _get(url + "/healthz") == (200, {"status": "ok"})
        code, body = mirror.wait(lambda: (r := _get(url + "/readyz"))[1]["state"] == "error" and r, "a failed pass")
        assert code == 503 and body["ready"] is False and "NotFoundError" in body["last_error"]
        shutil.move(hidden, chunks)
        code, body = mirror.wait(lambda: (r := _get(url + "/readyz"))[0] == 200 and r, "a pass to succeed")
        assert body == {"ready": True, "state": "idle"}
        with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
            assert resp.headers["Content-Type"].startswith("text/plain")
            assert re.search(
                r'^weightsync_mirror_destination_version\{[^}]*region="region-b"[^}]*\} 5\.0$',
                resp.read().decode(),
                re.MULTILINE,
            )
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(url + "/nowhere", timeout=10)
        assert err.value.code == 404
        assert _get(url + "/healthz")[0] == 200
    finally:
        code = mirror.stop()
    assert code == 0
    records = [json.loads(line) for line in mirror.log.read_text().splitlines() if line.strip()]
    msgs = [r["msg"] for r in records]
    assert any(m.startswith("mirror pass failed") for m in msgs) and any(
        m.startswith("mirrored version 5") for m in msgs
    )
    assert {r["logger"] for r in records} == {"weightsync.mirror"}
