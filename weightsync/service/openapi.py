"""The OpenAPI 3.1 document of the daemons' HTTP API, per role (publisher or subscriber), served at
``/openapi.json``; tests check the running daemons against it (schemathesis)."""

from __future__ import annotations

from weightsync.format.keys import MAX_VERSION
from weightsync.service.engines import MAX_WAIT, MAX_WORLD, PHASES
from weightsync.service.pin import LATEST

MAX_API_WAIT = 3600  # seconds a call with ?wait= may wait


# --- the OpenAPI document ------------------------------------------------------------------------
def _nullable(t: str | dict) -> dict:
    return {"anyOf": [{"type": t} if isinstance(t, str) else t, {"type": "null"}]}


_VERSION = {"type": "integer", "minimum": 0, "maximum": MAX_VERSION}
_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {"type": "string"}}}
_INSTANCE = {"type": "string", "minLength": 1, "maxLength": 1000}
_ENGINE_RECORD = {
    "type": "object",
    "required": ["replica", "rank", "world", "version"],
    "properties": {
        "replica": {"type": "string"},
        "rank": {"type": "integer", "minimum": 0},
        "world": {"type": "integer", "minimum": 1},
        "version": _nullable(_VERSION),
    },
}


def _engine_schemas() -> dict:
    """The engine ranks' requests and answers (weightsync.service.engines)."""
    return {
        "EngineRegistration": {
            "type": "object",
            "required": ["replica", "rank", "world"],
            "additionalProperties": False,
            "properties": {
                "replica": {"type": "string", "pattern": "^[A-Za-z0-9._-]{1,128}$"},
                "rank": {"type": "integer", "minimum": 0, "maximum": MAX_WORLD - 1},
                "world": {"type": "integer", "minimum": 1, "maximum": MAX_WORLD},
                "version": _nullable(_VERSION),
                "pid": _nullable({"type": "integer", "minimum": 0, "maximum": 1 << 62}),
                "epoch": _nullable({"type": "integer", "minimum": 0, "maximum": 1 << 62}),
            },
        },
        "EngineRegistered": {
            "type": "object",
            "required": ["instance", "poll_seconds", "timeout_seconds"],
            "properties": {
                "instance": {"type": "string"},
                "poll_seconds": {"type": "number"},
                "timeout_seconds": {"type": "number"},
            },
        },
        "EnginePoll": {
            "type": "object",
            "required": ["instance"],
            "additionalProperties": False,
            "properties": {
                "instance": _INSTANCE,
                "after": {"type": "integer", "minimum": 0, "maximum": 1 << 62},
                "wait": {"type": "number", "minimum": 0, "maximum": MAX_WAIT},
                "version": _nullable(_VERSION),
                "epoch": _nullable({"type": "integer", "minimum": 0, "maximum": 1 << 62}),
            },
        },
        "EngineInstruction": {
            "type": "object",
            "required": ["op", "seq"],
            "properties": {
                "op": {"enum": ["none", "prepare", "apply", "abort"]},
                "seq": {"type": "integer", "minimum": 0},
                "txn": {"type": "integer"},
                "version": _VERSION,
                "folder": {"type": "string"},
                "reason": {"type": "string"},
            },
        },
        "EngineReport": {
            "type": "object",
            "required": ["instance", "txn", "phase", "ok"],
            "additionalProperties": False,
            "properties": {
                "instance": _INSTANCE,
                "txn": {"type": "integer", "minimum": 0, "maximum": 1 << 62},
                "phase": {"enum": list(PHASES)},
                "ok": {"type": "boolean"},
                "version": _nullable(_VERSION),
                "error": _nullable("string"),
                "epoch": _nullable({"type": "integer", "minimum": 0, "maximum": 1 << 62}),
            },
        },
        "EngineLeave": {
            "type": "object",
            "required": ["instance"],
            "additionalProperties": False,
            "properties": {"instance": _INSTANCE},
        },
        "Replica": {
            "type": "object",
            "required": ["replica", "world", "version", "state", "reason", "ranks"],
            "properties": {
                "replica": {"type": "string"},
                "world": {"type": "integer", "minimum": 1},
                "version": _nullable(_VERSION),
                "state": {"enum": ["in step", "switching", "waiting"]},
                "reason": {"type": "string"},
                "transaction": _nullable("object"),
                "last_transaction": _nullable("object"),
                "ranks": {"type": "array", "items": {"type": "object"}},
                "dropped": {"type": "object", "additionalProperties": {"type": "string"}},
            },
        },
    }


def _schemas(role: str) -> dict:
    schemas = {
        "Error": _ERROR,
        "Health": {"type": "object", "required": ["status"], "properties": {"status": {"const": "ok"}}},
        "Ready": {
            "type": "object",
            "required": ["ready", "state"],
            "properties": {"ready": {"type": "boolean"}, "state": {"type": "string"}},
        },
        "VersionInfo": {
            "type": "object",
            "required": ["version", "parent", "keyframe", "raw_bytes", "payload_bytes", "changed_fraction", "created"],
            "properties": {
                "version": _VERSION,
                "parent": _nullable(_VERSION),
                "keyframe": {"type": "boolean"},
                "raw_bytes": {"type": "integer", "minimum": 0},
                "payload_bytes": {"type": "integer", "minimum": 0},
                "ratio": _nullable({"type": "number", "minimum": 0}),
                "changed_fraction": {"type": "number", "minimum": 0},
                "created": {"type": "string"},
            },
        },
        "Versions": {
            "type": "object",
            "required": ["head_version", "versions"],
            "properties": {
                "head_version": _nullable(_VERSION),
                "versions": {"type": "array", "items": {"$ref": "#/components/schemas/VersionInfo"}},
            },
        },
    }
    common = {
        "role": {"const": role},
        "id": {"type": "string"},
        "region": {"type": "string"},
        "cluster": {"type": "string"},
        "store": {"type": "string"},
        "state": {"type": "string"},
        "reason": {"type": "string"},
        "last_error": _nullable("string"),
        "stalled": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["op", "key", "store", "seconds", "since"],
                "properties": {
                    "op": {"type": "string"},
                    "key": {"type": "string"},
                    "store": {"type": "string"},
                    "seconds": {"type": "number", "minimum": 0},
                    "since": {"type": "number"},
                },
            },
        },
    }
    if role == "subscriber":
        schemas["Status"] = {
            "type": "object",
            "required": ["role", "id", "current_version", "latest_version", "target", "state"],
            "properties": {
                **common,
                "target_dir": {"type": "string"},
                "current_version": _nullable(_VERSION),
                "standby_version": _nullable(_VERSION),
                "latest_version": _nullable(_VERSION),
                "target": {"anyOf": [_VERSION, {"const": LATEST}]},
                "target_from": {"enum": ["command line", "stored", "default", "api"]},
                "lag": _nullable("integer"),
                "staleness_seconds": {"type": "number", "minimum": 0},
                "partial": _nullable("object"),
                "last_sync": _nullable("object"),
                "hook": _nullable("object"),
                "engines": {
                    "type": "object",
                    "required": ["replicas"],
                    "properties": {"replicas": {"type": "array", "items": {"$ref": "#/components/schemas/Replica"}}},
                },
                "trusted_keys": _nullable({"type": "array", "items": {"type": "string"}}),
                "id_clash": {
                    "type": "boolean",
                    "description": "another subscriber writes the fleet record of this --id (the fleet shows one)",
                },
                "refused": _nullable(
                    {
                        "type": "object",
                        "description": "the newest version refused for its signature (--trusted-key), and why",
                        "required": ["version", "reason", "time"],
                        "properties": {"version": _VERSION, "reason": {"type": "string"}, "time": {"type": "number"}},
                    }
                ),
                "head_from": _nullable(
                    {
                        "type": "object",
                        "description": "the leader waited on between polls (--head-from); ok: false while it does "
                        "not answer and the store is polled instead",
                        "required": ["url", "ok", "seq", "error"],
                        "properties": {
                            "url": {"type": "string"},
                            "ok": {"type": "boolean"},
                            "seq": _nullable("integer"),
                            "error": _nullable("string"),
                        },
                    }
                ),
            },
        }
        schemas["Head"] = {
            "type": "object",
            "required": ["store", "id", "version", "seq", "read_at"],
            "properties": {
                "store": {"type": "string", "description": "the store whose head this is"},
                "id": {"type": "string", "description": "the id of the subscriber that read it"},
                "version": _nullable(_VERSION),
                "seq": {
                    "type": "integer",
                    "minimum": 0,
                    "description": "opaque; changes whenever the version read changes (and at a restart)",
                },
                "read_at": _nullable({"type": "number", "description": "unix time of the last successful read"}),
            },
        }
        schemas.update(_engine_schemas())
        schemas["Target"] = {
            "type": "object",
            "required": ["version"],
            "additionalProperties": False,
            "properties": {"version": {"anyOf": [_VERSION, {"const": LATEST}]}},
        }
    else:
        schemas["Status"] = {
            "type": "object",
            "required": ["role", "id", "head_version", "state"],
            "properties": {
                **common,
                "watch_dir": {"type": "string"},
                "head_version": _nullable(_VERSION),
                "pending": {"type": "array", "items": _VERSION},
                "last_publish": _nullable("object"),
                "rank": _nullable("integer"),
                "world": {"type": "integer"},
                "part_stored": _nullable(_VERSION),
                "signing_key": {
                    "anyOf": [{"type": "string"}, {"type": "null"}],
                    "description": "the id of the key that signs the versions committed (--signing-key)",
                },
            },
        }
        schemas["PublishRequest"] = {
            "type": "object",
            "required": ["path"],
            "additionalProperties": False,
            "properties": {"path": {"type": "string", "minLength": 1}, "version": _nullable(_VERSION)},
        }
        schemas["PublishResult"] = {
            "type": "object",
            "required": ["version", "raw_bytes", "payload_bytes", "uploaded_bytes", "seconds"],
            "properties": {
                "version": _VERSION,
                "parent": _nullable(_VERSION),
                "keyframe": {"type": "boolean"},
                "raw_bytes": {"type": "integer"},
                "payload_bytes": {"type": "integer"},
                "uploaded_bytes": {"type": "integer"},
                "seconds": {"type": "object", "additionalProperties": {"type": "number"}},
            },
        }
        row = {
            "type": "object",
            "required": ["id", "current_version", "lag", "staleness_seconds", "last_seen_seconds"],
            "properties": {
                "id": {"type": "string"},
                "region": {"type": "string"},
                "cluster": {"type": "string"},
                "current_version": _nullable(_VERSION),
                "target": {"anyOf": [_VERSION, {"const": LATEST}]},
                "state": {"type": "string"},
                "lag": _nullable("integer"),
                "staleness_seconds": _nullable("number"),
                "last_seen_seconds": {"type": "number"},
                "engines": {"type": "array", "items": _ENGINE_RECORD},
                "gone": {"type": "boolean"},
                "store": {"type": "string"},
            },
        }
        schemas["Fleet"] = {
            "type": "object",
            "required": ["head_version", "subscribers", "errors"],
            "properties": {
                "store": {"type": "string"},
                "head_version": _nullable(_VERSION),
                "subscribers": {"type": "array", "items": row},
                "hidden": {"type": "integer", "minimum": 0},
                "errors": {"type": "array", "items": {"type": "string"}},
            },
        }
    return schemas


def _json(ref: str, description: str) -> dict:
    return {
        "description": description,
        "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{ref}"}}},
    }


def _op(summary: str, responses: dict, *, v1: bool, auth: bool, **extra) -> dict:
    op = {
        "summary": summary,
        "operationId": summary.lower().replace(" ", "_").replace("'", ""),
        "responses": dict(responses),
        **extra,
    }
    if v1:
        op["responses"]["401"] = _json("Error", "Missing or wrong bearer token")
        op["security"] = [{"bearer": []}] if auth else []
    return op


def _engine_paths(auth: bool, bad: dict, big: dict) -> dict:
    """The subscriber's routes for engine ranks (weightsync.service.engines)."""
    unknown = _json("Error", "No engine rank is registered under this instance id: register again")

    def post(summary: str, request: str, answer: dict, *more: tuple[str, dict]) -> dict:
        schema = {"$ref": f"#/components/schemas/{request}"}
        body = {"required": True, "content": {"application/json": {"schema": schema}}}
        responses = {"200": answer, "400": bad, "413": big, **dict(more)}
        return {"post": _op(summary, responses, v1=True, auth=auth, requestBody=body)}

    ok = lambda key: {  # noqa: E731
        "description": "Done",
        "content": {
            "application/json": {
                "schema": {"type": "object", "required": [key], "properties": {key: {"type": "boolean"}}}
            }
        },
    }
    return {
        "/v1/engines": post(
            "Register an engine rank",
            "EngineRegistration",
            _json("EngineRegistered", "Registered; the instance id names the rank in its later calls"),
            ("409", _json("Error", "The replica's live ranks have another world size, or the rank is not below it")),
        ),
        "/v1/engines/poll": post(
            "Poll for an engine instruction",
            "EnginePoll",
            _json("EngineInstruction", "The next instruction (op none when none came within the wait)"),
            ("404", unknown),
        ),
        "/v1/engines/report": post("Report a transaction phase", "EngineReport", ok("accepted"), ("404", unknown)),
        "/v1/engines/leave": post("Leave as an engine rank", "EngineLeave", ok("left"), ("404", unknown)),
        "/v1/manifest/{version}": {
            "get": _op(
                "A version's manifest",
                {
                    "200": {
                        "description": "The manifest (docs/FORMAT.md, section 2)",
                        "content": {"application/json": {"schema": {"type": "object"}}},
                    },
                    "400": bad,
                    "404": _json("Error", "No such version, or one above the head (not committed)"),
                    "502": _json("Error", "Store error"),
                },
                v1=True,
                auth=auth,
                parameters=[{"name": "version", "in": "path", "required": True, "schema": _VERSION}],
            )
        },
    }


def openapi_document(role: str, auth: bool) -> dict:
    """The OpenAPI 3.1 document of a daemon's API (``auth``: a token is configured)."""
    bad = _json("Error", "Invalid request")
    big = _json("Error", "The body is larger than 1 MiB")
    paths = {
        "/healthz": {"get": _op("Liveness", {"200": _json("Health", "The process is up")}, v1=False, auth=auth)},
        "/readyz": {
            "get": _op(
                "Readiness",
                {"200": _json("Ready", "Ready"), "503": _json("Ready", "Not ready yet")},
                v1=False,
                auth=auth,
            )
        },
        "/metrics": {
            "get": _op(
                "Prometheus metrics",
                {
                    "200": {
                        "description": "Metrics in the Prometheus text format",
                        "content": {"text/plain": {"schema": {"type": "string"}}},
                    }
                },
                v1=False,
                auth=auth,
            )
        },
        "/v1/status": {"get": _op(f"The {role}'s status", {"200": _json("Status", "Status")}, v1=True, auth=auth)},
        "/v1/versions": {
            "get": _op(
                "List versions",
                {
                    "200": _json("Versions", "The newest committed versions, oldest first"),
                    "400": bad,
                    "502": _json("Error", "Store error"),
                },
                v1=True,
                auth=auth,
                parameters=[
                    {
                        "name": "limit",
                        "in": "query",
                        "required": False,
                        "schema": {"type": "integer", "minimum": 1, "maximum": 1000, "default": 100},
                    }
                ],
            )
        },
    }
    if role == "subscriber":
        wait = {
            "name": "wait",
            "in": "query",
            "required": False,
            "schema": {"type": "number", "minimum": 0, "maximum": MAX_API_WAIT},
            "description": "seconds to wait for the outcome (without it the call answers at once)",
        }
        paths["/v1/target"] = {
            "put": _op(
                "Set the target version",
                {
                    "200": _json("Status", "Target set (with wait: the target is served and its swap hook succeeded)"),
                    "202": _json("Status", "With wait: target set, not served yet when the wait ran out"),
                    "400": bad,
                    "413": big,
                    "404": _json("Error", "No such version"),
                    "409": _json("Error", "With wait: another call set another target before this one was served"),
                    "503": _json("Error", "With wait: the subscriber is stopping"),
                    "502": _json("Error", "Store error; with wait: the target's sync or swap hook failed"),
                },
                v1=True,
                auth=auth,
                parameters=[wait],
                requestBody={
                    "required": True,
                    "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Target"}}},
                },
            )
        }
        paths["/v1/hook"] = {
            "post": _op(
                "Call the swap hook again",
                {
                    "200": _json("Status", "With wait: the hook call succeeded"),
                    "202": _json("Status", "The call is queued or running (with wait: still, when the wait ran out)"),
                    "400": bad,
                    "409": _json("Error", "No swap hook is configured, or no version is served yet"),
                    "502": _json("Error", "With wait: the hook call failed"),
                    "503": _json("Error", "With wait: the subscriber is stopping"),
                },
                v1=True,
                auth=auth,
                parameters=[wait],
            )
        }
        paths["/v1/head"] = {
            "get": _op(
                "The store head last read",
                {"200": _json("Head", "The head this subscriber read last, and when"), "400": bad},
                v1=True,
                auth=auth,
                description="For followers (--head-from): with after (the seq of an earlier answer) and wait, "
                "the answer is held until the head read moves or the wait runs out. A follower trusts it only "
                "for when to read the head itself.",
                parameters=[
                    {
                        "name": "after",
                        "in": "query",
                        "required": False,
                        "schema": {"type": "integer", "minimum": 0, "maximum": 10**18},
                        "description": "the seq of the caller's last answer: answered at once when it differs",
                    },
                    {**wait, "description": "seconds to hold the answer while the seq is still after"},
                ],
            )
        }
        paths.update(_engine_paths(auth, bad, big))
    else:
        paths["/v1/publish"] = {
            "post": _op(
                "Publish a folder",
                {
                    "200": _json("PublishResult", "Published"),
                    "400": bad,
                    "413": big,
                    "403": _json(
                        "Error",
                        "The folder is not inside the watched folder or a publish root (or is one of them, or "
                        "holds one)",
                    ),
                    "404": _json("Error", "No such folder"),
                    "409": _json("Error", "Version conflict"),
                    "422": _json("Error", "Not a valid checkpoint"),
                    "502": _json("Error", "Store error"),
                },
                v1=True,
                auth=auth,
                requestBody={
                    "required": True,
                    "content": {"application/json": {"schema": {"$ref": "#/components/schemas/PublishRequest"}}},
                },
            )
        }
        paths["/v1/fleet"] = {
            "get": _op(
                "The fleet ledger",
                {
                    "200": _json("Fleet", "Every subscriber's version, lag and staleness"),
                    "400": bad,
                    "502": _json("Error", "Store error"),
                },
                v1=True,
                auth=auth,
                parameters=[
                    {
                        "name": "all",
                        "in": "query",
                        "required": False,
                        "schema": {"type": "string", "enum": ["true", "false"], "default": "false"},
                        "description": "true: also stopped subscribers and those whose records expired",
                    }
                ],
            )
        }
    doc = {
        "openapi": "3.1.0",
        "info": {"title": f"weightsync {role}", "version": "1"},
        "paths": paths,
        "components": {"schemas": _schemas(role)},
    }
    if auth:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    return doc
