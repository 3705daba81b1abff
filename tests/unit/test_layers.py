"""The package's layers import one way (docs/ARCHITECTURE.md): format <- codec <- store <- local <-
sync <- service <- the demo and the command line, with torch/ on top (nothing imports it but the
facade, lazily). Read from the source, every import counted (inside functions and TYPE_CHECKING
blocks too: a lazy import is still a dependency)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "weightsync"
LAYERS = ["format", "codec", "store", "local", "sync", "service", "demo", "cli", "torch"]  # torch/ sits on top
SHARED = {"errors", "_version"}  # every layer may use these
PURE = {"format", "codec"}  # layers with no I/O clients
PURE_MODULES = {"weightsync.sync.plan"}
IO_LIBS = {"boto3", "botocore", "aiohttp", "prometheus_client"}


def _modules() -> dict[str, Path]:
    return {
        ".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__"): p
        for p in sorted(PACKAGE.rglob("*.py"))
    }


def _imports(path: Path, name: str) -> list[tuple[int, str, list[str]]]:
    """(line, imported module, names) of every import in the file, relative ones resolved."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            out.append((node.lineno, base, [a.name for a in node.names]))
    return out


def _layer(module: str) -> str | None:
    """The layer of ``weightsync.<layer>...``; None for the facade and the shared modules."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else None


MODULES = _modules()


def test_every_module_belongs_to_a_layer():
    strays = [m for m in MODULES if m != "weightsync" and _layer(m) is None and m.split(".")[1] not in SHARED]
    assert not strays, f"modules outside the layers (add them to a layer's folder): {strays}"


def violations(module: str, path: Path) -> list[str]:
    """What in ``path`` (the source of ``module``) breaks the layering."""
    out, mine = [], LAYERS.index(_layer(module))
    for line, target, names in _imports(path, module):
        top = target.split(".")[0]
        where = f"{module} line {line} imports {target}"
        targets = [target]
        if target == "weightsync":  # the facade re-exports; inner code imports the defining module
            if not all(f"weightsync.{n}" in MODULES for n in names):
                out.append(f"{where} (the facade): {names}")
            targets = [f"weightsync.{n}" for n in names]
        for t in targets if top == "weightsync" else ():
            layer = _layer(t)
            if layer is not None and LAYERS.index(layer) > mine:
                out.append(f"{where}: the {_layer(module)} layer may not use {layer}")
        if (top == "torch" or target == "safetensors.torch") and _layer(module) != "torch":
            out.append(f"{where}: only weightsync/torch/ imports torch")
        if (_layer(module) in PURE or module in PURE_MODULES) and top in IO_LIBS:
            out.append(f"{where}: {module} is pure")
    return out


@pytest.mark.parametrize("module", [m for m in MODULES if _layer(m)])
def test_imports_run_one_way(module):
    assert violations(module, MODULES[module]) == []


def test_the_contract_sees_each_kind_of_violation(tmp_path):
    """The check is not vacuous: each kind of violation is found, in top-level and lazy imports."""
    bad = tmp_path / "bad.py"
    bad.write_text(
        "from weightsync.service.metrics import Metrics\nfrom weightsync import publish\n"
        "def f():\n    import torch\n    import boto3\n"
    )
    found = violations("weightsync.codec.bad", bad)
    assert [v.split(":")[0] for v in found] == [
        "weightsync.codec.bad line 1 imports weightsync.service.metrics",
        "weightsync.codec.bad line 2 imports weightsync (the facade)",
        "weightsync.codec.bad line 4 imports torch",
        "weightsync.codec.bad line 5 imports boto3",
    ]
    good = tmp_path / "good.py"
    good.write_text("import torch\nfrom weightsync.service.metrics import Metrics\n")
    assert violations("weightsync.torch.good", good) == []
