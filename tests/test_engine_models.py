"""Models nobody on this project wrote, and the ways users run them: activation
checkpointing (reentrant or not), torch's own transformer layers at stage 3.
Every case is compared with single-process torch on the same global batch."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import worker
from tests.reference import VOCAB, ParityNet, max_diff

STEPS = 6
GLOBAL_BATCH = 4


class CheckpointedNet(ParityNet):
    """ParityNet with its blocks under torch's activation checkpoint."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant

    def forward(self, idx: torch.Tensor, targets: torch.Tensor, use_extra: bool) -> torch.Tensor:
        x = self.frozen(self.emb(idx))
        for block in self.blocks:
            x = x + checkpoint(block, x, use_reentrant=self.reentrant)
        x = x + self.twice(torch.tanh(self.twice(x)))
        if use_extra:
            x = x + self.extra(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class EncoderNet(nn.Module):
    """torch's own transformer layers (nn.MultiheadAttention inside)."""

    def __init__(self, d: int, heads: int, layers: int, decoder: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        if decoder:
            self.body: nn.Module = nn.Transformer(
                d, heads, layers, layers, dim_feedforward=2 * d, dropout=0.0, batch_first=True
            )
        else:
            layer = nn.TransformerEncoderLayer(
                d, heads, dim_feedforward=2 * d, dropout=0.0, batch_first=True
            )
            self.body = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, VOCAB)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor, use_extra: bool) -> torch.Tensor:
        x = self.emb(idx)
        x = self.body(x, x) if isinstance(self.body, nn.Transformer) else self.body(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    idx = torch.randint(0, VOCAB, (GLOBAL_BATCH, 6), generator=g)
    return idx, torch.roll(idx, 1, dims=1)


def train_against_torch(
    build: Callable[[], nn.Module], stage: int, config: dict, accum: int = 1
) -> float:
    """Train with zeroplane on this rank's slice and with torch on the whole batch."""
    world, rank = dist.get_world_size(), dist.get_rank()
    per = GLOBAL_BATCH // world
    torch.manual_seed(0)
    model = build()
    torch.manual_seed(0)
    ref = build()

    def opt(m: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(m.parameters(), lr=1e-2)

    engine = worker.initialize(
        model,
        opt(model),
        config=worker.ZeroConfig(stage=stage, gradient_accumulation_steps=accum, **config),
    )
    ref_opt = opt(ref)
    for step in range(STEPS):
        idx, tgt = global_batch(step)
        use_extra = step % 2 == 0
        for micro in range(accum):
            sl = slice(rank * per, (rank + 1) * per)
            if accum > 1:
                sl = slice(rank * per + micro, rank * per + micro + 1)
            engine.backward(engine(idx[sl], tgt[sl], use_extra))
            engine.step()
        ref_loss = 0.0
        for micro in range(accum):
            for r in range(world):
                sl = slice(r * per, (r + 1) * per)
                if accum > 1:
                    sl = slice(r * per + micro, r * per + micro + 1)
                loss = ref(idx[sl], tgt[sl], use_extra) / (world * accum)
                loss.backward()
                ref_loss += loss.item()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
    want = {n: p.detach() for n, p in ref.named_parameters(remove_duplicate=False)}
    diff, name = max_diff(engine.full_state_dict(), want)
    assert diff < 1e-5, f"{name} differs from torch by {diff:.3g}"
    return diff


@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_user_activation_checkpointing_trains_like_torch(
    pools, stage: int, reentrant: bool
) -> None:
    config = {"bucket_numel": 97, "stage3_min_unit_numel": 1}
    pools(2).run(train_against_torch, partial(CheckpointedNet, reentrant), stage, config)


@pytest.mark.parametrize("stage", [1, 2])
def test_reentrant_checkpointing_with_accumulation(pools, stage: int) -> None:
    config = {"bucket_numel": 97}
    pools(2).run(train_against_torch, partial(CheckpointedNet, True), stage, config, 2)


@pytest.mark.parametrize("min_unit_numel", [1, 2**20], ids=["every-module-a-unit", "default-units"])
def test_stage3_multihead_attention(pools, min_unit_numel: int) -> None:
    # d=1024: out_proj alone reaches the default unit size, and MultiheadAttention
    # reads its weight without calling it
    d = 1024 if min_unit_numel > 1 else 16
    config = {"stage3_min_unit_numel": min_unit_numel}
    pools(2).run(train_against_torch, partial(EncoderNet, d, 4, 1), 3, config)


def test_stage3_full_transformer_every_module_a_unit(pools) -> None:
    config = {"stage3_min_unit_numel": 1, "bucket_numel": 211}
    pools(2).run(train_against_torch, partial(EncoderNet, 16, 2, 1, decoder=True), 3, config)


@pytest.mark.parametrize("distance", [600, 10**9], ids=["some-units-kept", "all-units-kept"])
def test_stage3_units_kept_into_backward_train_like_torch(pools, distance: int) -> None:
    # [Note: units kept gathered into backward]: an encoder read again by the
    # decoder's cross-attention, so reuse distances are not in module order
    config = {"stage3_min_unit_numel": 1, "bucket_numel": 211}
    config["stage3_max_reuse_distance"] = distance
    pools(2).run(train_against_torch, partial(EncoderNet, 16, 2, 1, decoder=True), 3, config)
    # a branch used on every other step, and blocks recomputed in backward
    config = {"bucket_numel": 97, "stage3_min_unit_numel": 1}
    config["stage3_max_reuse_distance"] = distance
    pools(2).run(train_against_torch, partial(CheckpointedNet, False), 3, config)


# ---------------------------------------------------------------- activation checkpointing


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_activation_checkpointing_trains_like_torch(pools, stage: int) -> None:
    config = {
        "bucket_numel": 97,
        "stage3_min_unit_numel": 1,
        "activation_checkpointing": "units",
    }
    pools(2).run(train_against_torch, ParityNet, stage, config)


def gpt_run(stage: int, policy, min_unit: int = 2**20) -> tuple[worker.ZeroEngine, list[int]]:
    """A few steps of a small GPT; the most units gathered at once during each backward."""
    from worker.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=VOCAB, block_size=16, n_layer=6, n_head=2, n_embd=32))
    engine = worker.initialize(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        config=worker.ZeroConfig(
            stage=stage, activation_checkpointing=policy, stage3_min_unit_numel=min_unit
        ),
    )
    peaks: list[int] = []

    def count(p: torch.Tensor) -> None:
        gathered = sum(u.index != 0 and u.state.value != "sharded" for u in engine.units)
        peaks[-1] = max(peaks[-1], gathered)

    hooks = [p.register_post_accumulate_grad_hook(count) for p in model.parameters()]
    for step in range(4):
        idx, tgt = global_batch(step)
        peaks.append(0)
        engine.backward(engine(idx, tgt))
        engine.step()
    for h in hooks:
        h.remove()
    return engine, peaks


@pytest.mark.parametrize("stage", [0, 3])
def test_activation_checkpointing_saves_activations_and_changes_no_number(stage: int) -> None:
    plain, plain_peaks = gpt_run(stage, "none")
    ckpt, ckpt_peaks = gpt_run(stage, "units")
    assert len(ckpt.checkpointed) == 6  # the blocks
    saved, kept = ckpt.memory_report()["activations"], plain.memory_report()["activations"]
    assert 0 < saved < 0.5 * kept, (saved, kept)
    diff, name = max_diff(ckpt.full_state_dict(), plain.full_state_dict())
    assert diff < 1e-6, f"{name} differs by {diff:.3g} with checkpointing"
    if stage == 3:
        # recomputation gathers the unit again; the running unit and the prefetched
        # one stay the most gathered at once, as without checkpointing
        assert max(ckpt_peaks[1:]) <= max(plain_peaks[1:]) <= 2, (ckpt_peaks, plain_peaks)


def test_stage3_recomputation_of_a_block_made_of_units() -> None:
    # every linear its own unit: recomputing a block runs its units' forward hooks
    # in the middle of backward, which must not free what backward is about to read
    from worker.models import Block

    plain, _ = gpt_run(3, "none", min_unit=1)
    ckpt, _ = gpt_run(3, lambda m: isinstance(m, Block), min_unit=1)
    assert len(ckpt.checkpointed) == 6
    diff, name = max_diff(ckpt.full_state_dict(), plain.full_state_dict())
    assert diff < 1e-6, f"{name} differs by {diff:.3g} with checkpointing"


def test_activation_checkpointing_policies() -> None:
    from worker.activations import choose_modules
    from worker.models import GPT, GPTConfig

    model = GPT(GPTConfig(vocab_size=VOCAB, block_size=16, n_layer=4, n_head=2, n_embd=32))
    inventory = worker.engine.build_inventory_for(
        model, torch.optim.SGD(model.parameters()), worker.ZeroConfig()
    )
    blocks = list(model.blocks)
    assert choose_modules(model, inventory, "none") == []
    assert choose_modules(model, inventory, "units") == blocks  # the repeated blocks
    assert choose_modules(model, inventory, 1) == blocks
    assert choose_modules(model, inventory, 2) == blocks[1::2]
    linears = choose_modules(model, inventory, lambda m: isinstance(m, nn.Linear))
    assert linears and all(isinstance(m, nn.Linear) for m in linears)
    # the outermost of nested choices: checkpointing inside a checkpoint recomputes twice
    inner = next(m for m in blocks[0].modules() if isinstance(m, nn.Linear))
    assert choose_modules(model, inventory, lambda m: m in (blocks[0], inner)) == [blocks[0]]


# ---------------------------------------------------------------- Hugging Face models


class HFNet(nn.Module):
    """A Hugging Face model built from a tiny config (no download), dropout off,
    called as the other test models are."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        import transformers as tf

        v, d = VOCAB, 16
        if kind == "gpt2":
            cfg = tf.GPT2Config(
                vocab_size=v, n_positions=16, n_embd=d, n_layer=2, n_head=2,
                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
            )  # fmt: skip
            self.model = tf.GPT2LMHeadModel(cfg)
        elif kind == "llama":
            cfg = tf.LlamaConfig(
                vocab_size=v, hidden_size=d, intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16,
            )  # fmt: skip
            self.model = tf.LlamaForCausalLM(cfg)
        elif kind == "mixtral":
            cfg = tf.MixtralConfig(
                vocab_size=v, hidden_size=d, intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16,
                num_local_experts=4, num_experts_per_tok=2,
            )  # fmt: skip
            self.model = tf.MixtralForCausalLM(cfg)
        elif kind == "qwen2":  # eager attention: it checks the keys against its mask
            cfg = tf.Qwen2Config(
                vocab_size=v, hidden_size=d, intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16,
                attn_implementation="eager",
            )  # fmt: skip
            self.model = tf.Qwen2ForCausalLM(cfg)
        elif kind == "bert":
            cfg = tf.BertConfig(
                vocab_size=v, hidden_size=d, num_hidden_layers=2, num_attention_heads=2,
                intermediate_size=32, max_position_embeddings=16,
                hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
            )  # fmt: skip
            self.model = tf.BertForMaskedLM(cfg)
        elif kind == "t5":
            cfg = tf.T5Config(
                vocab_size=v, d_model=d, d_kv=8, d_ff=32, num_layers=2, num_heads=2,
                dropout_rate=0.0, decoder_start_token_id=0,
            )  # fmt: skip
            self.model = tf.T5ForConditionalGeneration(cfg)
        else:
            raise ValueError(kind)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor, use_extra: bool) -> torch.Tensor:
        return self.model(input_ids=idx, labels=targets).loss


@pytest.mark.parametrize("kind", ["gpt2", "llama", "mixtral", "bert", "t5"])
@pytest.mark.parametrize("stage", [2, 3])
def test_hugging_face_models_train_like_torch(pools, kind: str, stage: int) -> None:
    pytest.importorskip("transformers")
    config = {"bucket_numel": 211, "stage3_min_unit_numel": 1}
    pools(2).run(train_against_torch, partial(HFNet, kind), stage, config)


def test_a_decoder_that_caches_keys_trains_with_activation_checkpointing(pools) -> None:
    """[Note: no cache under recomputation]: a Qwen2 (use_cache in its config, eager
    attention) inside a module of the script's, its layers recomputed in backward:
    before, the recomputation appended its keys to the cache again and failed."""
    pytest.importorskip("transformers")
    config = {"activation_checkpointing": "units", "stage3_min_unit_numel": 1}
    pools(2).run(train_against_torch, partial(HFNet, "qwen2"), 3, config)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_hugging_face_gradient_checkpointing_reentrant(pools, kind: str) -> None:
    pytest.importorskip("transformers")
    pools(2).run(train_against_torch, partial(HFNetCheckpointed, kind), 3, {})


class HFNetCheckpointed(HFNet):
    """With the model's own (reentrant) gradient checkpointing, as HF users turn it on."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": True}
        )
        self.model.train()


def test_a_full_backward_hook_keeps_the_buckets_overlapping() -> None:
    """worker/grad_hooks.py [Note: graphs that grow during backward]: the identity a
    module's full backward hook puts in the graph runs no backward of its own, so
    the walk stays exact and each bucket is reduced as its gradients complete (the
    hook still sees its gradients), equal to torch."""
    import worker
    from tests.reference import OPTIMIZERS, VOCAB, seeded_model

    model, ref = seeded_model(), seeded_model()
    seen: list[str] = []
    for m in (model, ref):
        next(iter(m.children())).register_full_backward_hook(lambda *_: seen.append("hook"))
    config = worker.ZeroConfig(stage=2, bucket_numel=97)
    engine = worker.initialize(model, OPTIMIZERS["adamw"](model), config=config)
    ref_opt = OPTIMIZERS["adamw"](ref)
    idx = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    engine.backward(engine(idx, idx, True))
    assert engine._hooks.exact and seen == ["hook"]
    engine.step()
    ref(idx, idx, True).backward()
    ref_opt.step()
    want = {n: p.detach() for n, p in ref.named_parameters(remove_duplicate=False)}
    diff, name = max_diff(engine.full_state_dict(), want)
    assert diff < 1e-6, f"{name} differs from torch by {diff:.3g}"
