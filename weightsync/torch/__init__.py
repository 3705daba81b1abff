"""Every torch integration: hot swap into a live model, publishing from a state dict, device-side
diffs. The only part of weightsync that imports torch."""

from weightsync.torch.device import DeviceDiffPublisher
from weightsync.torch.sink import ApplyError, CoverageError, TorchSink

__all__ = ["ApplyError", "CoverageError", "DeviceDiffPublisher", "TorchSink"]
