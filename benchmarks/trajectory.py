"""Realistic RL checkpoint trajectories: a small MoE transformer really trained on CPU.

The model follows the Hugging Face Mixtral/Qwen-MoE layout and names (`model.embed_tokens.weight`,
`model.layers.{i}.self_attn.q_proj.weight`, `model.layers.{i}.mlp.gate.weight`,
`model.layers.{i}.mlp.experts.{e}.gate_proj.weight`, `model.norm.weight`, `lm_head.weight`):
RMSNorm, causal attention (no positional encoding, which causal attention does not need to
learn), and a top-2 routed SwiGLU mixture of experts. Training keeps fp32 master weights and
AdamW state, exactly like an RL trainer; every step the parameters are cast to bf16 and published
as a Hugging Face style safetensors checkpoint.

The schedule: seeded init, a short warm start at a large learning rate so the weights leave their
init distribution, then an RL-like phase at the target learning rate (1e-6 or 1e-5). Step 0 is the
checkpoint right after the warm start; step i is published after i RL optimizer steps. The loss is
next-token cross-entropy on sequences drawn from a seeded random Markov chain: it only has to
produce realistic (noisy, sparse-in-vocabulary, expert-routed) gradients.

CLI: `python benchmarks/trajectory.py --lr 1e-6 --steps 6 --out DIR`
(or `--cache NAME` instead of `--out` to build into the benchmark cache, see cached_trajectory).
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

if __package__:
    from .common import cache_dirs, is_complete
else:  # run as a script from benchmarks/
    from common import cache_dirs, is_complete


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the MoE transformer (defaults: 37.0M parameters, 74 MB in bf16)."""

    vocab: int = 8192
    d_model: int = 384
    n_layers: int = 4
    n_heads: int = 6
    n_experts: int = 8
    top_k: int = 2
    d_expert: int = 768


@dataclass(frozen=True)
class TrainConfig:
    """Optimizer and data settings of one trajectory."""

    lr: float
    steps: int = 6
    seed: int = 0
    warm_lr: float = 1e-3
    warm_steps: int = 60
    weight_decay: float = 0.0
    batch: int = 8
    seq_len: int = 64
    init_std: float = 0.02
    aux_loss_coef: float = 0.01


class RMSNorm(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d = cfg.d_model
        self.n_heads = cfg.n_heads
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (
            p(x).view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, d))


class Expert(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.d_model, cfg.d_expert, bias=False)
        self.up_proj = nn.Linear(cfg.d_model, cfg.d_expert, bias=False)
        self.down_proj = nn.Linear(cfg.d_expert, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SparseMoe(nn.Module):
    """Top-k routed experts; `gate` is the router, as in HF Mixtral. Each forward leaves the
    Switch/Mixtral load-balancing loss in `aux_loss` (keeps every expert in use)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k = cfg.top_k
        self.gate = nn.Linear(cfg.d_model, cfg.n_experts, bias=False)
        self.experts = nn.ModuleList(Expert(cfg) for _ in range(cfg.n_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        probs = F.softmax(self.gate(flat), dim=-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        n_experts = probs.shape[-1]
        routed = F.one_hot(chosen, n_experts).sum(1).float().mean(0) / self.top_k
        self.aux_loss = n_experts * (routed * probs.mean(0)).sum()
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            rows, slot = (chosen == e).nonzero(as_tuple=True)
            if rows.numel():
                out.index_add_(0, rows, expert(flat[rows]) * weights[rows, slot, None])
        return out.view_as(x)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.d_model)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.d_model)
        self.mlp = SparseMoe(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab, cfg.d_model)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model)


class MoeForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(tokens)
        for layer in self.model.layers:
            x = layer(x)
        return self.lm_head(self.model.norm(x))


def init_weights(model: nn.Module, std: float) -> None:
    """HF-style init: normal(0, std) for matrices, ones for norms."""
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            nn.init.ones_(p)
        else:
            nn.init.normal_(p, mean=0.0, std=std)


class MarkovData:
    """Token sequences from a seeded random Markov chain: Zipf-distributed successor tokens with
    peaked transition probabilities, so frequent tokens are learned first, as in text."""

    def __init__(self, vocab: int, seed: int, fanout: int = 16, zipf: float = 1.1):
        self.gen = torch.Generator().manual_seed(seed + 1)
        self.vocab = vocab
        rank_weights = torch.arange(1, vocab + 1, dtype=torch.float64).pow(-zipf)
        self.next_tokens = torch.multinomial(
            rank_weights.expand(vocab, -1), fanout, replacement=True, generator=self.gen
        )
        self.next_logits = torch.randn(vocab, fanout, generator=self.gen) * 2.0

    def batch(self, n: int, length: int) -> torch.Tensor:
        tokens = torch.empty(n, length + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(self.vocab, (n,), generator=self.gen)
        for t in range(length):
            probs = F.softmax(self.next_logits[tokens[:, t]], dim=-1)
            pick = torch.multinomial(probs, 1, generator=self.gen).squeeze(1)
            tokens[:, t + 1] = self.next_tokens[tokens[:, t], pick]
        return tokens


def train_step(model: MoeForCausalLM, opt: torch.optim.Optimizer, data: MarkovData, tc: TrainConfig) -> float:
    """One AdamW step of next-token cross-entropy (plus the router's load-balancing loss) on a
    fresh batch; returns the cross-entropy."""
    tokens = data.batch(tc.batch, tc.seq_len)
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    aux = sum(layer.mlp.aux_loss for layer in model.model.layers)
    opt.zero_grad(set_to_none=True)
    (loss + tc.aux_loss_coef * aux).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss.item()


def bf16_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The published view of the fp32 master weights: contiguous bf16 copies."""
    return {n: p.detach().to(torch.bfloat16).contiguous() for n, p in model.named_parameters()}


def save_checkpoint(step_dir: Path, state: dict[str, torch.Tensor], config: dict, shards: int) -> None:
    """Write an HF-style checkpoint (optionally sharded with an index), then the COMPLETE marker."""
    step_dir.mkdir(parents=True, exist_ok=True)
    (step_dir / "config.json").write_text(json.dumps(config, indent=2))
    if shards == 1:
        save_file(state, str(step_dir / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map: dict[str, str] = {}
        names = list(state)
        bounds = np.linspace(0, len(names), shards + 1).astype(int)
        for s in range(shards):
            fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: state[n] for n in names[bounds[s] : bounds[s + 1]]}
            save_file(part, str(step_dir / fname), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(part, fname))
        total = sum(t.numel() * t.element_size() for t in state.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (step_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (step_dir / "COMPLETE").write_text("")


def change_stats(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> dict[str, float]:
    """Fraction of bf16 elements changed, and the shares of changes that are +-1 and +-2 ulp."""
    total = changed = ulp1 = ulp2 = 0
    for name, t in new.items():
        diff = t.view(torch.int16).to(torch.int32) - old[name].view(torch.int16).to(torch.int32)
        mag = diff.abs()
        total += diff.numel()
        changed += int((mag != 0).sum())
        ulp1 += int((mag == 1).sum())
        ulp2 += int((mag == 2).sum())
    return {
        "changed": changed / total,
        "ulp1": ulp1 / max(changed, 1),
        "ulp2": ulp2 / max(changed, 1),
    }


def adamw(model: nn.Module, lr: float, tc: TrainConfig) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), weight_decay=tc.weight_decay)


def warm_start(mc: ModelConfig, tc: TrainConfig, data: MarkovData) -> tuple[nn.Module, float]:
    """Seeded init, then a few large-LR steps so the weights leave their init distribution.
    Returns the model and its last loss."""
    torch.manual_seed(tc.seed)
    model = MoeForCausalLM(mc)
    init_weights(model, tc.init_std)
    opt = adamw(model, tc.warm_lr, tc)
    for _ in range(tc.warm_steps):
        loss = train_step(model, opt, data, tc)
    return model, loss


def make_trajectory(
    out_dir: str | Path,
    *,
    lr: float,
    steps: int = 6,
    seed: int = 0,
    shards: int = 1,
    **model_kw,
) -> list[Path]:
    """Train and publish `steps` bf16 checkpoints under out_dir/step_{i:06d}/; returns their dirs.

    model_kw overrides ModelConfig fields (d_model, n_layers, n_experts, vocab, ...).
    """
    torch.set_num_threads(2)
    mc, tc = ModelConfig(**model_kw), TrainConfig(lr=lr, steps=steps, seed=seed)
    data = MarkovData(mc.vocab, seed)
    model, loss = warm_start(mc, tc, data)
    # RL starts from the pretrained weights with a fresh optimizer at the target learning rate.
    opt = adamw(model, tc.lr, tc)
    config = {"architectures": ["MoeForCausalLM"], **asdict(mc), "train": asdict(tc)}
    out, dirs, prev = Path(out_dir), [], None
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model {n_params / 1e6:.1f}M params, warm-start loss {loss:.3f}, lr {lr:g}", flush=True)
    for step in range(steps):
        if step:
            loss = train_step(model, opt, data, tc)
        state = bf16_state(model)
        dirs.append(out / f"step_{step:06d}")
        save_checkpoint(dirs[-1], state, {**config, "step": step}, shards)
        if prev is not None:
            s = change_stats(prev, state)
            print(
                f"step {step}: loss {loss:.4f} changed {s['changed']:.2%} "
                f"of changes: +-1 ulp {s['ulp1']:.1%}, +-2 ulp {s['ulp2']:.1%}",
                flush=True,
            )
        prev = state
    return dirs


def cached_trajectory(name: str, **kw) -> list[Path]:
    """make_trajectory(**kw) stored under benchmarks/.cache/<name>-<hash of kw>/, reused if complete."""
    dirs = cache_dirs(name, **kw)
    if is_complete(dirs):
        return dirs
    shutil.rmtree(dirs[0].parent, ignore_errors=True)
    return make_trajectory(dirs[0].parent, **kw)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lr", type=float, required=True)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shards", type=int, default=1)
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--out", type=Path, help="output folder")
    where.add_argument("--cache", metavar="NAME", help="build into benchmarks/.cache as NAME")
    args = ap.parse_args()
    t0 = time.perf_counter()
    kw = {"lr": args.lr, "steps": args.steps, "seed": args.seed, "shards": args.shards}
    if args.cache:
        cached_trajectory(args.cache, **kw)
    else:
        make_trajectory(args.out, **kw)
    print(f"done in {time.perf_counter() - t0:.1f}s")


if __name__ == "__main__":
    main()
