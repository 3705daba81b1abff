"""The daemons' HTTP API against its OpenAPI document.

The documents validate as OpenAPI 3.1; schemathesis generates positive and negative requests for
every operation of a live subscriber and a live publisher (real processes, bearer token set) and
checks status codes, content types, response schemas and that auth is enforced; a few explicit
calls pin down behaviour the fuzzing does not reach (publish results, conflicts, fleet rows).
"""

from __future__ import annotations

import shutil
import subprocess

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from openapi_spec_validator import validate
from schemathesis import GenerationMode
from schemathesis.config import SchemathesisConfig
from test_daemons import Daemon, http, wait_for

import weightsync
from weightsync.demo import make_trajectory
from weightsync.service.openapi import openapi_document

TOKEN = "api-test-token"
TINY = dict(hidden=32, layers=1, experts=2, vocab=128)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A store with versions 0..2, a live subscriber and a live publisher, both with a token."""
    tmp = tmp_path_factory.mktemp("api")
    traj = make_trajectory(tmp / "watch", steps=2, **TINY)
    for ckpt in traj:
        weightsync.publish(ckpt, tmp / "store")
    env = {"WEIGHTSYNC_API_TOKEN": TOKEN}
    sub = Daemon(
        "subscriber",
        [
            "--store",
            tmp / "store",
            "--target",
            tmp / "sub",
            "--no-fsync",
            "--id",
            "api-sub",
            "--ledger-interval",
            "0.2",
            "--engine-timeout",
            "1",  # the ranks the fuzzing registers never poll: dropped at once, no slot held for long
        ],
        tmp,
        env=env,
        token=TOKEN,
    ).start()
    pub = Daemon(
        "publisher",
        ["--store", tmp / "store", "--watch", tmp / "watch", "--state-dir", tmp / "st"],
        tmp,
        env=env,
        token=TOKEN,
    )
    try:
        pub.start()
        sub.wait_version(2)
        yield tmp, sub, pub
    finally:  # both stopped (or killed) before either is judged: a daemon left running outlived the suite
        failures = []
        for d in (sub, pub):
            try:
                if d.stop() != 0 or TOKEN in d.log():
                    failures.append(d.log())
            except AssertionError as exc:  # it ignored SIGTERM: killed
                failures.append(str(exc))
        assert not failures, "\n".join(failures)


@pytest.mark.parametrize("role", ["subscriber", "publisher"])
@pytest.mark.parametrize("auth", [False, True])
def test_openapi_documents_are_valid(role, auth):
    doc = openapi_document(role, auth)
    validate(doc)
    ops = {(m.upper(), p) for p, item in doc["paths"].items() for m in item}
    common = {
        ("GET", "/healthz"),
        ("GET", "/readyz"),
        ("GET", "/metrics"),
        ("GET", "/v1/status"),
        ("GET", "/v1/versions"),
    }
    engines = {("POST", f"/v1/engines{p}") for p in ("", "/poll", "/report", "/leave")}
    subscriber = {("PUT", "/v1/target"), ("POST", "/v1/hook"), ("GET", "/v1/manifest/{version}"), ("GET", "/v1/head")}
    subscriber |= engines
    extra = subscriber if role == "subscriber" else {("POST", "/v1/publish"), ("GET", "/v1/fleet")}
    assert ops == common | extra
    for p, item in doc["paths"].items():
        for op in item.values():
            assert ("401" in op["responses"]) == p.startswith("/v1/")
            assert bool(op.get("security")) == (auth and p.startswith("/v1/"))


def _fuzz(daemon: Daemon, max_examples: int) -> list[str]:
    """Run schemathesis over every operation of ``daemon`` in both generation modes; returns labels."""
    # the token goes through schemathesis' own auth config, so that its negative cases may drop it
    config = SchemathesisConfig.from_dict({"auth": {"openapi": {"bearer": {"bearer": TOKEN}}}})
    schema = schemathesis.openapi.from_url(daemon.url + "/openapi.json", config=config)
    labels = []
    for result in schema.get_all_operations():
        op = result.ok()
        labels.append(op.label)
        statuses: dict[GenerationMode, set[int]] = {m: set() for m in GenerationMode}
        for mode in GenerationMode:

            @given(case=op.as_strategy(generation_mode=mode))
            @settings(
                max_examples=max_examples,
                deadline=None,
                database=None,
                derandomize=True,
                suppress_health_check=list(HealthCheck),
            )
            def run(case):
                statuses[mode].add(case.call_and_validate(base_url=daemon.url).status_code)

            try:
                run()
            except Unsatisfiable:
                assert mode is GenerationMode.NEGATIVE, op.label  # nothing to get wrong in a request without inputs
        positive = statuses[GenerationMode.POSITIVE]
        assert positive and 401 not in positive, (op.label, statuses)  # the token was applied
        if op.path == "/v1/manifest/{version}":  # any version number is valid; few are published
            assert positive <= {200, 404}, (op.label, statuses)
        else:
            assert op.method.upper() != "GET" or positive == {200} or op.path == "/readyz", (op.label, statuses)
        if op.path.startswith("/v1/") and statuses[GenerationMode.NEGATIVE]:
            assert statuses[GenerationMode.NEGATIVE] & {400, 401}, (op.label, statuses)
    return labels


def test_schemathesis_subscriber(world):
    _, sub, _ = world
    labels = _fuzz(sub, 40)
    assert "PUT /v1/target" in labels and "POST /v1/hook" in labels and len(labels) == 13
    assert sub.get("/readyz")[0] == 200


def test_schemathesis_publisher(world):
    _, _, pub = world
    labels = _fuzz(pub, 25)
    assert "POST /v1/publish" in labels and "GET /v1/fleet" in labels and len(labels) == 7


def test_explicit_calls(world):
    tmp, sub, pub = world
    # subscriber: pin, bad bodies, unknown version, back to latest
    assert sub.put_target(1)["target"] == 1
    sub.wait_version(1)
    for body, code in (
        ({"version": -1}, 400),
        ({"version": "1"}, 400),
        ({"version": 1, "x": 2}, 400),
        ({}, 400),
        (b"not json", 400),
        ({"version": 99}, 404),
        ({"version": True}, 400),
    ):
        got, doc, _ = http("PUT", sub.url + "/v1/target", body, token=TOKEN)
        assert got == code and "error" in doc, (body, got, doc)
    assert sub.put_target("latest")["target"] == "latest"
    sub.wait_version(2)
    code, doc, _ = sub.get("/v1/versions?limit=2")
    assert code == 200 and doc["head_version"] == 2 and [v["version"] for v in doc["versions"]] == [1, 2]
    assert sub.get("/v1/versions?limit=0")[0] == 400
    for path in ("/v1/manifest/%C2%B2", "/v1/manifest/%D9%A3", "/v1/head?after=%C2%B2", "/v1/versions?limit=1_0"):
        assert sub.get(path)[0] == 400, path  # digits int() refuses (a 500 before) or reads as others
    assert http("DELETE", sub.url + "/v1/target", token=TOKEN)[0] == 405

    # publisher: explicit publish, a conflict, not a checkpoint, the fleet
    ckpt = tmp / "watch" / "step_000002"
    copy = tmp / "watch" / "again-5"
    shutil.copytree(ckpt, copy)
    code, doc, _ = http("POST", pub.url + "/v1/publish", {"path": str(copy)}, token=TOKEN)
    assert code == 200 and doc["version"] == 5 and doc["payload_bytes"] == 0, doc  # identical bytes: all "same"
    code, doc, _ = http("POST", pub.url + "/v1/publish", {"path": str(copy), "version": 4}, token=TOKEN)
    assert code == 409, doc
    (tmp / "watch" / "empty").mkdir()
    code, doc, _ = http("POST", pub.url + "/v1/publish", {"path": str(tmp / "watch" / "empty")}, token=TOKEN)
    assert code == 422 and "empty" in doc["error"], doc
    fleet = wait_for(
        lambda: (
            (f := pub.get("/v1/fleet")[1]) and f["subscribers"] and f["subscribers"][0]["current_version"] == 5 and f
        ),
        15,
        "the subscriber to reach version 5 in the ledger",
    )
    assert fleet["head_version"] == 5 and fleet["subscribers"][0]["id"] == "api-sub" and fleet["errors"] == []
    assert pub.status()["head_version"] == 5


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Prometheus) not installed")
def test_metrics_pass_promtool(world):
    _, sub, pub = world
    for d in (sub, pub):
        code, text, headers = d.get("/metrics", token=None)
        assert code == 200 and headers["Content-Type"].startswith("text/plain")
        check = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr


MALFORMED = {  # body -> the status it must get; the path and version are valid where the test is not about them
    "deep array": (b"[" * 200_000 + b"]" * 200_000, 400),
    "deep object": (b'{"a":' * 100_000 + b"1" + b"}" * 100_000, 400),
    "deep value": (
        b'{"path": ' + b"[" * 100_000 + b"]" * 100_000 + b', "version": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        400,
    ),
    "array": (b"[]", 400),
    "string": (b'"x"', 400),
    "number": (b"1", 400),
    "null": (b"null", 400),
    "empty": (b"", 400),
    "not utf-8": (b'{"path": "\xff"}', 400),
    "huge number": (b'{"version": ' + b"9" * 100_000 + b"}", 400),
    "nan": (b'{"path": "/x", "version": NaN}', 400),
    "bool version": (b'{"path": "/x", "version": true}', 400),
    "float version": (b'{"path": "/x", "version": 1.5}', 400),
    "wrong path": (b'{"path": ["/x"], "version": 1}', 400),
    "too large": (b'{"path": "' + b"a" * (2 << 20) + b'"}', 413),
    "long path": (b'{"path": "' + b"/a" * 300_000 + b'"}', 400),
}


@pytest.mark.parametrize("route", ["PUT /v1/target", "POST /v1/publish"])
def test_malformed_bodies_get_a_4xx_with_a_one_line_error(route, world):
    """Deep nesting, non-objects, wrong types, huge bodies: a one-line JSON error, never a 500."""
    _, sub, pub = world
    method, path = route.split()
    d = sub if path == "/v1/target" else pub
    seen = len(d.log())
    for name, (body, want) in MALFORMED.items():
        code, doc, _ = http(method, d.url + path, body, token=TOKEN, timeout=30)
        assert code == want and isinstance(doc, dict) and "\n" not in doc["error"], (route, name, code, str(doc)[:300])
    assert "Traceback" not in d.log()[seen:], d.log()[seen:]


def test_publish_takes_only_a_strict_subfolder_of_a_root(world):
    """The watched folder itself (however spelled), a folder holding it, or a symlink out of it: 403."""
    tmp, _, pub = world
    watch = tmp / "watch"
    outside = tmp / "outside"
    shutil.copytree(watch / "step_000001", outside, dirs_exist_ok=True)
    links = {watch / "loop": watch, watch / "escape": outside, watch / "up": tmp}
    for link, to in links.items():
        link.symlink_to(to, target_is_directory=True)
    head = pub.status()["head_version"]
    try:
        for path in (
            watch,
            f"{watch}/",
            f"{watch}//",
            f"{watch}/.",
            f"{watch}/step_000001/..",
            f"{watch}/./step_000001/../.",
            f"{watch}/../{watch.name}",
            watch / "loop",
            f"{watch}/loop/",
            watch / "escape",
            watch / "up",
            f"{watch}/up/{watch.name}",
            tmp,
            "/",
            outside,
        ):
            code, doc, _ = http("POST", pub.url + "/v1/publish", {"path": str(path)}, token=TOKEN)
            assert code == 403 and "\n" not in doc["error"], (path, code, doc)
        assert pub.status()["head_version"] == head and weightsync.open_repo(tmp / "store").head_version() == head
    finally:
        for link in links:
            link.unlink()
        shutil.rmtree(outside)
