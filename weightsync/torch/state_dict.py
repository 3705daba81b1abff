"""Publishing a trainer's state dict in-process, without a checkpoint on disk: each step is
serialized with safetensors into tmpfs and published; the previous step's folder is the delta base."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from weightsync.errors import BaseMismatchError
from weightsync.store.repo import open_repo
from weightsync.sync.publish import PublishConfig, PublishResult, publish

# --- in-process publishing from a trainer --------------------------------------------------------


class StateDictPublisher:
    """Publishes a trainer's state dict in-process, without a checkpoint on disk.

    Cost: each :meth:`publish` serializes the tensors once with safetensors into a folder under
    ``work_dir`` (tmpfs by default: a memory copy, plus a device-to-host copy for GPU tensors),
    which :func:`weightsync.publish` then reads back. The previous version's folder is kept as the
    delta base, so tmpfs holds up to two serialized copies of the model at a time.

    ``device_diff=True``: diff on the tensors' devices against a device-side copy of the last
    published tensors and move only the changes to the host (:mod:`weightsync.torch.device`; costs
    device memory for that copy).
    """

    def __init__(
        self,
        store,
        *,
        config: PublishConfig | None = None,
        work_dir: str | os.PathLike | None = None,
        cache_dir: str | os.PathLike | None = None,
        filename: str = "model.safetensors",
        device_diff: bool = False,
    ):
        from weightsync.torch.device import make_work_folder  # imports torch: only once a publisher is made

        self.repo = open_repo(store)
        self.config = config or PublishConfig()
        self._scratch = make_work_folder(work_dir, "weightsync-sd-", "weightsync state-dict publisher (its mirror)")
        self.work = self._scratch.path
        self.cache_dir = None if cache_dir is None else Path(cache_dir)
        self.filename = filename
        self._prev: tuple[int, Path] | None = None
        self._device = None
        if device_diff:
            from weightsync.torch.device import DeviceDiffPublisher

            self._device = DeviceDiffPublisher(
                self.repo, config=self.config, work_dir=self.work, cache_dir=self.cache_dir, filename=filename
            )

    def publish(self, state_dict, version: int | None = None, metadata: dict[str, str] | None = None) -> PublishResult:
        """Publish ``state_dict`` (name -> tensor) as ``version`` (default: head + 1), with ``metadata`` in
        the safetensors header; the previous step's folder is the delta base when the head is still it."""
        if self._device is not None:
            return self._device.publish(state_dict, version, metadata)
        folder = self.work / f"v{len(os.listdir(self.work))}-{time.monotonic_ns()}"
        folder.mkdir()
        save_state_dict(state_dict, folder / self.filename, metadata)
        head = self.repo.head_version()
        base = self._prev[1] if self._prev is not None and self._prev[0] == head else None
        try:
            try:
                r = publish(folder, self.repo, version, config=self.config, base_dir=base, cache_dir=self.cache_dir)
            except BaseMismatchError:
                if base is None:
                    raise
                r = publish(folder, self.repo, version, config=self.config, cache_dir=self.cache_dir)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        if self._prev is not None:
            shutil.rmtree(self._prev[1], ignore_errors=True)
        self._prev = (r.version, folder)
        return r

    def close(self) -> None:
        """Remove the work folder (and free the device publisher's snapshot)."""
        if self._device is not None:
            self._device.close()
        self._scratch.close()
        self._prev = None

    def __enter__(self) -> StateDictPublisher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def save_state_dict(state_dict, path: Path, metadata: dict[str, str] | None = None) -> None:
    """Write torch tensors to a safetensors file (on CPU, contiguous; tensors sharing memory, such as
    tied weights, are each saved in full)."""
    from safetensors.torch import save_file

    seen, tensors = set(), {}
    for name, t in state_dict.items():
        t = t.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        tensors[name] = t.clone() if ptr in seen and t.numel() else t
        seen.add(ptr)
    save_file(tensors, str(path), metadata=metadata or {"format": "pt"})


def publish_state_dict(
    state_dict,
    store,
    version: int | None = None,
    *,
    config: PublishConfig | None = None,
    cache_dir: str | os.PathLike | None = None,
    work_dir: str | os.PathLike | None = None,
    metadata: dict[str, str] | None = None,
) -> PublishResult:
    """Publish a state dict as one version (one-shot; keep a :class:`StateDictPublisher` across steps
    so the previous step's bytes serve as the delta base). With ``cache_dir`` the parent version is
    kept there between calls (linked when on the same file system as ``work_dir``, else copied);
    without it the parent is pulled from the store for every delta."""
    with StateDictPublisher(store, config=config, work_dir=work_dir, cache_dir=cache_dir) as p:
        return p.publish(state_dict, version, metadata)
