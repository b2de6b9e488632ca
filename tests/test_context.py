"""Context parallelism (worker/context/parallel.py [Note: context parallelism]): each
sequence split over the ranks of a cp group, attention by all-to-all or round a ring,
the ZeRO state over dp x cp. Every case trains against one process with torch alone
on the whole global batch (its loss the mean over every token), within 1e-5 in fp32:
a transformers Llama (grouped-query attention) as it comes and a model of its own
calling ``worker.context.attention``, causal and with packed documents."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import worker
from tests.reference import max_diff
from worker.context.shards import documents, shard_index
from worker.moe.experts import is_experts
from worker.parallel import ParallelConfig

VOCAB, SEQ, ROWS, STEPS = 64, 16, 2, 3


def llama(heads: int = 4, kv_heads: int = 2, family: str = "llama"):
    """A small transformers decoder: Llama, Mistral (a sliding window of 5 tokens, so
    that it matters on 16), Qwen2 (biased q/k/v projections) or Mixtral (4 experts)."""
    import transformers

    config_class, model_class = {
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[family]
    extra = {
        "mistral": {"sliding_window": 5},
        "mixtral": {"sliding_window": None, "num_local_experts": 4, "num_experts_per_tok": 2},
    }.get(family, {})
    config = config_class(
        vocab_size=VOCAB, hidden_size=24 if heads == 6 else 32, intermediate_size=48,
        num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=64, tie_word_embeddings=False, attn_implementation="sdpa",
        use_cache=False,  # (with a cache, transformers lets packed documents attend across)
        **extra,
    )  # fmt: skip
    torch.manual_seed(0)
    return model_class(config)


def batch(step: int, group: int, packed: bool) -> dict[str, torch.Tensor]:
    """A data-parallel group's batch: token ids, labels (some ignored) and, packed,
    position ids restarting at each document."""
    g = torch.Generator().manual_seed(100 * step + group)
    ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
    labels = ids.clone()
    labels[:, :2] = -100
    out = {"input_ids": ids, "labels": labels}
    if packed:  # documents of 5, 7 and 4 tokens in row 0, 9 and 7 in row 1
        row0 = torch.cat([torch.arange(5), torch.arange(7), torch.arange(4)])
        row1 = torch.cat([torch.arange(9), torch.arange(7)])
        out["position_ids"] = torch.stack([row0, row1])
    return out


def train_llama_against_torch(
    cp: int,
    kind: str,
    stage: int,
    packed: bool,
    heads: int = 4,
    kv_heads: int = 2,
    family: str = "llama",
    tp: int = 1,
    ep: int = 1,
    **options,
) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    model, ref = llama(heads, kv_heads, family), llama(heads, kv_heads, family)
    config = worker.ZeroConfig(stage=stage, bucket_numel=199, stage3_min_unit_numel=1, **options)
    parallel = ParallelConfig(
        context_parallel=cp, context_parallel_kind=kind, tensor_parallel=tp, expert_parallel=ep
    )
    # eps=1e-6, as tests/test_mesh.py says why: a parameter whose true gradient is zero
    # is stepped by +-lr on rounding noise with the default 1e-8, in every order alike
    engine = worker.initialize(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6),
        config=config,
        parallel=parallel,
    )
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-6)
    if ep > 1:  # this rank's share of each layer's experts
        assert {m.num_experts for m in model.modules() if is_experts(m)} == {4 // ep}
    group, groups = engine.data_rank
    assert (group, groups) == (rank // tp // cp, world // tp // cp)
    for step in range(STEPS):
        out = engine(**batch(step, group, packed))
        engine.backward(out.loss)
        engine.step()
        every = [batch(step, g, packed) for g in range(groups)]
        whole = {k: torch.cat([b[k] for b in every]) for k in every[0]}
        loss = ref(**whole).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        # the job's loss is the mean over every token of the global batch
        assert abs(engine.mean_loss() - loss.item()) < 1e-5, (engine.mean_loss(), loss.item())
    want = {n: p.detach() for n, p in ref.named_parameters()}
    got = engine.full_state_dict()
    diff, name = max_diff(got, want)
    assert diff < 1e-5, f"{name} differs from torch by {diff:.3g} (cp={cp}, {kind})"
    engine.close()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["ulysses", "ring"])
@pytest.mark.parametrize("packed", [False, True], ids=["causal", "packed"])
def test_a_llama_split_by_sequence_over_two_ranks_trains_like_torch(pools, kind, packed):
    pools(2).run(train_llama_against_torch, 2, kind, 3, packed)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("cp", "kind", "stage", "packed"),
    [(4, "ulysses", 3, True), (4, "ring", 3, False), (2, "ring", 2, True), (2, "ulysses", 1, True)],
)
def test_context_parallel_over_four_ranks_trains_like_torch(pools, cp, kind, stage, packed):
    # cp=2 on 4 ranks: two data-parallel groups, each splitting its own batch
    pools(4).run(train_llama_against_torch, cp, kind, stage, packed)


@pytest.mark.timeout(240)
def test_ring_takes_heads_that_do_not_divide_and_composes_with_checkpointing(pools):
    # 6 query heads, 2 kv heads, cp=4: all-to-all would refuse; the ring does not care
    pools(4).run(
        train_llama_against_torch, 4, "ring", 3, True, 6, 2, activation_checkpointing="units"
    )


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("family", "kind"), [("mistral", "ring"), ("mistral", "ulysses"), ("qwen2", "ring")]
)
def test_other_decoders_train_like_torch(pools, family: str, kind: str) -> None:
    # Mistral's sliding window (5 of 16 tokens) in both kinds; Qwen2's biased projections
    pools(2).run(train_llama_against_torch, 2, kind, 3, True, 4, 2, family)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("kind", "stage"), [("ulysses", 1), ("ring", 3)])
def test_context_parallel_with_tensor_parallel_trains_like_torch(pools, kind, stage) -> None:
    # tp=2 x cp=2 on 4 ranks: each tp rank holds 2 of the 4 query heads (1 of 2 kv heads)
    pools(4).run(train_llama_against_torch, 2, kind, stage, True, 4, 2, "llama", 2)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("cp", "ep", "tp", "kind"), [(2, 4, 1, "ulysses"), (2, 2, 2, "ring")])
def test_context_parallel_with_expert_parallel_trains_like_torch(pools, cp, ep, tp, kind) -> None:
    # a Mixtral on 4 ranks: cp=2 with ep=4 (a rank's shard of the sequence reaches the
    # experts of all four), and tp=2 x cp=2 x ep=2 (the cp group of the two dp ranks at
    # each tp position is their ep group too; the experts whole on both tp ranks)
    pools(4).run(train_llama_against_torch, cp, kind, 3, True, 4, 2, "mixtral", tp, ep)


# ---------------------------------------------------------------- a model of its own

D, H = 16, 4


class Attn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)
        self.out = nn.Linear(D, D)

    def forward(self, x: torch.Tensor, attend) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, H, D // H).permute(2, 0, 3, 1, 4)
        return self.out(attend(q, k, v).transpose(1, 2).reshape(b, s, D))


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.pos = nn.Embedding(SEQ, D)
        self.attn = nn.ModuleList(Attn() for _ in range(2))
        self.head = nn.Linear(D, VOCAB)

    def forward(self, idx, pos, targets, attend) -> torch.Tensor:
        x = self.emb(idx) + self.pos(pos)
        for a in self.attn:
            x = x + a(x, attend)
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def one_process_attention(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def train_own_model_against_torch(kind: str, cp: int) -> None:
    torch.manual_seed(0)
    model = Tiny()
    torch.manual_seed(0)
    ref = Tiny()
    engine = worker.initialize(
        model,
        torch.optim.SGD(model.parameters(), lr=0.5),
        config=worker.ZeroConfig(stage=3, stage3_min_unit_numel=1),
        parallel=ParallelConfig(context_parallel=cp, context_parallel_kind=kind),
    )
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)
        x = torch.randint(0, VOCAB, (ROWS, SEQ + 1), generator=g)
        pos = torch.arange(SEQ).expand(ROWS, SEQ)
        idx, targets, local_pos = engine.context.split(x[:, :-1], x[:, 1:], position_ids=pos)
        engine.backward(engine(idx, local_pos, targets, worker.context.attention))
        engine.step()
        ref(x[:, :-1], pos, x[:, 1:], one_process_attention).backward()
        opt.step()
        opt.zero_grad()
    diff, name = max_diff(engine.full_state_dict(), dict(ref.named_parameters()))
    assert diff < 1e-5, f"{name} differs from torch by {diff:.3g} ({kind})"
    engine.close()


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("kind", "cp"), [("ulysses", 2), ("ring", 4)])
def test_a_model_of_its_own_calls_the_attention(pools, kind, cp):
    pools(cp).run(train_own_model_against_torch, kind, cp)


# ---------------------------------------------------------------- pure


def test_zig_zag_shards_give_every_rank_one_early_and_one_late_chunk() -> None:
    assert shard_index(8, 0, 2, "ring").tolist() == [0, 1, 6, 7]
    assert shard_index(8, 1, 2, "ring").tolist() == [2, 3, 4, 5]
    assert shard_index(8, 1, 2, "ulysses").tolist() == [4, 5, 6, 7]
    together = torch.cat([shard_index(24, r, 3, "ring") for r in range(3)])
    assert sorted(together.tolist()) == list(range(24))
    with pytest.raises(ValueError, match="divisible by 4"):
        shard_index(10, 0, 2, "ring")


def test_documents_follow_transformers_packing_rule() -> None:
    pos = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]])
    assert documents(pos).tolist() == [[0, 0, 0, 1, 1, 2], [0, 0, 0, 0, 0, 0]]
    assert documents(torch.arange(6).expand(2, 6)) is None


def test_bad_context_parallel_configs_are_refused() -> None:
    with pytest.raises(ValueError, match="context_parallel_kind"):
        ParallelConfig(context_parallel=2, context_parallel_kind="zigzag")
    with pytest.raises(ValueError, match="context_parallel must be an integer"):
        ParallelConfig(context_parallel=0)
    from worker.parallel import check_combination

    with pytest.raises(ValueError, match="context_parallel=2 runs with data, tensor and expert"):
        check_combination(
            worker.ZeroConfig(), ParallelConfig(context_parallel=2, pipeline_parallel=2)
        )


# ---------------------------------------------------------------- checkpoints


def resume_at_another_cp(directory: str) -> None:
    """Two steps at cp=2 (two data-parallel groups), saved; then the same job at cp=4
    and without cp loads it and trains a third: each equal to torch's three steps."""
    # the third step's global batch: four rows, each with as many labelled tokens (so
    # that without cp, where each rank takes one row, the mean of means is the mean)
    third = {
        k: torch.cat([batch(2, 0, True)[k], batch(2, 1, True)[k]])
        for k in ("input_ids", "labels", "position_ids")
    }
    ref = llama()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    for step in range(3):
        every = [batch(step, g, True) for g in range(2)]
        whole = third if step == 2 else {k: torch.cat([b[k] for b in every]) for k in every[0]}
        ref(**whole).loss.backward()
        opt.step()
        opt.zero_grad()
    want = {n: p.detach() for n, p in ref.named_parameters()}

    def engine_at(cp: int):
        model = llama()
        parallel = ParallelConfig(context_parallel=cp, context_parallel_kind="ring")
        return worker.initialize(
            model,
            torch.optim.AdamW(model.parameters(), lr=1e-3),
            config=worker.ZeroConfig(stage=3, stage3_min_unit_numel=1),
            parallel=parallel if cp > 1 else None,
        )

    first = engine_at(2)
    for step in range(2):
        first.backward(first(**batch(step, first.data_rank[0], True)).loss)
        first.step()
    first.save_checkpoint(directory)
    first.close()
    for cp in (4, 1):
        engine = engine_at(cp)
        engine.load_checkpoint(directory)
        assert engine.global_steps == 2
        group, groups = engine.data_rank
        rows = slice(group * 4 // groups, (group + 1) * 4 // groups)
        engine.backward(engine(**{k: v[rows] for k, v in third.items()}).loss)
        engine.step()
        diff, name = max_diff(engine.full_state_dict(), want)
        assert diff < 1e-5, f"{name} differs from torch by {diff:.3g} after resuming at cp={cp}"
        engine.close()


@pytest.mark.timeout(300)
def test_a_checkpoint_resumes_at_another_cp(pools, tmp_path) -> None:
    pools(4).run(resume_at_another_cp, str(tmp_path / "ckpt"))
