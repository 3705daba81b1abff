"""The OpenAPI 3.1 document of the daemons' HTTP API, per role (publisher or subscriber), served at
``/openapi.json``; tests check the running daemons against it (schemathesis)."""

from __future__ import annotations

from weightsync.format.keys import MAX_VERSION
from weightsync.service.pin import LATEST


# --- the OpenAPI document ------------------------------------------------------------------------
def _nullable(t: str | dict) -> dict:
    return {"anyOf": [{"type": t} if isinstance(t, str) else t, {"type": "null"}]}


_VERSION = {"type": "integer", "minimum": 0, "maximum": MAX_VERSION}
_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {"type": "string"}}}


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
                "trusted_keys": _nullable({"type": "array", "items": {"type": "string"}}),
                "refused": _nullable(
                    {
                        "type": "object",
                        "description": "the newest version refused for its signature (--trusted-key), and why",
                        "required": ["version", "reason", "time"],
                        "properties": {"version": _VERSION, "reason": {"type": "string"}, "time": {"type": "number"}},
                    }
                ),
            },
        }
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
            },
        }
        schemas["Fleet"] = {
            "type": "object",
            "required": ["head_version", "subscribers", "errors"],
            "properties": {
                "head_version": _nullable(_VERSION),
                "subscribers": {"type": "array", "items": row},
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
        paths["/v1/target"] = {
            "put": _op(
                "Set the target version",
                {
                    "200": _json("Status", "Target set; the subscriber acts on it at once"),
                    "400": bad,
                    "413": big,
                    "404": _json("Error", "No such version"),
                    "502": _json("Error", "Store error"),
                },
                v1=True,
                auth=auth,
                requestBody={
                    "required": True,
                    "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Target"}}},
                },
            )
        }
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
                    "502": _json("Error", "Store error"),
                },
                v1=True,
                auth=auth,
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
