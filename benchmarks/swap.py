"""Swap pause of the in-process torch sink, in both its modes, against a full ``load_state_dict``
of the same model.

For each learning rate, the cached realistic trajectory (benchmarks/trajectory.py: a 37M-parameter
MoE, 74 MB in bf16, really trained with AdamW) is published to a temporary file store. The baseline
is ``model.load_state_dict(sd)`` with ``sd`` already in host memory (best of 15), and the same
preceded by reading the safetensors file (best of 3), measured once per learning rate and shared by
both modes. Then, for each mode, a fresh bf16 model is loaded with step 0 and
:class:`weightsync.torch.TorchSink` brings it to steps 1..5 one by one: ``prepare`` (no lock), one
forward pass (a serving loop keeps the weights hot), and ``apply`` (the pause, under the lock):

- ``patch``: ``prepare`` fetches, decodes, verifies and stages the patches on the device; the pause
  scatters the changed elements in place (tensors of which more than ``--dense-above`` changed are
  copied whole) and synchronizes the device.
- ``flip``: ``prepare`` also catches the standby buffers up with the live version (copying the live
  values at the positions the previous update changed) and writes the new version into them; the
  pause repoints each changed tensor at its standby storage (one ``.data`` assignment per changed
  tensor, no copy, no device work). The standby costs a second copy of the model's memory ("standby"
  column); between an apply and the next prepare the sink also keeps the changed positions ("replay"
  column, the median over the updates of :attr:`weightsync.torch.TorchSink.replay_bytes`).

Two pause figures per mode, treated alike. "1st pause" is the real ``apply``, the pause the serving
loop actually saw: the median over the 5 updates ("1st max": the longest of the 5). "best pause" is
the median over the updates of each update's best of that apply and 9 replays of the same swap,
which factors out an unlucky scheduling on a shared machine but is warm (caches, allocator,
branch predictors): a lower bound, not what the first apply costs. "pause/load" divides each of the
two by the ``load_state_dict`` time. A patch-mode replay re-runs the same scatters and copies (the
same memory traffic; the values are already set). A flip-mode replay flips the changed tensors back
to their previous storage and then forward again, under the lock, timing each of the two flips on
its own, exactly as ``apply`` times its flip (the same :func:`weightsync.torch.sink.point_to` call over
the same tensors); the model ends on the new version. The model is checked bit for bit against the
last checkpoint at the end, in each mode.

    python benchmarks/swap.py [--mode patch|flip|both] [--device cuda] [--lr 1e-6 --lr 1e-5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent))

import common  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from trajectory import ModelConfig, MoeForCausalLM  # noqa: E402

import weightsync  # noqa: E402
from weightsync.torch.sink import TorchSink, point_to

STEPS = 6


def best_seconds(fn, repeat: int) -> float:
    """Fastest wall time of ``repeat`` calls."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_model(step_dir: Path, device: torch.device) -> torch.nn.Module:
    cfg = json.loads((step_dir / "config.json").read_text())
    fields = {k: cfg[k] for k in ModelConfig.__dataclass_fields__}
    model = MoeForCausalLM(ModelConfig(**fields)).to(torch.bfloat16).to(device)
    model.load_state_dict(load_file(str(step_dir / "model.safetensors")))
    return model.eval()


def bench_load_state_dict(model: torch.nn.Module, sd: dict, device: torch.device, repeat: int = 15) -> float:
    def once() -> None:
        with torch.no_grad():
            model.load_state_dict(sd)
        _sync(device)

    return best_seconds(once, repeat)


def bench_disk_load(model: torch.nn.Module, path: Path, device: torch.device, repeat: int = 3) -> float:
    def once() -> None:
        with torch.no_grad():
            model.load_state_dict(load_file(str(path)))
        _sync(device)

    return best_seconds(once, repeat)


def replay_seconds(sink: TorchSink, up, device: torch.device, repeat: int = 9) -> float:
    """Best time of re-running an applied update's swap, so that one unlucky scheduling on a shared
    machine does not decide the figure. Patch mode: the same scatters and copies (same memory
    traffic; values already set). Flip mode: ``repeat`` pairs of flips, back to the old storages and
    forward to the new ones, each flip timed on its own under the lock; the model ends on the new
    version."""
    if up.mode == "flip":
        best = float("inf")
        for _ in range(repeat):
            for new in (False, True):
                with sink.lock:
                    t0 = time.perf_counter()
                    point_to(up.flips, new)
                    best = min(best, time.perf_counter() - t0)
        return best

    def once() -> None:
        with torch.no_grad(), sink.lock:
            for p in up.patches:
                p.write()
            _sync(device)

    return best_seconds(once, repeat)


def serve(model: torch.nn.Module, device: torch.device) -> None:
    """One small forward pass, as the serving loop would run between two updates."""
    with torch.no_grad():
        model(torch.zeros(1, 16, dtype=torch.long, device=device))
    _sync(device)


def same_bits(model: torch.nn.Module, sd: dict) -> bool:
    live = model.state_dict()
    return all(torch.equal(live[k].cpu().view(torch.int16), v.view(torch.int16)) for k, v in sd.items())


def run_mode(mode: str, store: str, dirs: list[Path], last: dict, device: torch.device, dense_above: float) -> dict:
    model = build_model(dirs[0], device)
    n_elem = sum(p.numel() for p in model.state_dict().values())
    serve(model, device)
    sink = TorchSink(store, model, 0, dense_above=dense_above, mode=mode)
    rows = []
    for v in range(1, STEPS):
        t0 = time.perf_counter()
        up = sink.prepare(v)
        t_prep = time.perf_counter() - t0
        serve(model, device)  # weights are hot in a serving process: one forward pass between updates
        pause = sink.apply(up)
        rows.append(
            {
                "version": v,
                "changed": up.changed_elements / n_elem,
                "fetched_bytes": up.fetched_bytes,
                "prepare_s": t_prep,
                "pause_s": pause,
                "pause_best_s": min(pause, replay_seconds(sink, up, device)),
                "replay_bytes": sink.replay_bytes,
                "dense_tensors": sum(p.index is None for p in up.patches),
                "patched_tensors": len(up.patches),
            }
        )
    serve(model, device)
    firsts = [r["pause_s"] for r in rows]
    return {
        "mode": mode,
        "standby_bytes": sink.standby_bytes,
        "bit_exact": same_bits(model, last),
        "replay_bytes_median": statistics.median(r["replay_bytes"] for r in rows),
        "changed_mean": statistics.mean(r["changed"] for r in rows),
        "prepare_median_s": statistics.median(r["prepare_s"] for r in rows),
        "first_pause_median_s": statistics.median(firsts),
        "first_pause_max_s": max(firsts),
        "best_pause_median_s": statistics.median(r["pause_best_s"] for r in rows),
        "steps": rows,
    }


def run(lr: float, device: torch.device, dense_above: float, modes: list[str]) -> list[dict]:
    dirs = common.build_cached(f"moe-lr{lr:g}", lr, STEPS)
    with tempfile.TemporaryDirectory(prefix="weightsync-swap-") as tmp:
        store = str(Path(tmp) / "store")
        for d in dirs:
            weightsync.publish(d, store)
        model = build_model(dirs[0], device)
        n_elem = sum(p.numel() for p in model.state_dict().values())
        n_bytes = sum(p.numel() * p.element_size() for p in model.state_dict().values())
        last = load_file(str(dirs[-1] / "model.safetensors"))
        t_load = bench_load_state_dict(model, last, device)
        t_disk = bench_disk_load(model, dirs[-1] / "model.safetensors", device)
        del model
        out = []
        for mode in modes:
            r = run_mode(mode, store, dirs, last, device, dense_above)
            out.append(
                {
                    "lr": lr,
                    "device": str(device),
                    "model_bytes": n_bytes,
                    "elements": n_elem,
                    "load_state_dict_s": t_load,
                    "disk_load_s": t_disk,
                    **r,
                    "first_pause_ratio": r["first_pause_median_s"] / t_load,
                    "best_pause_ratio": r["best_pause_median_s"] / t_load,
                }
            )
    return out


def table(results: list[dict]) -> str:
    cols = [
        ("lr", 6),
        ("device", 6),
        ("model", 6),
        ("mode", 5),
        ("changed", 7),
        ("load_state_dict", 15),
        ("file+load", 9),
        ("prepare", 9),
        ("1st pause", 9),
        ("1st max", 9),
        ("best pause", 10),
        ("pause/load (1st)", 16),
        ("pause/load (best)", 17),
        ("standby", 7),
        ("replay", 7),
        ("exact", 5),
    ]
    rows = [
        [
            f"{r['lr']:g}",
            r["device"],
            f"{r['model_bytes'] / 1e6:.0f}MB",
            r["mode"],
            f"{100 * r['changed_mean']:.2f}%",
            f"{1e3 * r['load_state_dict_s']:.2f} ms",
            f"{1e3 * r['disk_load_s']:.1f} ms",
            f"{1e3 * r['prepare_median_s']:.1f} ms",
            f"{1e3 * r['first_pause_median_s']:.3f} ms",
            f"{1e3 * r['first_pause_max_s']:.3f} ms",
            f"{1e3 * r['best_pause_median_s']:.3f} ms",
            f"{100 * r['first_pause_ratio']:.2f}%",
            f"{100 * r['best_pause_ratio']:.2f}%",
            f"{r['standby_bytes'] / 1e6:.0f}MB",
            f"{r['replay_bytes_median'] / 1e6:.1f}MB" if r["mode"] == "flip" else "-",
            "yes" if r["bit_exact"] else "NO",
        ]
        for r in results
    ]
    widths = [max(w, len(name), *(len(row[i]) for row in rows)) for i, (name, w) in enumerate(cols)]
    head = " ".join(name.rjust(w) for (name, _), w in zip(cols, widths))
    return "\n".join([head, "-" * len(head)] + [" ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--mode", choices=("patch", "flip", "both"), default="both", help="sink mode(s) to measure (default both)"
    )
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--lr", type=float, action="append", help="learning rates (default: 1e-6 and 1e-5)")
    ap.add_argument("--dense-above", type=float, default=0.05, help="copy a whole tensor above this changed fraction")
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    modes = ["patch", "flip"] if args.mode == "both" else [args.mode]
    results = [r for lr in (args.lr or [1e-6, 1e-5]) for r in run(lr, device, args.dense_above, modes)]
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0 if all(r["bit_exact"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
