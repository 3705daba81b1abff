"""The in-process sink, given just a transformers v5 model loaded with ``from_pretrained``, follows a
store to every version bit for bit, in both modes: MoE families whose experts are fused in memory
(Qwen3-MoE, DeepSeek-V3 / Kimi-K2, Mixtral, gpt-oss) and dense models (Qwen3; Llama with tied
embeddings), trained with a real optimizer between versions, each version saved with
``save_pretrained`` and published as is. The reference for each version is what ``from_pretrained``
of its folder holds."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file  # noqa: E402
from tiny_models import config  # noqa: E402

import weightsync  # noqa: E402
from weightsync.codec.payload import CodecConfig  # noqa: E402
from weightsync.sync.publish import PublishConfig  # noqa: E402
from weightsync.torch.sink import TorchSink  # noqa: E402
from weightsync.torch.transformers import layout  # noqa: E402

DEVICE = torch.device(os.environ.get("WEIGHTSYNC_TEST_DEVICE", "cpu"))  # benchmarks/gpu.sh: cuda
FAMILIES = ["qwen3_moe", "deepseek_v3", "mixtral", "gpt_oss", "qwen3", "llama"]  # llama: tied embeddings
STEPS = 4


def train(family: str, root: Path, bf16_router: bool) -> list[Path]:
    """Version folders of a tiny model trained with AdamW (bf16 weights, a step per version)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config(family), dtype=torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dirs = []
    for v in range(STEPS):
        if v:
            ids = torch.randint(0, 64, (2, 12))
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
        d = root / f"step{v}"
        model.save_pretrained(d)
        if bf16_router:  # a trainer that saves everything in bf16 (the engine keeps the router in fp32)
            for f in d.glob("*.safetensors"):
                sd = load_file(f)
                save_file(
                    {k: t.bfloat16() if t.dtype == torch.float32 else t for k, t in sd.items()}, f, {"format": "pt"}
                )
        dirs.append(d)
    return dirs


def load(path: Path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()


def same_bits(a: torch.nn.Module, b: torch.nn.Module) -> list[str]:
    """Names whose bits differ between two models' state dicts."""
    sa, sb = ({k: t.cpu() for k, t in m.state_dict().items()} for m in (a, b))
    assert set(sa) == set(sb)
    return [k for k in sa if not torch.equal(sa[k].view(-1).view(torch.uint8), sb[k].view(-1).view(torch.uint8))]


@pytest.fixture(scope="module", params=FAMILIES)
def trained(request, tmp_path_factory):
    family = request.param
    root = tmp_path_factory.mktemp(family)
    dirs = train(family, root, bf16_router=family == "deepseek_v3")
    stores = {}
    for name, codec in (("ans", CodecConfig()), ("sparse", CodecConfig(entropy_coder=False))):
        stores[name] = str(root / f"store-{name}")
        for d in dirs:
            weightsync.publish(d, stores[name], config=PublishConfig(keyframe_interval=2, codec=codec))
    return family, dirs, stores


@pytest.mark.parametrize("mode", ["patch", "flip"])
@pytest.mark.parametrize("codec", ["ans", "sparse"])
def test_a_transformers_model_follows_the_store_bit_exact(trained, mode, codec):
    family, dirs, stores = trained
    model = load(dirs[0]).to(DEVICE)
    if family == "deepseek_v3":  # what the issue saw: fp32 in memory, bf16 in the store
        bias = next(t for n, t in model.state_dict().items() if n.endswith("e_score_correction_bias"))
        assert bias.dtype == torch.float32
    sink = TorchSink(stores[codec], model, 0, layout=layout(model), mode=mode)
    ids = torch.randint(0, 64, (1, 8))
    for v in (1, 2, 3, 1, 3):  # deltas, a keyframe crossed, a step back
        up = sink.update(v)
        ref = load(dirs[v])
        assert same_bits(model, ref) == [], f"stale after version {v}"
        assert up.changed_elements > 0
        if DEVICE.type == "cpu":  # (another device computes with other kernels)
            with torch.no_grad():
                assert torch.equal(model(input_ids=ids).logits, ref(input_ids=ids).logits)
    assert sink.verify() > 0


def test_the_trained_versions_change_the_fused_experts(trained):
    """The test above is not vacuous: the fused expert tensors move between versions."""
    family, dirs, _ = trained
    a, b = load(dirs[0]).state_dict(), load(dirs[1]).state_dict()
    moved = [k for k in a if not torch.equal(a[k], b[k])]
    assert moved
    if family not in ("qwen3", "llama"):
        assert any("experts" in k for k in moved)
