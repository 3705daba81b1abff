"""Security properties of the daemons and the package.

- The ``/v1`` API refuses a missing or wrong bearer token (401) on every route and method, and
  compares tokens in constant time (``hmac.compare_digest``, no ``==`` on the token).
- Neither the API token nor the S3 secret key appears in the daemons' logs (also when S3 rejects the
  credentials), in any HTTP answer (``/v1/*``, ``/metrics``, ``/openapi.json``, probes), or in the
  fleet records written to the store.
- HTTP listens on 127.0.0.1 unless told otherwise (``--listen PORT`` binds loopback only).
- S3 credentials reach boto3 only through its standard chain: the package names no AWS
  credential variable and passes no credential argument; the environment is read only by
  ``service/flags.py`` and ``cli.py``, and not for AWS variables.
- The container image runs as an unprivileged user.
"""

from __future__ import annotations

import ast
import asyncio
import hmac
import inspect
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request
from test_daemons import Daemon, http, wait_for

import weightsync
import weightsync.service.api
from weightsync.demo import make_trajectory
from weightsync.service.config import ApiConfig
from weightsync.service.flags import parse_listen

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "weightsync"
TOKEN = "tok-3f9a1c0e5b7d2a64"
TINY = dict(hidden=32, layers=1, experts=2, vocab=128)
BAD_AUTH = [
    None,
    "",
    "Bearer",
    "Bearer wrong",
    TOKEN,
    f"Bearer {TOKEN}x",
    f"Bearer {TOKEN[:-1]}",
    f"Bearer  {TOKEN}",
    f"Basic {TOKEN}",
    f"Bearer {TOKEN.upper()}",
    f"Bearer {TOKEN}\u00e9",
]


def _routes(role: str) -> list[tuple[str, str, object]]:
    common = [("GET", "/v1/status", None), ("GET", "/v1/versions", None)]
    if role == "subscriber":
        return [*common, ("PUT", "/v1/target", {"version": 0})]
    return [*common, ("GET", "/v1/fleet", None), ("POST", "/v1/publish", {"path": "/nonexistent"})]


def _request(d: Daemon, method: str, path: str, body, auth: str | None):
    import json
    import urllib.error
    import urllib.request

    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(d.url + path, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    if auth is not None:
        req.add_header("Authorization", auth)
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@pytest.mark.integration
def test_tokens_are_enforced_and_no_secret_leaks_into_logs_answers_or_the_store(s3_url, seaweed, tmp_path):
    repo = weightsync.open_repo(s3_url)
    traj = make_trajectory(tmp_path / "watch", steps=1, **TINY)
    for ckpt in traj:
        weightsync.publish(ckpt, repo)
    env = {**seaweed.env(), "WEIGHTSYNC_API_TOKEN": TOKEN}
    secrets = [TOKEN, seaweed.secret_key]
    sub = Daemon(
        "subscriber",
        [
            "--store",
            s3_url,
            "--target",
            tmp_path / "sub",
            "--no-fsync",
            "--ledger-interval",
            "0.2",
            "--log-level",
            "DEBUG",
        ],
        tmp_path,
        env=env,
        token=TOKEN,
    ).start()
    pub = Daemon(
        "publisher",
        ["--store", s3_url, "--watch", tmp_path / "watch", "--state-dir", tmp_path / "st", "--log-level", "DEBUG"],
        tmp_path,
        env=env,
        token=TOKEN,
    ).start()
    wrong_secret = seaweed.secret_key + "-but-wrong"
    secrets.append(wrong_secret)
    bad = Daemon(
        "subscriber",
        ["--store", s3_url, "--target", tmp_path / "bad", "--no-fsync", "--log-level", "DEBUG"],
        tmp_path,
        env={**env, "AWS_SECRET_ACCESS_KEY": wrong_secret},
        token=TOKEN,
    ).start()
    try:
        sub.wait_version(1)
        wait_for(
            lambda: (s := bad.status())["last_error"] and "SignatureDoesNotMatch" in s["last_error"],
            20,
            "the daemon with a wrong secret key to fail",
        )
        answers = []
        for d in (sub, pub, bad):
            for method, path, body in _routes(d.role):
                for auth in BAD_AUTH:
                    code, text = _request(d, method, path, body, auth)
                    assert code == 401, (d.role, method, path, auth, code, text)
                    answers.append(text)
                code, text = _request(d, method, path, body, f"Bearer {TOKEN}")
                assert code != 401, (d.role, method, path, code, text)
                answers.append(text)
            for path in ("/healthz", "/readyz", "/metrics", "/openapi.json"):
                code, text = _request(d, "GET", path, None, None)
                assert code in (200, 503), (path, code)
                answers.append(text)
        assert sub.status()["target"] == 0  # the authorized PUT above pinned it; the refused ones did not
        wait_for(lambda: sub.status()["current_version"] == 0, 20, "the pin")
        fleet = [repo.store.get(k).decode() for k in repo.store.list("fleet/")]
        assert fleet
    finally:
        codes = [d.stop() for d in (sub, pub, bad)]
    assert codes == [0, 0, 0]
    logs = [d.log() for d in (sub, pub, bad)]
    assert "SignatureDoesNotMatch" in logs[2]
    for secret in secrets:
        for where, texts in (("an HTTP answer", answers), ("a daemon log", logs), ("a fleet record", fleet)):
            assert not any(secret in t for t in texts), f"{secret[:4]}... appears in {where}"


def test_the_token_is_compared_in_constant_time(monkeypatch):
    """Timing cannot be measured steadily here, so the test watches the comparison: every ``/v1``
    request's header goes through ``hmac.compare_digest`` with the expected value, and its answer
    alone decides (a comparison that says "equal" for a wrong token lets it in, one that says
    "different" for the right token keeps it out), which fails if the code compares with ``==``."""
    api = weightsync.service.api
    calls: list[tuple[bytes, bytes]] = []
    verdict: list[bool | None] = [None]  # None: the real comparison
    real = hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b) if verdict[0] is None else verdict[0]

    monkeypatch.setattr(api.hmac, "compare_digest", spy)
    middleware = api._auth("s3cret-token")

    async def handler(request):
        return web.Response(text="ok")

    def status(path: str, header: str | None) -> int:
        headers = {} if header is None else {"Authorization": header}
        request = make_mocked_request("GET", path, headers=headers)
        return asyncio.run(middleware(request, handler)).status

    expected = b"Bearer s3cret-token"
    for header, want in (("Bearer s3cret-token", 200), ("Bearer s3cret-tokeN", 401), (None, 401)):
        calls.clear()
        assert status("/v1/status", header) == want, header
        assert calls == [((header or "").encode(), expected)], header
    calls.clear()
    assert status("/healthz", None) == 200 and calls == []  # probes need no token
    verdict[0] = True
    assert status("/v1/status", "Bearer wrong") == 200  # the comparison's answer is the decision
    verdict[0] = False
    assert status("/v1/status", "Bearer s3cret-token") == 401
    assert len(calls) == 2

    src = textwrap.dedent(inspect.getsource(api._auth))
    tree = ast.parse(src)
    names = {"token", "expected", "given"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Eq, ast.NotEq)) for op in node.ops):
            used = {n.id for side in (node.left, *node.comparators) for n in ast.walk(side) if isinstance(n, ast.Name)}
            assert not used & names, f"token compared with == in _auth: {ast.unparse(node)}"


def test_http_listens_on_loopback_by_default(tmp_path):
    assert ApiConfig().host == "127.0.0.1"
    assert parse_listen("8471") == ("127.0.0.1", 8471)
    store = tmp_path / "store"
    weightsync.publish(make_trajectory(tmp_path / "traj", steps=0, **TINY)[0], store)
    log = open(tmp_path / "sub.log", "wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "weightsync.cli",
            "subscriber",
            "--store",
            str(store),
            "--target",
            str(tmp_path / "sub"),
            "--no-fsync",
            "--listen",
            "0",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    log.close()
    try:  # "--listen 0": a port only, so the default host; the daemon logs where it listens
        bound = wait_for(
            lambda: (
                proc.poll() is None
                and re.search(r"listening url=http://([0-9.]+):(\d+)", (tmp_path / "sub.log").read_text())
            ),
            20,
            "the subscriber",
        )
        assert bound.group(1) == "127.0.0.1"
        port = int(bound.group(2))
        assert http("GET", f"http://127.0.0.1:{port}/healthz", timeout=5)[0] == 200
        with socket.socket() as s:  # another loopback address: nothing listens there
            s.settimeout(2)
            assert s.connect_ex(("127.0.0.2", port)) != 0
        listening = [
            line.split()[1] for line in Path("/proc/net/tcp").read_text().splitlines()[1:] if line.split()[3] == "0A"
        ]
        assert f"0100007F:{port:04X}" in listening and f"00000000:{port:04X}" not in listening
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0


EMPTY_TOKENS = {  # a token configured but empty (a missing secret): flags and environment
    "empty file": (["--api-token-file", "{empty}"], {}),
    "blank file": (["--api-token-file", "{blank}"], {}),
    "empty file path": (["--api-token-file", ""], {}),
    "empty flag": (["--api-token", ""], {}),
    "blank flag": (["--api-token", "  "], {}),
    "empty env": ([], {"WEIGHTSYNC_API_TOKEN": ""}),
    "blank env": ([], {"WEIGHTSYNC_API_TOKEN": " \n"}),
}


@pytest.fixture(scope="module")
def one_version(tmp_path_factory) -> Path:
    store = tmp_path_factory.mktemp("empty-token") / "store"
    weightsync.publish(make_trajectory(store.parent / "traj", steps=0, **TINY)[0], store)
    return store


@pytest.mark.parametrize("role", ["publisher", "subscriber"])
@pytest.mark.parametrize("form", list(EMPTY_TOKENS))
def test_an_empty_configured_token_refuses_to_start(role, form, one_version, tmp_path):
    """Auth never fails open: an empty or blank token from any source stops the daemon at once."""
    (tmp_path / "empty").write_text("")
    (tmp_path / "blank").write_text(" \n\t\n")
    flags, env = EMPTY_TOKENS[form]
    flags = [f.format(empty=tmp_path / "empty", blank=tmp_path / "blank") for f in flags]
    where = (
        ["--watch", tmp_path / "watch", "--state-dir", tmp_path / "state"]
        if role == "publisher"
        else ["--target", tmp_path / "sub", "--no-fsync"]
    )
    (tmp_path / "watch").mkdir()
    env = {**{k: v for k, v in os.environ.items() if k != "WEIGHTSYNC_API_TOKEN"}, **env}
    log_path = tmp_path / "daemon.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "weightsync.cli",
                role,
                "--store",
                str(one_version),
                *map(str, where),
                "--listen",
                "0.0.0.0:0",
                "--poll-interval",
                "0.1",
                *flags,
            ],
            stdout=subprocess.DEVNULL,
            stderr=log,
            env=env,
        )
    try:
        wait_for(lambda: proc.poll() is not None or "listening" in log_path.read_text(), 30, f"the {role} to exit")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out = log_path.read_text()
    assert proc.returncode == 2, f"the {role} started with an empty token ({form}), exit {proc.returncode}:\n{out}"
    lines = out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("weightsync: error:"), out
    assert "empty API token" in lines[0] or "cannot read --api-token-file" in lines[0], out
    assert "Traceback" not in out and "listening" not in out, out


# --- static checks of the package ------------------------------------------------------------------------------
CREDENTIAL_NAMES = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "AWS_PROFILE",
)
CREDENTIAL_KWARGS = {"aws_access_key_id", "aws_secret_access_key", "aws_session_token", "profile_name"}
ENV_READERS = {"weightsync/service/flags.py", "weightsync/cli.py"}


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path, ast.parse(path.read_text(), str(path))


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
    return ids


def _env_reads(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, variable) of ``os.environ[...]``, ``os.environ.get(...)``, ``os.getenv(...)``,
    ``environ.get(...)`` with a constant name."""
    out = []
    for node in ast.walk(tree):
        name = None
        if isinstance(node, ast.Subscript) and ast.unparse(node.value).endswith("environ"):
            name = node.slice
        elif isinstance(node, ast.Call) and ast.unparse(node.func).endswith(
            ("environ.get", "getenv", "environ.setdefault")
        ):
            name = node.args[0] if node.args else None
        if name is not None:
            out.append((node.lineno, name.value if isinstance(name, ast.Constant) else ast.unparse(name)))
    return out


def test_credentials_come_only_from_the_standard_aws_chain():
    problems = []
    for path, tree in _modules():
        rel = path.relative_to(ROOT).as_posix()
        docs = _docstrings(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
                if any(n in node.value for n in CREDENTIAL_NAMES):
                    problems.append(f"{rel}:{node.lineno}: names a credential variable: {node.value[:60]!r}")
            if isinstance(node, ast.keyword) and node.arg in CREDENTIAL_KWARGS:
                problems.append(f"{rel}:{node.value.lineno}: passes {node.arg}= to boto3")
        for line, var in _env_reads(tree):
            if rel not in ENV_READERS:
                problems.append(
                    f"{rel}:{line}: reads the environment ({var}) outside {' and '.join(sorted(ENV_READERS))}"
                )
            elif str(var).startswith("AWS_"):
                problems.append(f"{rel}:{line}: reads {var} itself instead of leaving it to boto3")
    assert not problems, "\n".join(problems)


def test_the_container_runs_as_an_unprivileged_user():
    lines = [ln.strip() for ln in (ROOT / "Dockerfile").read_text().splitlines()]
    last_stage = max(i for i, ln in enumerate(lines) if ln.upper().startswith("FROM "))
    users = [ln.split(None, 1)[1] for ln in lines[last_stage:] if ln.upper().startswith("USER ")]
    assert users, "the runtime stage sets no USER: the container runs as root"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0"), users[-1]
    later = " ".join(lines[lines.index(next(ln for ln in lines[last_stage:] if ln.upper().startswith("USER "))) :])
    assert "USER root" not in later and "USER 0" not in later
