"""A Hugging Face causal LM end to end: `zeroplane run --stage 3` with activation
checkpointing, a checkpoint exported with `zeroplane checkpoint export`, reloaded
with `from_pretrained`, all against the same model trained by plain torch."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_hf.py"
STEPS, GLOBAL_BATCH = 4, 8


def load_example():
    spec = importlib.util.spec_from_file_location("train_hf", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def reference() -> dict[str, torch.Tensor]:
    ex = load_example()
    from worker.data import GlobalBatchSampler
    from worker.demo import load_corpus

    data = load_corpus()
    sampler = GlobalBatchSampler(len(data) // ex.SEQ, GLOBAL_BATCH, seed=0)
    model = ex.build()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    for step in range(STEPS):
        ids = ex.samples(data, sampler.batch_at(step))
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def zeroplane(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "coordinator.cli", *args]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.timeout(300)
@pytest.mark.parametrize("own_checkpointing", [False, True], ids=["zeroplane-ac", "hf-reentrant"])
def test_hf_llama_stage3_trains_exports_and_reloads(tmp_path: Path, own_checkpointing) -> None:
    ckpt, hf_dir, out = tmp_path / "ckpt", tmp_path / "hf", tmp_path / "final.pt"
    script = [str(EXAMPLE), "--steps", str(STEPS), "--global-batch", str(GLOBAL_BATCH)]
    script += ["--checkpoint", str(ckpt), "--save-every", str(STEPS), "--hf-dir", str(hf_dir)]
    script += ["--out", str(out)] + (["--hf-checkpointing"] if own_checkpointing else [])
    zeroplane("run", "--nproc", "2", "--stage", "3", *script)

    want = reference()
    got = torch.load(out, weights_only=True)
    worst = max(want, key=lambda n: (got[n] - want[n]).abs().max().item())
    assert (got[worst] - want[worst]).abs().max().item() < 1e-5, worst

    zeroplane("checkpoint", "export", str(ckpt), str(hf_dir / "model.safetensors"))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(hf_dir)
    for name, value in reloaded.state_dict().items():
        assert torch.equal(value, got[name]), name
    assert set(want) <= set(reloaded.state_dict())
