"""``weightsync demo`` and the synthetic RL trajectory it (and the tests) publish: fp32 master
weights take Adam-like steps, published in bf16, so most elements stay put and the ones that move
mostly move by one unit in the last place (numpy only, seeded)."""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from weightsync.codec import jit
from weightsync.service.progress import human_bytes
from weightsync.sync.publish import PublishConfig, publish
from weightsync.sync.pull import pull, verify


def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 (nearest, ties to even) and return the uint16 bit patterns."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    return rounded.astype(np.uint16)


def write_safetensors(
    path: Path, tensors: dict[str, tuple[str, tuple[int, ...], bytes]], metadata: dict | None = None
) -> None:
    """Write a safetensors file from raw little-endian bytes (dtype name, shape, data) per tensor."""
    header: dict = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for _, _, data in tensors.values():
            f.write(data)
    tmp.replace(path)


def _shapes(hidden: int, layers: int, experts: int, vocab: int) -> dict[str, tuple[int, ...]]:
    shapes = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}"
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            shapes[f"{p}.self_attn.{proj}.weight"] = (hidden, hidden)
        shapes[f"{p}.mlp.gate.weight"] = (experts, hidden)
        for e in range(experts):
            for proj, shape in (
                ("gate_proj", (2 * hidden, hidden)),
                ("up_proj", (2 * hidden, hidden)),
                ("down_proj", (hidden, 2 * hidden)),
            ):
                shapes[f"{p}.mlp.experts.{e}.{proj}.weight"] = shape
        shapes[f"{p}.input_layernorm.weight"] = (hidden,)
    shapes["model.norm.weight"] = (hidden,)
    shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


class SyntheticTrainer:
    """Holds fp32 master weights; :meth:`step` moves them, :meth:`save` writes a bf16 checkpoint."""

    def __init__(
        self, hidden: int = 128, layers: int = 2, experts: int = 4, vocab: int = 1024, lr: float = 1e-5, seed: int = 0
    ):
        self.rng = np.random.default_rng(seed)
        self.lr = lr
        self.master = {}
        for name, shape in _shapes(hidden, layers, experts, vocab).items():
            if name.endswith("norm.weight"):
                self.master[name] = 1.0 + 0.05 * self.rng.standard_normal(shape).astype(np.float32)
            else:
                scale = np.float32(1.0 / np.sqrt(shape[-1]))
                self.master[name] = (scale * self.rng.standard_normal(shape)).astype(np.float32)
        self.router_bias = np.zeros(experts * layers, dtype=np.float32)
        self.steps = 0

    def step(self) -> None:
        """One Adam-like step of the fp32 master weights (and the router bias)."""
        for w in self.master.values():
            g = self.rng.standard_normal(w.shape).astype(np.float32)
            w -= np.float32(self.lr) * np.sign(g) * (0.5 + np.abs(np.tanh(g)))
        self.router_bias += np.float32(1e-3) * self.rng.standard_normal(self.router_bias.shape).astype(np.float32)
        self.steps += 1

    def save(self, directory: Path, shards: int = 1) -> Path:
        """Write the weights as a bf16 checkpoint in ``directory`` (``shards`` safetensors files); returns
        the folder."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        names = list(self.master)
        groups = [names[i::shards] for i in range(shards)]
        index = {}
        for k, group in enumerate(groups):
            fname = "model.safetensors" if shards == 1 else f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
            tensors = {n: ("BF16", self.master[n].shape, to_bf16_bits(self.master[n]).tobytes()) for n in group}
            if k == 0:
                tensors["model.router_bias"] = ("F32", self.router_bias.shape, self.router_bias.tobytes())
                tensors["model.step"] = ("I64", (), np.int64(self.steps).tobytes())
            write_safetensors(directory / fname, tensors, {"format": "pt"})
            index.update({n: fname for n in tensors})
        if shards > 1:
            (directory / "model.safetensors.index.json").write_text(
                json.dumps({"metadata": {}, "weight_map": index}, indent=2)
            )
        (directory / "config.json").write_text(
            json.dumps(
                {"model_type": "synthetic-moe", "hidden_size": int(next(iter(self.master.values())).shape[1])}, indent=2
            )
        )
        return directory


def make_trajectory(root: Path, steps: int = 4, shards: int = 1, **kwargs) -> list[Path]:
    """Write ``steps + 1`` checkpoints ``root/step_000000`` ... and return their paths."""
    trainer = SyntheticTrainer(**kwargs)
    out = []
    for i in range(steps + 1):
        if i:
            trainer.step()
        out.append(trainer.save(Path(root) / f"step_{i:06d}", shards=shards))
    return out


def run_demo(workdir: str | None, steps: int = 8, hidden: int = 256) -> int:
    """``weightsync demo``: publish ``steps`` synthetic checkpoints to a file store, pull and verify
    each into a replica, and print the table; returns the exit status (0)."""
    root = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="weightsync-demo-"))
    root.mkdir(parents=True, exist_ok=True)
    store = f"file://{(root / 'store').absolute()}"
    replica = root / "replica"
    trainer = SyntheticTrainer(hidden=hidden, layers=4, experts=8, vocab=8192, lr=1e-6, seed=0)
    print(f"weightsync demo in {root}: store {store}, replica {replica}")
    print(
        f"{'step':>4} {'kind':>8} {'checkpoint':>11} {'delta':>10} {'ratio':>7} {'changed':>8} {'publish':>8} "
        f"{'pull':>7} {'verify':>7} {'compile':>8}"
    )
    cfg = PublishConfig(keyframe_interval=max(2, steps + 1))
    t_all = time.perf_counter()
    with jit.compile_clock() as clock:
        raw_total, payload_total = _steps(root, store, replica, trainer, steps, cfg, clock)
    if raw_total:
        print(
            f"deltas: {human_bytes(raw_total)} of checkpoints shipped as {human_bytes(payload_total)} "
            f"({raw_total / max(1, payload_total):.1f}x smaller); replica verified byte for byte at every step; "
            f"total {time.perf_counter() - t_all:.1f}s"
        )
    if clock.seconds >= 0.05:
        print(
            f"compile: {clock.seconds:.1f}s of that compiled the codec's kernels for this CPU, once: numba caches "
            "them and the next run loads them (a daemon compiles or loads them in the background at its start)"
        )
    sys.stdout.flush()
    return 0


def _steps(root: Path, store: str, replica: Path, trainer: SyntheticTrainer, steps: int, cfg, clock) -> tuple[int, int]:
    """The demo's table rows; returns the bytes of the delta steps' checkpoints and payloads."""
    raw_total = payload_total = 0
    for step in range(steps + 1):
        compiled = clock.seconds
        if step:
            trainer.step()
        ckpt = trainer.save(root / "checkpoints" / f"step_{step:06d}")
        pub = publish(
            ckpt, store, step, config=cfg, base_dir=root / "checkpoints" / f"step_{step - 1:06d}" if step else None
        )
        t0 = time.perf_counter()
        pull(store, replica, step)
        t_pull = time.perf_counter() - t0
        t0 = time.perf_counter()
        verify(store, replica, step)
        t_verify = time.perf_counter() - t0
        kind = "keyframe" if pub.keyframe else "delta"
        print(
            f"{step:>4} {kind:>8} {human_bytes(pub.raw_bytes):>11} {human_bytes(pub.payload_bytes):>10} "
            f"{pub.ratio:>6.1f}x "
            f"{100 * pub.changed_fraction:>7.2f}% {pub.seconds['total']:>7.2f}s {t_pull:>6.2f}s {t_verify:>6.2f}s"
            f" {_compile_cell(clock.seconds - compiled):>8}".rstrip()
        )
        if step:
            raw_total += pub.raw_bytes
            payload_total += pub.payload_bytes
    return raw_total, payload_total


def _compile_cell(seconds: float) -> str:
    """The seconds a step spent compiling kernels (in its publish, pull and verify), blank for none."""
    return f"{seconds:.2f}s" if seconds >= 0.005 else ""
