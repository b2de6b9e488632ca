"""The tiled loss and MLP and activations in host memory (worker/tiling.py [Note:
tiles]): a transformers Llama trains with them as one process with torch alone does
(within 1e-5, fp32), on 2 ranks at ZeRO-3 and with context parallelism, and the
activations the engine measures fall by the logits and the MLP intermediates they
no longer keep."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import worker
from tests.reference import max_diff
from tests.test_context import batch, llama
from worker.parallel import ParallelConfig

STEPS = 3


def train_tiled_against_torch(cp: int, **options) -> None:
    model, ref = llama(), llama()
    config = worker.ZeroConfig(**{"stage": 3, "stage3_min_unit_numel": 1, **options})
    parallel = ParallelConfig(context_parallel=cp, context_parallel_kind="ring")
    engine = worker.initialize(
        model, torch.optim.AdamW(model.parameters(), lr=1e-3), config=config, parallel=parallel
    )
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    group, groups = engine.data_rank
    for step in range(STEPS):
        out = engine(**batch(step, group, True))
        assert out.logits is None or not options.get("tiled_loss")
        engine.backward(out.loss)
        engine.step()
        every = [batch(step, g, True) for g in range(groups)]
        whole = {k: torch.cat([b[k] for b in every]) for k in every[0]}
        loss = ref(**whole).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        assert abs(engine.mean_loss() - loss.item()) < 1e-5
    diff, name = max_diff(engine.full_state_dict(), dict(ref.named_parameters()))
    assert diff < 1e-5, (
        f"{name} differs from torch by {diff:.3g} ({options}, rank {dist.get_rank()})"
    )
    engine.close()


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("cp", "options"),
    [
        # the default units: the model's own parameters (its norm) gathered by its call
        (1, {"tiled_loss": 5, "tiled_mlp": 3, "stage3_min_unit_numel": 100_000}),
        (2, {"tiled_loss": 7, "tiled_mlp": 4, "activation_checkpointing": "units"}),
        (2, {"tiled_loss": 8, "offload_activations": True, "activation_checkpointing": "units"}),
    ],
    ids=["zero3", "cp2-checkpointed", "cp2-offloaded"],
)
def test_tiles_train_like_torch(pools, cp: int, options: dict) -> None:
    pools(2).run(train_tiled_against_torch, cp, **options)


def _activations(**options) -> int:
    """Bytes autograd keeps after one forward of a one-rank engine on a long-ish batch."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=512, hidden_size=32, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    engine = worker.initialize(
        model, torch.optim.SGD(model.parameters(), lr=0.1), config=worker.ZeroConfig(**options)
    )
    ids = torch.randint(0, 512, (2, 128))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    kept = engine.memory_report()["activations"]
    engine.close()
    return kept


def test_the_tiles_keep_neither_the_logits_nor_the_mlp_intermediates() -> None:
    tokens, vocab, inner, layers = 2 * 128, 512, 128, 2
    plain = _activations()
    tiled_loss = _activations(tiled_loss=32)
    # the log-softmax of the fp32 logits is kept for the whole batch no more (a tile's
    # few scalars are kept instead)
    assert plain - tiled_loss >= 0.99 * tokens * vocab * 4
    tiled_mlp = _activations(tiled_mlp=16)
    # each MLP kept its gate, up and activated intermediates for every token
    assert plain - tiled_mlp >= 2 * layers * tokens * inner * 4


def test_tiled_loss_refuses_a_model_that_is_not_a_causal_lm() -> None:
    model = torch.nn.Linear(4, 4)
    engine = worker.initialize(
        model, torch.optim.SGD(model.parameters(), lr=0.1), config=worker.ZeroConfig(tiled_loss=8)
    )
    with pytest.raises(ValueError, match="tiled_loss needs a transformers causal LM"):
        engine(labels=torch.zeros(1))
    engine.close()
    with pytest.raises(ValueError, match="tiled_mlp"):
        worker.ZeroConfig(tiled_mlp=-1)
