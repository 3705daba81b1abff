"""Swap pause of the in-process torch sink into a transformers v5 MoE (experts fused in memory, one
tensor per expert on disk), both modes, beside ``load_state_dict`` and a ``from_pretrained`` reload.

The model is a Qwen3-MoE built from a config with random weights (``--layers``, ``--experts``, ...;
~270 MB of bf16 by default), saved with ``save_pretrained`` and published to a temporary file store
with one keyframe. Each later version moves a fraction ``--change`` of every tensor's elements by
one unit in the last place, up or down (what an RL step does to bf16 weights: docs/SCALE.md), and
is saved and published the same way. For each change level and mode, a model loaded with
``from_pretrained`` at version 0 follows versions 1..5 through
:class:`weightsync.torch.TorchSink` with the layout :func:`weightsync.torch.transformers.layout`
derives from the model: ``prepare`` (no lock), one forward pass (a serving loop keeps the weights
hot), ``apply`` (the pause, under the lock).

- ``patch``: the pause scatters the changed elements into the live (fused) tensors in place,
  copying regions of which more than ``--dense-above`` changed whole, and synchronizes the device.
- ``flip``: ``prepare`` writes the new version into standby buffers; the pause repoints each changed
  tensor at its standby (no copy, no device work). The standby doubles the weights' memory.

Baselines, measured once per change level on the same model: ``load_state_dict`` of the new
version's state dict already in the model's memory (best of 9; on a GPU a copy within the device),
"load from host" the same from pinned host memory (on a GPU the copy over the bus that an engine's
reload from host memory makes; on the CPU the same figure), and ``from_pretrained`` of the new
version's folder (best of 2; the reload a subscriber's swap hook triggers in an engine that reloads
from disk). "full decode" is the CPU time of pulling the keyframe version into an empty folder
(every tensor decoded from its full payload, verified and written): the yardstick for ``prepare``.
With ``--codec sparse`` (``--fast-codec``) a one-step delta is patched from its payload alone, and
the sink checks the live tensors against the checksums after the apply, off the lock: "check
after" (:meth:`~weightsync.torch.sink.TorchSink.after_apply`); ``ans`` and ``ac`` deltas are rebuilt
and checked whole in ``prepare`` (their positions are not in the payload without decoding every element).

Pause figures: "1st pause" is the real ``apply`` the serving loop saw (median over the 5 updates);
"best pause" the best of that apply and 9 replays of the same swap (patch: the same writes; flip:
flips back and forth timed one by one), median over the updates: a warm lower bound. Memory:
"staged" is what an update holds between prepare and apply (patch: positions and values; flip: the
standby buffers plus the replayed positions); "mirror" what the sink keeps on the host (0 unless
the model holds a tensor in part). The model is checked bit for bit against the last version's
``from_pretrained`` in each mode.

    python benchmarks/swap.py [--mode patch|flip|both] [--change 0.025 --change 0.15] [--device cuda] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))

import weightsync  # noqa: E402
from weightsync.codec.payload import CodecConfig  # noqa: E402
from weightsync.sync.publish import PublishConfig  # noqa: E402
from weightsync.torch.sink import TorchSink, point_to  # noqa: E402
from weightsync.torch.transformers import layout as transformers_layout  # noqa: E402

STEPS = 6


CODECS = {"ans": CodecConfig(), "ac": CodecConfig(coder="ac"), "sparse": CodecConfig(entropy_coder=False)}
"""The delta codecs a run can publish with, by name."""


def best_seconds(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def config(args):
    import transformers

    return transformers.Qwen3MoeConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        moe_intermediate_size=args.expert_size,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=args.hidden // 8,
        num_experts=args.experts,
        num_experts_per_tok=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )


def make_versions(args, root: Path, change: float) -> list[Path]:
    """Version folders 0..STEPS-1: random weights, then ``change`` of each tensor moved by one ulp."""
    import transformers

    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config(args)).to(torch.bfloat16).eval()
    g = torch.Generator().manual_seed(1)
    dirs = []
    for v in range(STEPS):
        if v:
            with torch.no_grad():
                for p in model.parameters():
                    bits = p.data.view(-1).view(torch.int16)
                    moved = torch.rand(bits.shape, generator=g) < change
                    step = torch.where(torch.rand(bits.shape, generator=g) < 0.5, 1, -1).to(torch.int16)
                    bits.add_(torch.where(moved, step, torch.zeros_like(step)))
        d = root / f"v{v}"
        model.save_pretrained(d)
        dirs.append(d)
    return dirs


def load(path: Path, device: torch.device):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device).eval()


def serve(model, device: torch.device) -> None:
    with torch.no_grad():
        model(torch.zeros(1, 16, dtype=torch.long, device=device))
    _sync(device)


def replay_seconds(sink: TorchSink, up, device: torch.device, repeat: int = 9) -> float:
    """Best time of re-running an applied update's swap (see the module doc)."""
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


def staged_bytes(sink: TorchSink, up) -> int:
    """What an update holds between prepare and apply (flip: the standbys and the replays' positions)."""
    return (sink.standby_bytes if up.mode == "flip" else 0) + sum(p.staged_bytes for p in up.patches)


def bits_equal(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return set(sa) == set(sb) and all(
        torch.equal(sa[k].cpu().view(-1).view(torch.uint8), sb[k].cpu().view(-1).view(torch.uint8)) for k in sa
    )


def run_mode(mode: str, store: str, dirs: list[Path], device: torch.device, dense_above: float) -> dict:
    model = load(dirs[0], device)
    n_elem = sum(t.numel() for t in model.state_dict().values())
    serve(model, device)
    t0 = time.perf_counter()
    lay = transformers_layout(model)
    t_layout = time.perf_counter() - t0
    sink = TorchSink(store, model, 0, layout=lay, dense_above=dense_above, mode=mode)
    rows = []
    for v in range(1, STEPS):
        t0, c0 = time.perf_counter(), time.process_time()
        up = sink.prepare(v)
        t_prep, c_prep = time.perf_counter() - t0, time.process_time() - c0
        staged = staged_bytes(sink, up)
        serve(model, device)
        pause = sink.apply(up)
        c0 = time.process_time()
        sink.after_apply(up)  # the check of payload-patched tensors (sparse), off the lock
        c_check = time.process_time() - c0
        rows.append(
            {
                "version": v,
                "changed": up.changed_elements / n_elem,
                "prepare_s": t_prep,
                "prepare_cpu_s": c_prep,
                "check_cpu_s": c_check,
                "pause_s": pause,
                "pause_best_s": min(pause, replay_seconds(sink, up, device)),
                "staged_bytes": staged,
            }
        )
    serve(model, device)
    exact = bits_equal(model, load(dirs[-1], device))
    firsts = [r["pause_s"] for r in rows]
    return {
        "mode": mode,
        "layout_s": t_layout,
        "mirror_bytes": sink.mirror_bytes,
        "bit_exact": exact,
        "changed_mean": statistics.mean(r["changed"] for r in rows),
        "prepare_median_s": statistics.median(r["prepare_s"] for r in rows),
        "prepare_cpu_median_s": statistics.median(r["prepare_cpu_s"] for r in rows),
        "check_cpu_median_s": statistics.median(r["check_cpu_s"] for r in rows),
        "first_pause_median_s": statistics.median(firsts),
        "first_pause_max_s": max(firsts),
        "best_pause_median_s": statistics.median(r["pause_best_s"] for r in rows),
        "staged_median_bytes": statistics.median(r["staged_bytes"] for r in rows),
        "steps": rows,
    }


def run(args, change: float, codec: str, device: torch.device, modes: list[str]) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="weightsync-swap-") as tmp:
        root = Path(tmp)
        dirs = make_versions(args, root, change)
        store = str(root / "store")
        cfg = PublishConfig(keyframe_interval=1000, codec=CODECS[codec])
        for d in dirs:
            weightsync.publish(d, store, config=cfg)
        c0 = time.process_time()
        weightsync.pull(store, root / "full", 0)
        t_full = time.process_time() - c0
        model = load(dirs[0], device)
        n_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        last = {k: v.clone() for k, v in load(dirs[-1], device).state_dict().items()}

        def load_sd() -> None:
            with torch.no_grad():
                model.load_state_dict(last)
            _sync(device)

        t_load = best_seconds(load_sd, 9)
        t_load_host = t_load
        if device.type != "cpu":  # the new weights in (pinned) host memory: what a reload copies over the bus
            last = {k: v.cpu().pin_memory() for k, v in last.items()}
            t_load_host = best_seconds(load_sd, 9)
        t_reload = best_seconds(lambda: load(dirs[-1], device), 2)
        model = last = None  # free them before the modes run
        out = []
        for mode in modes:
            r = run_mode(mode, store, dirs, device, args.dense_above)
            out.append(
                {
                    "change": change,
                    "codec": codec,
                    "device": str(device),
                    "model_bytes": n_bytes,
                    "load_state_dict_s": t_load,
                    "load_state_dict_host_s": t_load_host,
                    "from_pretrained_s": t_reload,
                    "full_decode_cpu_s": t_full,
                    **r,
                    "first_pause_ratio": r["first_pause_median_s"] / t_load,
                    "best_pause_ratio": r["best_pause_median_s"] / t_load,
                    "first_pause_host_ratio": r["first_pause_median_s"] / t_load_host,
                    "prepare_cpu_ratio": r["prepare_cpu_median_s"] / t_full,
                }
            )
    return out


def table(results: list[dict]) -> str:
    cols = [
        "change",
        "codec",
        "device",
        "model",
        "mode",
        "load_state_dict",
        "load from host",
        "from_pretrained",
        "full decode (CPU)",
        "prepare",
        "prepare CPU",
        "CPU/full",
        "check after (CPU)",
        "1st pause",
        "1st max",
        "best pause",
        "pause/load (1st)",
        "pause/load (best)",
        "pause/host load (1st)",
        "staged",
        "mirror",
        "exact",
    ]
    rows = [
        [
            f"{100 * r['change']:g}%",
            r["codec"],
            r["device"],
            f"{r['model_bytes'] / 1e6:.0f}MB",
            r["mode"],
            f"{1e3 * r['load_state_dict_s']:.1f} ms",
            f"{1e3 * r['load_state_dict_host_s']:.1f} ms",
            f"{r['from_pretrained_s']:.2f} s",
            f"{r['full_decode_cpu_s']:.2f} s",
            f"{1e3 * r['prepare_median_s']:.0f} ms",
            f"{r['prepare_cpu_median_s']:.2f} s",
            f"{r['prepare_cpu_ratio']:.2f}x",
            f"{r['check_cpu_median_s']:.2f} s",
            f"{1e3 * r['first_pause_median_s']:.2f} ms",
            f"{1e3 * r['first_pause_max_s']:.2f} ms",
            f"{1e3 * r['best_pause_median_s']:.2f} ms",
            f"{100 * r['first_pause_ratio']:.1f}%",
            f"{100 * r['best_pause_ratio']:.1f}%",
            f"{100 * r['first_pause_host_ratio']:.1f}%",
            f"{r['staged_median_bytes'] / 1e6:.0f}MB",
            f"{r['mirror_bytes'] / 1e6:.0f}MB",
            "yes" if r["bit_exact"] else "NO",
        ]
        for r in results
    ]
    head = "| " + " | ".join(cols) + " |"
    sep = "|" + "|".join("---:" for _ in cols) + "|"
    return "\n".join([head, sep] + ["| " + " | ".join(row) + " |" for row in rows])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", choices=("patch", "flip", "both"), default="both", help="sink mode(s) (default both)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--change", type=float, action="append", help="changed fraction per step (default 0.025, 0.15)")
    ap.add_argument(
        "--codec",
        choices=(*CODECS, "both"),
        default="both",
        help="delta codec: ans (the default), ac (--entropy-coder ac) or sparse (--fast-codec); both: ans and sparse",
    )
    ap.add_argument("--dense-above", type=float, default=0.05, help="copy a region whole above this changed fraction")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--expert-size", type=int, default=512, help="moe_intermediate_size")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    modes = ["patch", "flip"] if args.mode == "both" else [args.mode]
    codecs = ["ans", "sparse"] if args.codec == "both" else [args.codec]
    changes = args.change or [0.025, 0.15]
    results = []
    for c in changes:
        for codec in codecs:
            results += run(args, c, codec, device, modes)
            print("\n".join(table(results).splitlines()[-len(modes) :]), flush=True)  # (a partial run keeps its rows)
    print(table(results))
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6:.2f} GB")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0 if all(r["bit_exact"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
