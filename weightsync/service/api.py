"""The daemons' HTTP API (aiohttp): health, readiness, metrics, status, versions; the subscriber's
``PUT /v1/target``, its engine ranks' ``/v1/engines`` calls and ``GET /v1/manifest/{version}``
(``weightsync.service.engines``); the publisher's ``POST /v1/publish`` and ``GET /v1/fleet``. With a
token every ``/v1`` request needs ``Authorization: Bearer <token>`` (constant-time compare; never
logged). Handlers never block: store and file work runs in threads."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from contextlib import suppress
from dataclasses import asdict, dataclass

from aiohttp import web

from weightsync.errors import CheckpointError, SignatureError, UsageError, VersionError, WeightsyncError
from weightsync.format.keys import ID_RE, MAX_VERSION
from weightsync.format.manifest import manifest_to_json
from weightsync.service.engines import MAX_WAIT, MAX_WORLD, PHASES, EngineConflictError, UnknownEngineError
from weightsync.service.metrics import CONTENT_TYPE, Metrics
from weightsync.service.openapi import MAX_API_WAIT, openapi_document
from weightsync.service.pin import LATEST
from weightsync.service.publisher import PathNotAllowed, PathNotFound, Publisher
from weightsync.service.runtime import background
from weightsync.service.subscriber import Subscriber
from weightsync.store.repo import Repo
from weightsync.sync.fleet import read_fleet


@dataclass(frozen=True)
class Deps:
    daemon: Publisher | Subscriber
    metrics: Metrics
    token: str | None = None
    grace: float = 30.0
    run_loop: bool = True  # False: serve the API only (tests of the API itself)


PUBLISHER = web.AppKey("publisher", Publisher)
SUBSCRIBER = web.AppKey("subscriber", Subscriber)
METRICS = web.AppKey("metrics", Metrics)
OPENAPI = web.AppKey("openapi", dict)
log = logging.getLogger("weightsync.api")
MAX_BODY = 1 << 20  # bytes of a request body; larger ones get 413


def create_app(deps: Deps) -> web.Application:
    """The application of one daemon; its loop runs for the application's lifetime (cleanup_ctx)."""
    app = web.Application(middlewares=[_json_errors, _auth(deps.token), _known_query], client_max_size=MAX_BODY)
    app[METRICS] = deps.metrics
    d = deps.daemon
    routes = [
        web.get("/healthz", healthz),
        web.get("/readyz", readyz),
        web.get("/metrics", metrics),
        web.get("/openapi.json", openapi),
        web.get("/v1/status", status),
        web.get("/v1/versions", versions),
    ]
    if isinstance(d, Subscriber):
        app[SUBSCRIBER] = d
        routes += [
            web.put("/v1/target", put_target),
            web.post("/v1/hook", post_hook),
            web.post("/v1/engines", post_engine),
            web.post("/v1/engines/poll", post_engine_poll),
            web.post("/v1/engines/report", post_engine_report),
            web.post("/v1/engines/leave", post_engine_leave),
            web.get("/v1/manifest/{version}", get_manifest),
            web.get("/v1/head", get_head),
        ]
        app.on_shutdown.append(_close_engines)  # held polls answer before the server waits for its requests
    else:
        app[PUBLISHER] = d
        routes += [web.post("/v1/publish", post_publish), web.get("/v1/fleet", fleet)]
    app.add_routes(routes)
    app[OPENAPI] = openapi_document("subscriber" if isinstance(d, Subscriber) else "publisher", deps.token is not None)
    if deps.run_loop:
        app.cleanup_ctx.append(background(type(d).__name__.lower(), d.run, d.request_stop, deps.grace))
    return app


def _daemon(request: web.Request) -> Publisher | Subscriber:
    app = request.app
    return app[SUBSCRIBER] if SUBSCRIBER in app else app[PUBLISHER]


# --- middlewares ---------------------------------------------------------------------------------
def _error(status: int, message: str, headers: dict | None = None) -> web.Response:
    return web.json_response({"error": message}, status=status, headers=headers)


@web.middleware
async def _json_errors(request: web.Request, handler):
    """Every error answers JSON; weightsync errors map to 4xx/5xx by kind."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        headers = {k: v for k, v in exc.headers.items() if k.lower() in ("allow", "www-authenticate")}
        message = exc.text if exc.status == 413 and exc.text else exc.reason  # 413: says the limit
        return _error(exc.status, message, headers)
    except PathNotAllowed as exc:
        return _error(403, str(exc))
    except (PathNotFound, UnknownEngineError) as exc:
        return _error(404, str(exc))
    except EngineConflictError as exc:
        return _error(409, str(exc))
    except UsageError as exc:
        return _error(400, str(exc))
    except VersionError as exc:
        return _error(409, str(exc))
    except CheckpointError as exc:
        return _error(422, str(exc))
    except WeightsyncError as exc:
        return _error(502, f"{type(exc).__name__}: {exc}")
    except Exception as exc:  # a bug: still one line of JSON to the client, the traceback to the log
        log.exception("unexpected error answering %s %s", request.method, request.path)
        return _error(500, f"internal error ({type(exc).__name__})")


@web.middleware
async def _known_query(request: web.Request, handler):
    """Query parameters that the OpenAPI document does not declare for an operation are rejected."""
    if request.query:
        op = request.app[OPENAPI]["paths"].get(request.path, {}).get(request.method.lower(), {})
        known = {p["name"] for p in op.get("parameters", ()) if p["in"] == "query"}
        if unknown := sorted(set(request.query) - known):
            raise UsageError(f"unknown query parameters: {unknown}")
    return await handler(request)


def _auth(token: str | None):
    if token is not None and (not token or any(c.isspace() for c in token)):  # never an open door
        raise UsageError("the API token must be non-empty and hold no whitespace")
    expected = None if token is None else f"Bearer {token}".encode()

    @web.middleware
    async def auth(request: web.Request, handler):
        if expected is not None and (request.path == "/v1" or request.path.startswith("/v1/")):
            given = request.headers.get("Authorization", "").encode("utf-8", "replace")
            if not hmac.compare_digest(given, expected):
                return _error(401, "missing or wrong bearer token", {"WWW-Authenticate": 'Bearer realm="weightsync"'})
        return await handler(request)

    return auth


# --- handlers ------------------------------------------------------------------------------------
async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    d = _daemon(request)
    body = {"ready": d.ready, "state": d.state}
    return web.json_response(body, status=200 if d.ready else 503)


async def metrics(request: web.Request) -> web.Response:
    body = request.app[METRICS].render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


async def openapi(request: web.Request) -> web.Response:
    return web.json_response(request.app[OPENAPI])


async def status(request: web.Request) -> web.Response:
    return web.json_response(_daemon(request).status())


def _integral(v: object) -> int | None:
    """``v`` as an int if it is one in JSON Schema's sense (``3`` and ``3.0``; not ``True``)."""
    if type(v) is int:
        return v
    if type(v) is float and v.is_integer():
        return int(v)
    return None


def _digits(raw: str) -> bool:
    """``raw`` is ASCII digits only (``str.isdigit`` takes ``²``, which ``int`` refuses, and ``٣``)."""
    return raw.isascii() and raw.isdigit()


def _limit(request: web.Request) -> int:
    raw = request.query.get("limit", "100")
    try:
        if not raw.isascii() or "_" in raw:  # (int() and float() take other digits, and 1_0)
            raise ValueError(raw)
        n = _integral(int(raw) if raw.strip().lstrip("+-").isdigit() else float(raw))
    except (ValueError, OverflowError):
        n = None
    if n is None or not 1 <= n <= 1000:
        raise UsageError("limit must be an integer in 1..1000")
    return n


def list_versions(repo: Repo, limit: int) -> list[dict]:
    """The newest ``limit`` committed versions, oldest first (reads their manifests); with trusted
    keys, only those one of them signed (a refused version is in the subscriber's status)."""
    out = []
    for v in repo.versions()[-limit:]:
        try:
            m = repo.manifest(v)
        except SignatureError:
            continue
        elements = m.stats.get("elements", 0) or 0
        out.append(
            {
                "version": v,
                "parent": m.parent,
                "keyframe": m.keyframe,
                "raw_bytes": m.raw_bytes,
                "payload_bytes": m.payload_bytes,
                "ratio": round(m.raw_bytes / m.payload_bytes, 3) if m.payload_bytes else None,  # size / stored
                "changed_fraction": (m.stats.get("changed", 0) or 0) / max(1, elements),
                "created": m.created,
            }
        )
    return out


async def versions(request: web.Request) -> web.Response:
    limit = _limit(request)
    repo = _daemon(request).repo
    head = await asyncio.to_thread(repo.head_version)
    items = await asyncio.to_thread(list_versions, repo, limit) if head is not None else []
    return web.json_response({"head_version": head, "versions": items})


async def _json_body(request: web.Request, allowed: set[str], required: set[str]) -> dict:
    try:
        doc = json.loads(await request.read())
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:  # RecursionError: nested too deeply
        why = "nested too deeply" if isinstance(exc, RecursionError) else "not valid JSON"
        raise UsageError(f"the body must be a JSON object ({why})") from None
    if not isinstance(doc, dict):
        raise UsageError("the body must be a JSON object")
    if extra := set(doc) - allowed:
        raise UsageError(f"unknown fields: {sorted(extra)}")
    if missing := required - set(doc):
        raise UsageError(f"missing fields: {sorted(missing)}")
    return doc


def _version_value(v: object, allow_latest: bool) -> int | str:
    if allow_latest and v == LATEST:
        return v
    v = _integral(v)
    if v is None or not 0 <= v <= MAX_VERSION:
        raise UsageError(f"version must be an integer in 0..{MAX_VERSION}" + (" or 'latest'" if allow_latest else ""))
    return v


def _wait(request: web.Request) -> float | None:
    """The ``wait`` query parameter: seconds in 0..MAX_API_WAIT, or None when absent."""
    raw = request.query.get("wait")
    if raw is None:
        return None
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds <= MAX_API_WAIT:  # NaN fails both
        raise UsageError(f"wait must be a number of seconds in 0..{MAX_API_WAIT}")
    return seconds


async def put_target(request: web.Request) -> web.Response:
    doc = await _json_body(request, {"version"}, {"version"})
    target = _version_value(doc["version"], allow_latest=True)
    wait = _wait(request)
    sub = request.app[SUBSCRIBER]
    try:
        await sub.set_target(target)
    except VersionError as exc:
        return _error(404, str(exc))
    if wait is None:
        return web.json_response(sub.status())
    head, after = None, sub.head_reads
    if target == LATEST:  # the head as the call reads it (the loop's may be older); a failed read: the loop's
        with suppress(WeightsyncError):
            head = await asyncio.to_thread(sub.heads.read)
    done = lambda: sub.target_outcome(target, head, after) is not None or sub.target_replaced(target)  # noqa: E731
    await sub.wait_until(done, wait)
    outcome = sub.target_outcome(target, head, after)
    replaced = sub.target_replaced(target)
    if outcome is None and replaced:
        return _error(409, replaced)
    if outcome is None and sub.closing:
        return _error(503, "the subscriber is stopping")
    return _outcome(sub, outcome)


def _outcome(sub: Subscriber, outcome: str | None) -> web.Response:
    """200 and the status once done, 202 and the status while still under way, 502 if it failed."""
    if outcome is None:
        return web.json_response(sub.status(), status=202)
    return web.json_response(sub.status()) if outcome == "ok" else _error(502, outcome)


async def post_hook(request: web.Request) -> web.Response:
    wait = _wait(request)
    sub = request.app[SUBSCRIBER]
    try:
        version = sub.rerun_hook()
    except (UsageError, VersionError) as exc:
        return _error(409, str(exc))
    if wait is None:
        return web.json_response(sub.status(), status=202)
    await sub.wait_until(lambda: sub.hook_settled(version), wait)
    if sub.hook_outcome(version) is None and sub.closing:
        return _error(503, "the subscriber is stopping")
    return _outcome(sub, sub.hook_outcome(version))


async def post_publish(request: web.Request) -> web.Response:
    doc = await _json_body(request, {"path", "version"}, {"path"})
    if not isinstance(doc["path"], str) or not doc["path"]:
        raise UsageError("path must be a non-empty string")
    version = None if doc.get("version") is None else _version_value(doc["version"], allow_latest=False)
    pub = request.app[PUBLISHER]
    r = await pub.publish_request(doc["path"], version)
    return web.json_response({**asdict(r), "ratio": r.ratio, "changed_fraction": r.changed_fraction})


async def fleet(request: web.Request) -> web.Response:
    repo = request.app[PUBLISHER].repo
    everyone = request.query.get("all", "false")
    if everyone not in ("true", "false"):
        raise UsageError("all must be true or false")
    doc = await asyncio.to_thread(read_fleet, repo, time.time(), everyone=everyone == "true")
    return web.json_response(doc)


# --- engine ranks (weightsync.service.engines) -----------------------------------------------------
async def _close_engines(app: web.Application) -> None:
    app[SUBSCRIBER].close_waits()  # held ?wait= calls too
    app[SUBSCRIBER].engines.close()
    app[SUBSCRIBER].heads.close()  # held head polls too


def _int_field(doc: dict, key: str, lo: int, hi: int, null: bool = False) -> int | None:
    """``doc[key]`` as an integer in ``lo..hi`` (or None, where ``null``); else a UsageError (400)."""
    v = doc.get(key)
    if v is None and null:
        return None
    n = _integral(v)
    if n is None or not lo <= n <= hi:
        raise UsageError(f"{key} must be {'null or ' if null else ''}an integer in {lo}..{hi}")
    return n


def _str_field(doc: dict, key: str, null: bool = False, limit: int = 1000) -> str | None:
    """``doc[key]`` as a non-empty string of at most ``limit`` characters (or None, where ``null``)."""
    v = doc.get(key)
    if v is None and null:
        return None
    if not isinstance(v, str) or not 0 < len(v) <= limit:
        raise UsageError(f"{key} must be {'null or ' if null else ''}a string of 1..{limit} characters")
    return v


async def post_engine(request: web.Request) -> web.Response:
    doc = await _json_body(
        request, {"replica", "rank", "world", "version", "pid", "epoch"}, {"replica", "rank", "world"}
    )
    replica = _str_field(doc, "replica")
    if not ID_RE.match(replica):
        raise UsageError("replica must be 1-128 characters of A-Z a-z 0-9 . _ -")
    world = _int_field(doc, "world", 1, MAX_WORLD)
    rank = _int_field(doc, "rank", 0, MAX_WORLD - 1)  # below world: checked by the coordinator (409)
    version = _int_field(doc, "version", 0, MAX_VERSION, null=True)
    pid = _int_field(doc, "pid", 0, 1 << 62, null=True)
    epoch = _int_field(doc, "epoch", 0, 1 << 62, null=True)
    return web.json_response(request.app[SUBSCRIBER].engines.register(replica, rank, world, version, pid, epoch))


async def post_engine_poll(request: web.Request) -> web.Response:
    doc = await _json_body(request, {"instance", "after", "wait", "version", "epoch"}, {"instance"})
    instance = _str_field(doc, "instance")
    after = _int_field(doc, "after", 0, 1 << 62) if "after" in doc else 0
    wait = doc.get("wait", 0)
    if type(wait) not in (int, float) or not 0 <= wait <= MAX_WAIT:  # NaN fails both comparisons
        raise UsageError(f"wait must be a number of seconds in 0..{MAX_WAIT:g}")
    version = _int_field(doc, "version", 0, MAX_VERSION, null=True)
    epoch = _int_field(doc, "epoch", 0, 1 << 62, null=True)
    engines = request.app[SUBSCRIBER].engines
    return web.json_response(await engines.poll(instance, after, float(wait), version, epoch))


async def post_engine_report(request: web.Request) -> web.Response:
    doc = await _json_body(
        request, {"instance", "txn", "phase", "ok", "version", "error", "epoch"}, {"instance", "txn", "phase", "ok"}
    )
    instance = _str_field(doc, "instance")
    txn = _int_field(doc, "txn", 0, 1 << 62)
    if doc["phase"] not in PHASES:
        raise UsageError(f"phase must be one of {', '.join(PHASES)}")
    if not isinstance(doc["ok"], bool):
        raise UsageError("ok must be true or false")
    version = _int_field(doc, "version", 0, MAX_VERSION, null=True)
    error = doc.get("error")
    if error is not None and not isinstance(error, str):
        raise UsageError("error must be null or a string")
    error = None if error is None else " ".join(error.split())[:500]  # one line, bounded: it goes to logs
    epoch = _int_field(doc, "epoch", 0, 1 << 62, null=True)
    engines = request.app[SUBSCRIBER].engines
    return web.json_response(engines.report(instance, txn, doc["phase"], doc["ok"], version, error, epoch))


async def post_engine_leave(request: web.Request) -> web.Response:
    doc = await _json_body(request, {"instance"}, {"instance"})
    request.app[SUBSCRIBER].engines.leave(_str_field(doc, "instance"))
    return web.json_response({"left": True})


async def get_head(request: web.Request) -> web.Response:
    """The head this subscriber last read; with ``after`` (the ``seq`` of an earlier answer) and ``wait``,
    held until the head moves or the wait runs out (a follower's long poll, ``--head-from``)."""
    raw = request.query.get("after")
    after = None
    if raw is not None:
        after = int(raw) if _digits(raw) and len(raw) <= 18 else None
        if after is None:
            raise UsageError("after must be an integer in 0..10**18 (the seq of an earlier answer)")
    sub = request.app[SUBSCRIBER]
    await sub.heads.wait(after, _wait(request) or 0.0)
    return web.json_response(sub.heads.doc(sub.repo.url, sub.cfg.identity.id))


async def get_manifest(request: web.Request) -> web.Response:
    raw = request.match_info["version"]
    version = int(raw) if _digits(raw) and len(raw) <= 19 else -1
    if not 0 <= version <= MAX_VERSION:
        raise UsageError(f"version must be an integer in 0..{MAX_VERSION}")
    sub = request.app[SUBSCRIBER]
    head = sub.heads.state.version
    if head is None or version > head:  # read again only for a version above the head last read
        head = await asyncio.to_thread(sub.heads.read)
    if head is None or version > head:  # a manifest above the head is a publish in progress or abandoned
        return _error(404, f"version {version} does not exist in {sub.repo.url} (head {head})")
    try:
        manifest = await asyncio.to_thread(sub.repo.manifest, version)
    except VersionError as exc:
        return _error(404, str(exc))
    return web.Response(body=manifest_to_json(manifest), content_type="application/json")
