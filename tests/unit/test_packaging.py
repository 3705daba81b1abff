"""Package metadata: one version, dependency floors that admit only working versions, no hard pins.

``pyproject.toml`` is read the way setuptools builds it (``read_configuration`` expands the dynamic
version), so what pip installs and what ``weightsync.__version__`` says cannot differ.
"""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

import weightsync
from weightsync import _version

tomllib = pytest.importorskip("tomllib")  # Python 3.11+
ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = ROOT / "pyproject.toml"


def _requirements(group: str | None = None) -> dict[str, Requirement]:
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    reqs = project["dependencies"] if group is None else project["optional-dependencies"][group]
    return {r.name: r for r in map(Requirement, reqs)}


def _floor(req: Requirement) -> Version:
    (spec,) = [s for s in req.specifier if s.operator == ">="]
    return Version(spec.version)


def test_version_is_written_once():
    setuptools_config = pytest.importorskip("setuptools.config.pyprojecttoml")
    config = setuptools_config.read_configuration(PYPROJECT)  # what setuptools puts in the wheel's metadata
    assert "version" in tomllib.loads(PYPROJECT.read_text())["project"]["dynamic"]
    assert config["project"]["version"] == weightsync.__version__ == _version.__version__
    assert Version(weightsync.__version__)  # PEP 440
    others = [
        p
        for p in ROOT.joinpath("weightsync").rglob("*.py")
        if p.name != "_version.py" and re.search(r"^__version__\s*=", p.read_text(), re.MULTILINE)
    ]
    assert not others, f"__version__ assigned outside weightsync/_version.py: {others}"


def test_installed_metadata_matches_when_installed_from_this_tree():
    try:
        dist = importlib.metadata.distribution("weightsync")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("weightsync is not installed")
    origin = dist.read_text("direct_url.json") or ""
    if ROOT.as_uri() not in origin:
        pytest.skip(f"the installed weightsync is not this tree's ({origin or 'not a direct install'})")
    assert dist.version == weightsync.__version__


def test_boto3_floor_has_the_conditional_writes_the_store_sends():
    """The S3 store sends IfNoneMatch and IfMatch on PutObject/CompleteMultipartUpload: botocore
    1.35.2 added IfNoneMatch, 1.35.69 IfMatch; an older client rejects them before sending."""
    deps = _requirements()
    assert _floor(deps["boto3"]) >= Version("1.35.69")
    assert _floor(deps["botocore"]) >= Version("1.35.69")
    import botocore.session

    model = botocore.session.get_session().get_service_model("s3")
    for op in ("PutObject", "CompleteMultipartUpload"):
        members = model.operation_model(op).input_shape.members
        assert {"IfNoneMatch", "IfMatch"} <= set(members), op


@pytest.mark.parametrize("group", ["torch", "bench"])
def test_torch_extras_have_a_floor_not_a_pin(group):
    """An inference engine pins its own torch: the package's extras must accept it."""
    req = _requirements(group)["torch"]
    assert not any(s.operator in ("==", "===", "~=", "<", "<=") for s in req.specifier), str(req)
    assert _floor(req) >= Version("2.3")  # torch.uint16/32/64 (weightsync.torch.dtypes)


def test_test_setup_keeps_the_cpu_wheel_pin():
    """An unpinned torch would pull a multi-GB CUDA build into the test set-up."""
    assert str(_requirements("test")["torch"].specifier) == "==2.13.0"
