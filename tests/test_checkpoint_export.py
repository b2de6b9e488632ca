"""``zeroplane checkpoint export`` of a Hugging Face Llama trained at stage 3 on two
ranks: persistent state only (strict ``load_state_dict`` into a fresh model),
``--dtype``, files split as transformers splits them, read by ``from_pretrained``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import worker
from coordinator.cli import main as cli

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

CONFIG = dict(
    vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16,
    tie_word_embeddings=True,
)  # fmt: skip


def fresh_llama() -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))


def train_and_save(path: str) -> dict[str, torch.Tensor]:
    """One step at stage 3 on every rank, saved; the engine's full state dict."""
    model = fresh_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = worker.ZeroConfig(stage=3, bucket_numel=211, stage3_min_unit_numel=1)
    engine = worker.initialize(model, opt, config=config)
    ids = torch.randint(0, CONFIG["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(1))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    engine.save_checkpoint(path)
    return engine.full_state_dict()


@pytest.fixture(scope="module")
def trained(pools, tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    path = tmp_path_factory.mktemp("hf") / "ckpt"
    return path, pools(2).run(train_and_save, str(path))[0]


def export(ckpt: Path, out: Path, *flags: str) -> None:
    assert cli(["checkpoint", "export", str(ckpt), str(out), *flags]) == 0


def test_export_is_the_state_dict_of_a_fresh_model(trained, tmp_path) -> None:
    ckpt, want = trained
    assert "model.rotary_emb.inv_freq" in dict(fresh_llama().named_buffers())  # non-persistent
    export(ckpt, tmp_path / "model.safetensors")
    exported = safetensors_torch.load_file(tmp_path / "model.safetensors")
    model = fresh_llama()
    model.load_state_dict(exported, strict=True)
    state = model.state_dict()
    assert state.keys() == want.keys() == exported.keys()
    for name, value in want.items():
        assert torch.equal(state[name], value), name


def test_export_casts_floating_tensors_to_dtype(trained, tmp_path) -> None:
    ckpt, want = trained
    for flag, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp32", torch.float32)):
        out = tmp_path / f"{flag}.safetensors"
        export(ckpt, out, "--dtype", flag)
        exported = safetensors_torch.load_file(out)
        assert exported.keys() == want.keys()
        for name, value in want.items():
            assert exported[name].dtype == dtype, name
            assert torch.equal(exported[name], value.to(dtype)), name


def test_large_export_is_split_and_loads_with_from_pretrained(trained, tmp_path) -> None:
    ckpt, want = trained
    hf = tmp_path / "hf"
    hf.mkdir()
    transformers.LlamaConfig(**CONFIG).save_pretrained(hf)
    (hf / "model.safetensors").write_bytes(b"an earlier export, which would win")
    export(ckpt, hf / "model.safetensors", "--max-shard-size", "4KB")
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert not (hf / "model.safetensors").exists()
    for shard in shards:  # each file within the limit unless it holds one larger tensor
        tensors = safetensors_torch.load_file(hf / shard)
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        assert size <= 4000 or len(tensors) == 1, shard
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(hf)
    state = reloaded.state_dict()
    for name, value in want.items():
        assert torch.equal(state[name], value), name
