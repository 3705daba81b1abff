"""The code is formatted and lint-clean as pyproject.toml's ``[tool.ruff]`` asks (lines of at most
120 characters, imports sorted). ruff is pinned in the test extra, so its formatting cannot drift."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ruff", *args, "--no-cache", "."], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def test_ruff_finds_nothing():
    r = _ruff("check", "--output-format", "concise")
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_code_is_formatted():
    r = _ruff("format", "--check")
    assert r.returncode == 0, r.stdout + r.stderr
