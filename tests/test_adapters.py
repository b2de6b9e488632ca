"""PEFT adapters through ``engine.save_pretrained`` (worker/adapters.py) on one process:
a PeftModel inside another module (as a LightningModule holds one) saves under PEFT's
names, trained values included, and loads back onto a fresh base model; what the save
cannot do is refused by name. Two ranks at stage 3 through the Trainer:
tests/test_hf_trainer.py."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from torch import nn

peft = pytest.importorskip("peft")
pytest.importorskip("transformers")

import worker  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("ex", ROOT / "examples" / "train_hf_trainer.py")
ex = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ex)


class Holder(nn.Module):
    """What a LightningModule is to its model: the PeftModel is an attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.model = ex.build_lora()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, labels=ids).loss


def trained_engine() -> worker.ZeroEngine:
    holder = Holder()
    params = [p for p in holder.parameters() if p.requires_grad]
    engine = worker.initialize(
        holder, torch.optim.AdamW(params, lr=1e-2), config=worker.ZeroConfig()
    )
    ids = torch.arange(32).reshape(2, 16) % 256
    for _ in range(2):
        engine.backward(engine(ids))
        engine.step()
    return engine


def test_a_peft_model_inside_a_module_saves_as_peft_and_loads_back(tmp_path: Path) -> None:
    engine = trained_engine()
    engine.save_pretrained(tmp_path / "a")
    assert (tmp_path / "a" / "adapter_config.json").is_file()
    assert not (tmp_path / "a" / "config.json").exists()
    loaded = peft.PeftModel.from_pretrained(ex.build(), tmp_path / "a")
    full = engine.full_state_dict()
    got = {f"model.{n}": p for n, p in loaded.named_parameters()}
    assert got.keys() == full.keys()
    assert max((got[n] - full[n]).abs().max().item() for n in full) == 0.0
    # trained, not as initialized: lora_B starts at zero
    assert any("lora_B" in n and full[n].abs().max() > 0 for n in full)
    engine.close()


def test_what_an_adapter_save_cannot_do_is_refused(tmp_path: Path) -> None:
    engine = trained_engine()
    with pytest.raises(ValueError, match=r"dtype=.*PEFT adapters"):
        engine.save_pretrained(tmp_path / "a", dtype=torch.bfloat16)
    engine.close()
    model = ex.build()
    plain = worker.initialize(
        model, torch.optim.SGD(model.parameters(), lr=0.1), config=worker.ZeroConfig()
    )
    with pytest.raises(ValueError, match="holds no PEFT model"):
        plain.save_pretrained(tmp_path / "b", merged=True)
    plain.close()
    two = nn.ModuleDict({"a": ex.build_lora(), "b": ex.build_lora()})
    with pytest.raises(ValueError, match="several PEFT models"):
        worker.adapters.find_peft(two)
