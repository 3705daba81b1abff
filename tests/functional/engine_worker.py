"""An inference engine worker for tests/functional/test_engine_ranks.py (one process per rank).

It loads a torch module from the subscriber's current slot (every safetensors file of the folder),
runs an :class:`~weightsync.torch.rank.EngineRank` beside it, and serves: every 20 ms a "forward
pass" under the serving lock reads the model, and whenever what it holds changes it writes
``--out`` (JSON, replaced atomically): the version, a digest of every tensor's bytes by name, the
names, the rank's history and last error. SIGTERM closes the rank and exits 0.

    python engine_worker.py --url URL --target DIR --replica r0 --rank 0 --world 2 --out FILE
        [--exclude GLOB ...] [--step-apply]     # token: WEIGHTSYNC_API_TOKEN
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import threading
import time
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import load_file

from weightsync.errors import BaseMismatchError
from weightsync.torch.rank import EngineRank, current_folder


def load_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every safetensors file under ``folder`` (its ``.weightsync`` aside)."""
    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(folder).rglob("*.safetensors")):
        if ".weightsync" not in f.relative_to(folder).parts:
            out.update(load_file(str(f)))
    return out


def module_from(tensors: Mapping[str, torch.Tensor]) -> torch.nn.Module:
    """A module tree whose state_dict() names are ``tensors``' names (dots become submodules)."""
    root = torch.nn.Module()
    for name, t in tensors.items():
        *path, leaf = name.split(".")
        m = root
        for p in path:
            if not hasattr(m, p):
                m.add_module(p, torch.nn.Module())
            m = getattr(m, p)
        m.register_parameter(leaf, torch.nn.Parameter(t.clone(), requires_grad=False))
    return root


def digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 over every tensor's name, dtype, shape and raw bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous()
        h.update(f"{name}|{t.dtype}|{list(t.shape)}|".encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def write_json(path: Path, doc: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)


def main() -> int:
    p = argparse.ArgumentParser()
    for flag in ("--url", "--target", "--replica", "--out"):
        p.add_argument(flag, required=True)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--exclude", action="append", default=[])
    p.add_argument("--step-apply", action="store_true", help="apply at the serving loop's step boundary")
    args = p.parse_args()
    out = Path(args.out)
    lock = threading.Lock()
    while True:  # a slot refilled while it was read fails the rank's check: load again
        folder, version = current_folder(args.target)
        model = module_from(load_tensors(folder))
        rank = EngineRank(
            args.url,
            model,
            version,
            replica=args.replica,
            rank=args.rank,
            world=args.world,
            lock=lock,
            token=os.environ.get("WEIGHTSYNC_API_TOKEN"),
            folder=folder,
            exclude=args.exclude,
            auto_apply=not args.step_apply,
        )
        try:
            rank.start()
            break
        except BaseMismatchError:
            continue
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    shown = None
    while not stop.is_set():
        if args.step_apply:
            rank.apply_pending()
        with lock:  # a forward pass: the model is never seen half-applied
            state = (rank.version, rank.last_error, len(rank.history))
            if state != shown:
                sd = model.state_dict()
                doc = {
                    "version": rank.version,
                    "digest": digest(sd),
                    "names": sorted(sd),
                    "loaded": version,
                    "history": list(rank.history),
                    "error": rank.last_error,
                    "pid": os.getpid(),
                }
                write_json(out, doc)
                shown = state
        time.sleep(0.02)
    rank.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
