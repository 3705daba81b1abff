"""Device-side diffing (weightsync.torch.device) against the host path of StateDictPublisher.

A bf16 model of about 100M elements (``--elements``) is published once, then ``--steps`` times
after ``--changed`` of its elements moved (mostly by one unit in the last place, as in RL
fine-tuning). Per publish and path: bytes copied device -> host, host seconds (wall time minus
the diff on the tensors' device), payload bytes. Paths:

- ``host``: StateDictPublisher as it was: every tensor to the host (save_state_dict), publish
  re-diffs against the previous folder.
- ``device+folder``: DeviceDiffPublisher(direct=False): changes only to the host, the mirror is
  patched, then publish re-diffs against the previous folder on the host.
- ``device+direct``: DeviceDiffPublisher: changes only to the host, payloads from the changes.

Each with the default codec (``ans``) and with ``entropy_coder=False`` (``sparse``). Here the
"device" is the CPU, so no bytes really cross a bus: the device -> host column counts what would
cross, and CUDA timings are not measured by this script on a CPU-only machine.

    python benchmarks/devicediff.py                    # ~100M elements, 3% changed, 3 steps
    python benchmarks/devicediff.py --elements 2e7 --steps 2 --json out.json

``--ranks W``: the multi-rank paths instead, the model's tensors dealt round-robin to W shards, per
rank and step: ``rank+device`` (RankDeviceDiffPublisher: changes only to the host, its part from
them; the commit is timed apart) against ``rank+folder`` (the shard written as a checkpoint file,
which moves every byte to the host, then ``publish_part`` of it with the previous step's file as
its base). Ranks run one after another, so each rank's wall time is its own.

    python benchmarks/devicediff.py --ranks 4 --elements 4e7 --steps 3
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

from common import ensure_repo_importable

ensure_repo_importable()

import torch  # noqa: E402

from weightsync.codec import CodecConfig
from weightsync.store.repo import open_repo
from weightsync.sync.parts import commit_parts, publish_part
from weightsync.sync.publish import PublishConfig
from weightsync.torch.device import DeviceDiffPublisher, RankDeviceDiffPublisher, rank_filename
from weightsync.torch.state_dict import StateDictPublisher, save_state_dict


def make_model(elements: int, hidden: int = 1024, seed: int = 0) -> dict[str, torch.Tensor]:
    """Llama-like bf16 tensors summing to about ``elements``: an embedding, then layers."""
    g = torch.Generator().manual_seed(seed)
    vocab = max(1, elements // (4 * hidden))
    sd = {"model.embed_tokens.weight": (torch.randn(vocab, hidden, generator=g) * 0.02).bfloat16()}
    total, i = vocab * hidden, 0
    shapes = [
        ("self_attn.q_proj", (hidden, hidden)),
        ("self_attn.k_proj", (hidden // 4, hidden)),
        ("self_attn.v_proj", (hidden // 4, hidden)),
        ("self_attn.o_proj", (hidden, hidden)),
        ("mlp.gate_proj", (3 * hidden, hidden)),
        ("mlp.up_proj", (3 * hidden, hidden)),
        ("mlp.down_proj", (hidden, 3 * hidden)),
    ]
    while total < elements:
        for name, shape in shapes:
            sd[f"model.layers.{i}.{name}.weight"] = (torch.randn(*shape, generator=g) / shape[1] ** 0.5).bfloat16()
            total += shape[0] * shape[1]
        sd[f"model.layers.{i}.input_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        total += hidden
        i += 1
    return sd


def step(sd: dict[str, torch.Tensor], changed: float, seed: int) -> int:
    """Move ``changed`` of the elements by +-1 ulp (1 in 10 by +-2); returns how many moved."""
    g = torch.Generator().manual_seed(seed)
    moved = 0
    for t in sd.values():
        v = t.view(-1).view(torch.int16)
        mask = torch.rand(v.numel(), generator=g) < changed
        delta = torch.randint(0, 2, (v.numel(),), generator=g, dtype=torch.int16) * 2 - 1
        delta *= 1 + (torch.rand(v.numel(), generator=g) < 0.1).to(torch.int16)
        v.add_(torch.where(mask, delta, torch.zeros_like(delta)))
        moved += int(mask.sum())
    return moved


def run(
    path: str, codec: CodecConfig, sd0: dict[str, torch.Tensor], steps: int, changed: float, root: Path
) -> list[dict]:
    sd = {k: v.clone() for k, v in sd0.items()}
    cfg = PublishConfig(codec=codec, keyframe_interval=1000)
    store, work = root / f"store-{path}-{codec.entropy_coder}", root / "work"
    if path == "host":
        pub = StateDictPublisher(store, config=cfg, work_dir=work)
    else:
        pub = DeviceDiffPublisher(store, config=cfg, work_dir=work, direct=path == "device+direct")
    rows = []
    with pub:
        for i in range(steps + 1):
            if i:
                step(sd, changed, seed=i)
            t0 = time.perf_counter()
            r = pub.publish(sd)
            wall = time.perf_counter() - t0
            tensor_bytes = sum(t.nbytes for t in sd.values())
            device_s = r.seconds.get("device_diff", 0.0)
            rows.append(
                {
                    "path": path,
                    "codec": codec.coder if codec.entropy_coder else "sparse",
                    "version": r.version,
                    "d2h_bytes": getattr(r, "d2h_bytes", tensor_bytes),
                    "tensor_bytes": tensor_bytes,
                    "device_s": device_s,
                    "host_s": wall - device_s,
                    "payload_bytes": r.payload_bytes,
                    "changed": r.changed,
                    "elements": r.elements,
                    "route": getattr(r, "route", "host"),
                    "seconds": r.seconds,
                }
            )
    shutil.rmtree(store, ignore_errors=True)
    return rows


def run_ranks(
    path: str, codec: CodecConfig, sd0: dict[str, torch.Tensor], world: int, steps: int, changed: float, root: Path
) -> list[dict]:
    """Every rank's part of every step by ``path`` (``rank+device`` or ``rank+folder``), one rank at
    a time, each version committed by ``commit_parts`` after the last part (timed apart)."""
    names = list(sd0)
    shards = [{n: sd0[n].clone() for n in names[r::world]} for r in range(world)]
    cfg = PublishConfig(codec=codec, keyframe_interval=1000)
    store = root / f"store-{path}-{codec.entropy_coder}"
    repo = open_repo(store)
    pubs = [
        RankDeviceDiffPublisher(store, rank=r, world=world, config=cfg, work_dir=root / "work", poll=0.01)
        for r in range(world)
    ]
    rows, prev = [], [None] * world
    try:
        for i in range(steps + 1):
            for r in range(world):
                if i:
                    step(shards[r], changed, seed=1000 * i + r)
                tensor_bytes = sum(t.nbytes for t in shards[r].values())
                row = {"path": path, "codec": codec.coder if codec.entropy_coder else "sparse", "version": i, "rank": r}
                if path == "rank+device":
                    t0 = time.perf_counter()
                    res = pubs[r].publish(shards[r], version=i, wait=False)  # settles the previous version first
                    wall, d2h, save_s = time.perf_counter() - t0, res.d2h_bytes, 0.0
                else:
                    folder = root / f"ckpt-{codec.entropy_coder}-{r}-{i}"
                    folder.mkdir()
                    t0 = time.perf_counter()
                    name = rank_filename(r, world)
                    save_state_dict(shards[r], folder / name)  # every byte to the host
                    save_s = time.perf_counter() - t0
                    t0 = time.perf_counter()
                    res = publish_part(folder, repo, r, world, [name], i, cfg, base_dir=prev[r])
                    wall, d2h = time.perf_counter() - t0, tensor_bytes
                    if prev[r] is not None:
                        shutil.rmtree(prev[r])
                    prev[r] = folder
                row |= {"d2h_bytes": d2h, "tensor_bytes": tensor_bytes, "part_s": wall, "save_s": save_s}
                row |= {"payload_bytes": res.payload_bytes, "route": getattr(res, "route", "folder")}
                row["seconds"] = dict(res.seconds)
                rows.append(row)
            t0 = time.perf_counter()
            commit_parts(repo, i, world, timeout=60)
            for row in rows[-world:]:
                row["commit_s"] = time.perf_counter() - t0
    finally:
        for p in pubs:
            p.close()
    shutil.rmtree(store, ignore_errors=True)
    return rows


def main_ranks(args, sd0: dict[str, torch.Tensor]) -> None:
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-dd-") as tmp:
        for codec in (CodecConfig(), CodecConfig(entropy_coder=False)):
            for path in ("rank+device", "rank+folder"):
                rows += run_ranks(path, codec, sd0, args.ranks, args.steps, args.changed, Path(tmp))
    print(
        f"{'codec':7} {'path':12} {'d2h MiB/rank':>13} {'of shard':>9} {'wall s':>7} {'device s':>9} "
        f"{'host s':>7} {'(+ save s)':>10} {'payload KiB':>12} {'commit s':>9}"
    )
    for codec in ("ans", "sparse"):
        for path in ("rank+device", "rank+folder"):
            sel = [r for r in rows if r["codec"] == codec and r["path"] == path and r["version"] > 0]
            mean = lambda f: sum(f(r) for r in sel) / len(sel)  # noqa: E731
            dev = mean(lambda r: r["seconds"].get("device_diff", 0.0))
            print(
                f"{codec:7} {path:12} {mean(lambda r: r['d2h_bytes']) / 2**20:13.2f} "
                f"{mean(lambda r: r['d2h_bytes']) / mean(lambda r: r['tensor_bytes']):9.3f} "
                f"{mean(lambda r: r['part_s']):7.3f} {dev:9.3f} {mean(lambda r: r['part_s']) - dev:7.3f} "
                f"{mean(lambda r: r['save_s']):10.3f} {mean(lambda r: r['payload_bytes']) / 1024:12.0f} "
                f"{mean(lambda r: r['commit_s']):9.3f}"
            )
    print("(means per rank over the steps after the first; device s: the diff on the tensors' device, here the CPU)")
    print("part seconds by phase, mean over ranks and steps after the first:")
    phases = ("device_diff", "mirror", "verify_base", "read", "diff", "encode", "upload", "part", "total")
    for codec in ("ans", "sparse"):
        for path in ("rank+device", "rank+folder"):
            sel = [r["seconds"] for r in rows if r["codec"] == codec and r["path"] == path and r["version"] > 0]
            print(
                f"  {codec:7} {path:12} "
                + " ".join(f"{k} {sum(x.get(k, 0.0) for x in sel) / len(sel):.3f}" for k in phases)
            )
    first = [r for r in rows if r["version"] == 0]
    for path in ("rank+device", "rank+folder"):
        sel = [r for r in first if r["path"] == path]
        print(f"first part (keyframe), {path}: part s/rank {sum(r['part_s'] for r in sel) / len(sel):.3f}")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "rows": rows}, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--elements", type=float, default=1e8)
    ap.add_argument("--changed", type=float, default=0.03)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--ranks", type=int, default=0, help="the multi-rank paths with this many ranks")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    sd0 = make_model(int(args.elements))
    n = sum(t.numel() for t in sd0.values())
    print(
        f"model: {len(sd0)} bf16 tensors, {n / 1e6:.1f}M elements, {2 * n / 2**20:.0f} MiB; "
        f"{100 * args.changed:g}% changed per step; torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"device: CPU (CUDA unmeasured)",
        file=sys.stderr,
    )
    if args.ranks:
        return main_ranks(args, sd0)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-dd-") as tmp:
        for codec in (CodecConfig(), CodecConfig(entropy_coder=False)):
            for path in ("host", "device+folder", "device+direct"):
                rows += run(path, codec, sd0, args.steps, args.changed, Path(tmp))
    print(
        f"{'codec':7} {'path':14} {'d2h MiB/step':>13} {'of full':>8} {'device s':>9} {'host s':>7} {'payload KiB':>12}"
    )
    for codec in ("ans", "sparse"):
        for path in ("host", "device+folder", "device+direct"):
            sel = [r for r in rows if r["codec"] == codec and r["path"] == path and r["version"] > 0]
            d2h = sum(r["d2h_bytes"] for r in sel) / len(sel)
            full = sel[0]["tensor_bytes"]
            print(
                f"{codec:7} {path:14} {d2h / 2**20:13.1f} {d2h / full:8.3f} {min(r['device_s'] for r in sel):9.3f} "
                f"{min(r['host_s'] for r in sel):7.3f} {sum(r['payload_bytes'] for r in sel) / len(sel) / 1024:12.0f}"
            )
    print(
        "host seconds by phase, best step (mirror: patch the host copy; verify_base: checksum of the previous"
        " version; read: checksums of the new bytes; encode: payloads, all threads):"
    )
    for codec in ("ans", "sparse"):
        for path in ("device+folder", "device+direct"):
            sel = [r for r in rows if r["codec"] == codec and r["path"] == path and r["version"] > 0]
            best = min(sel, key=lambda r: r["host_s"])["seconds"]
            phases = ("mirror", "verify_base", "read", "diff", "encode", "upload", "commit")
            print(f"  {codec:7} {path:14} " + " ".join(f"{k} {best.get(k, 0.0):.3f}" for k in phases))
    first = [r for r in rows if r["version"] == 0]
    print(
        "first publish (full copy, keyframe): host s "
        f"{min(r['host_s'] for r in first):.2f}..{max(r['host_s'] for r in first):.2f}"
    )
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
