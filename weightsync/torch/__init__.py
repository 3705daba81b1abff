"""Every torch integration: hot swap into a live model (sink.py) through an engine's layout
(layout.py; transformers.py derives it for a transformers model, engines.py for vLLM and SGLang),
an engine rank fed by its node's subscriber (rank.py), whole changed tensors handed to an engine's
own loader (loader.py), publishing from a state dict (state_dict.py), device-side diffs (device.py,
hostpatch.py; also one rank's part of a multi-rank version). The only part of weightsync that
imports torch; this package's names import it on first use, so that the state-dict publisher
(which needs torch only when it serializes) imports without it."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from weightsync.torch.device import DeviceDiffPublisher, RankDeviceDiffPublisher
    from weightsync.torch.layout import Layout, Placement
    from weightsync.torch.rank import EngineRank
    from weightsync.torch.sink import ApplyError, CoverageError, TorchSink

_LAZY = {
    "ApplyError": "sink",
    "CoverageError": "sink",
    "TorchSink": "sink",
    "DeviceDiffPublisher": "device",
    "RankDeviceDiffPublisher": "device",
    "Layout": "layout",
    "Placement": "layout",
    "EngineRank": "rank",
}
__all__ = [
    "ApplyError",
    "CoverageError",
    "DeviceDiffPublisher",
    "EngineRank",
    "Layout",
    "Placement",
    "RankDeviceDiffPublisher",
    "TorchSink",
]


def __getattr__(name: str):
    """The names of ``_LAZY``, imported when first asked for (PEP 562)."""
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"weightsync.torch.{_LAZY[name]}"), name)
    globals()[name] = value
    return value
