"""torch.compile at every stage, the ways scripts write it: the whole model compiled
before ``worker.initialize``, blocks compiled after it (torchtitan's recipe), and
``ZeroConfig(compile=True)``;
each against eager one-process torch (worker/factory.py [Note: compiling at stage 3])."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn

import worker
from tests.reference import max_diff
from worker.models import GPT, GPTConfig

CFG = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)
STEPS, ROWS = 4, 2


def batch(step: int, rank: int) -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (ROWS, CFG.block_size),
                         generator=torch.Generator().manual_seed(10 * step + rank))  # fmt: skip


def build(name: str) -> torch.nn.Module:
    """The built-in GPT, or a two-layer Hugging Face Llama (grouped-query attention)."""
    torch.manual_seed(0)
    if name == "gpt":
        return GPT(CFG)
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(
        LlamaConfig(vocab_size=CFG.vocab_size, hidden_size=16, intermediate_size=32,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    max_position_embeddings=CFG.block_size)
    )  # fmt: skip


def loss_of(model: torch.nn.Module, idx: torch.Tensor) -> torch.Tensor:
    if isinstance(model, GPT) or isinstance(getattr(model, "module", None), GPT):
        return model(idx, idx)
    return model(input_ids=idx, labels=idx).loss


def compiled_against_eager_torch(
    stage: int, how: str, name: str = "gpt", checkpointing: str = "none"
) -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    torch._dynamo.reset()  # the pool's processes are reused: compile afresh
    model, ref = build(name), build(name)
    # SGD with momentum: compiled kernels round differently from eager ones (about
    # 1e-7 here), which Adam's normalisation would blow up on near-zero gradients
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if how == "whole":
        model = torch.compile(model)
    # "config": the engine compiles it (ZeroConfig.compile, DeepSpeed's compile.deepcompile)
    config = worker.ZeroConfig(
        stage=stage, compile=how == "config", activation_checkpointing=checkpointing
    )
    engine = worker.initialize(model, opt, config=config)
    assert checkpointing == "none" or engine.checkpointed, "the policy chose no module"
    if how == "blocks":
        for block in engine.module.blocks:
            block.compile()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        idx = batch(step, rank)
        engine.backward(loss_of(engine, idx))
        engine.step()
        for r in range(world):
            idx = batch(step, r)
            (loss_of(ref, idx) / world).backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
    # it did compile, and not one break: at stage 3 a unit's gather and release run
    # outside its graph (worker/compile_report.py [Note: the compile report])
    report = engine.compile_report()
    assert report.graphs >= 1 and report.graph_breaks == 0, str(report)
    want = {n: p.detach() for n, p in ref.named_parameters(remove_duplicate=False)}
    diff, name = max_diff(engine.full_state_dict(), want)  # the model's own names
    assert diff < 1e-5, f"{name} differs from eager torch by {diff:.3g}"
    engine.close()


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("stage", "how", "name", "checkpointing"),
    [(1, "whole", "gpt", "none"), (3, "whole", "gpt", "none"), (3, "blocks", "gpt", "none"),
     (2, "config", "gpt", "none"), (3, "config", "llama", "none"),
     # every block recomputed in backward, its gather kept for the recomputation
     (3, "config", "gpt", "units")],
)  # fmt: skip
def test_compiled_training_equals_eager_torch(
    pools, stage: int, how: str, name: str, checkpointing: str
) -> None:
    pools(2).run(compiled_against_eager_torch, stage, how, name, checkpointing)


class Breaking(torch.nn.Module):
    """A block whose forward dynamo cannot trace whole: one graph break inside it."""

    def __init__(self, block: torch.nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch._dynamo.graph_break()
        return self.block(x)


def breaks_are_reported() -> tuple[str, list[str]]:
    import logging

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GPT(CFG)
    model.blocks = torch.nn.ModuleList(Breaking(b) for b in model.blocks)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    warned: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: warned.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("worker.compile_report").addHandler(handler)
    try:
        engine = worker.initialize(model, opt, config=worker.ZeroConfig(stage=3, compile=True))
        assert engine.compile_report().graph_breaks == 0  # nothing compiled yet
        for step in range(3):  # the first stage-3 forward runs eager
            idx = batch(step, dist.get_rank())
            engine.backward(engine(idx, idx))
            engine.step()
        report = engine.compile_report()
        engine.close()
    finally:
        logging.getLogger("worker.compile_report").removeHandler(handler)
    assert report.graph_breaks >= 1 and report.graphs >= 1, str(report)
    return str(report), warned


@pytest.mark.timeout(300)
def test_graph_breaks_are_counted_and_named(pools) -> None:
    """A break inside a unit: ``engine.compile_report()`` counts it with dynamo's reason,
    and the engine warns once per reason."""
    for report, warned in pools(2).run(breaks_are_reported):
        assert "graph_break" in report, report
        assert len(warned) == 1, warned
        assert "graph break" in warned[0] and "graph_break" in warned[0], warned


def compiled_under_tp(stage: int, kind: str = "gpt") -> tuple[dict[str, torch.Tensor], str, int]:
    from tests.test_mesh import STEPS as MESH_STEPS  # what its reference trains
    from tests.test_mesh import _mesh_engine, _train

    torch._dynamo.reset()
    # stage 3's hooks out of the graphs is dynamo's part: inductor's code generation for
    # four ranks on two cores adds nothing to it (the Llama case generates code)
    with _without_codegen() if stage == 3 else contextlib.nullcontext():
        engine = _mesh_engine(kind, stage, 2, 0.0, compile=True)
        _train(engine, kind, engine.shape.dp, engine.coords.dp, range(MESH_STEPS))
    report = engine.compile_report()
    return engine.full_state_dict(), str(report), report.graph_breaks


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("kind", "stage", "world"), [("gpt", 3, 4), ("llama", 2, 2)])
def test_compiled_under_tp_equals_eager_torch(pools, kind: str, stage: int, world: int) -> None:
    """Under tp = 2 (x dp = 2 for the GPT), compiled by the engine: at stage 3 the
    tensor-parallel views' hooks stay out of the graphs as the gathers do
    (worker/tp.py activate); an HF Llama (its vocabulary-parallel embedding
    included) compiles whole at stage 2; each trains equal to one eager torch
    process without a graph break."""
    from tests.test_mesh import _compare, reference

    for params, report, breaks in pools(world).run(compiled_under_tp, stage, kind):
        assert breaks == 0, report
        _compare(params, reference(kind, world // 2))


@contextlib.contextmanager
def _without_codegen() -> Iterator[None]:
    """``Module.compile`` (the engine's and a block's) with the ``aot_eager`` backend:
    dynamo captures the same graphs and breaks where it would for inductor, and
    AOTAutograd traces them, without inductor's C++ code generation (seconds a graph
    on this CPU). The tests of this file that compile with inductor cover that."""
    original = nn.Module.compile
    nn.Module.compile = lambda self, *a, **k: original(self, *a, **{"backend": "aot_eager", **k})
    try:
        yield
    finally:
        nn.Module.compile = original


def compiled_experts_and_sequence_shards() -> list[str]:
    """Expert parallelism (ep 2) compiled whole at stage 1 and block by block at stage
    3, and context parallelism (cp 2) compiled by the engine at stages 1 and 3, each
    against eager one-process torch, graphs by ``aot_eager``; returns the ep runs'
    break reasons."""
    with _without_codegen():
        return _compiled_experts_and_sequence_shards()


def _compiled_experts_and_sequence_shards() -> list[str]:
    from tests.reference import train_beside_torch
    from tests.test_context import train_llama_against_torch
    from tests.test_moe_ep import MoENet, skewed_batch
    from worker.parallel import ParallelConfig

    reasons: list[str] = []
    for stage, how in ((1, "whole"), (3, "blocks")):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = MoENet()
        torch.manual_seed(0)
        ref = MoENet()
        opt = lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)  # noqa: E731
        if how == "whole":
            model = torch.compile(model, backend="aot_eager")
        engine = worker.initialize(
            model, opt(model), parallel=ParallelConfig(expert_parallel=2),
            config=worker.ZeroConfig(stage=stage, bucket_numel=97, stage3_min_unit_numel=1),
        )  # fmt: skip
        if how == "blocks":
            for block in engine.module.blocks:
                block.compile()
        train_beside_torch(engine, ref, opt(ref), skewed_batch, steps=STEPS)
        report = engine.compile_report()
        assert report.graphs >= 1, str(report)
        reasons += list(report.reasons)
        want = {n: p.detach() for n, p in ref.named_parameters()}
        diff, name = max_diff(engine.full_state_dict(), want)
        assert diff < 1e-5, f"{name} differs from eager torch by {diff:.3g} ({stage}, {how})"
        engine.close()
    for kind, stage in (("ulysses", 1), ("ring", 3)):
        torch._dynamo.reset()
        train_llama_against_torch(2, kind, stage, False, compile=True)  # asserts parity
    return reasons


@pytest.mark.timeout(300)
def test_compiled_expert_and_context_parallel_training_equals_eager_torch(pools) -> None:
    """An experts layer's call breaks the graph on each side (its exchanges' sizes
    follow the routing), not inside: no other break (worker/moe/dispatch.py ``_Placed.call``)."""
    for reasons in pools(2).run(compiled_experts_and_sequence_shards):
        assert reasons, "the experts' call did not break the graph"
        for reason in reasons:
            assert "disable()`d function" in reason, reason
            assert "_exchange_and_run" in reason or "_pre_forward_hook" in reason, reason


def compiled_pipeline(stage: int, how: str) -> dict[str, torch.Tensor]:
    """The built-in GPT in two pipeline stages, compiled ``how``."""
    from tests.test_mesh import STEPS as MESH_STEPS
    from tests.test_mesh import _batch, _gpt, _opt
    from worker.parallel import ParallelConfig
    from worker.pipeline import lm_loss

    torch._dynamo.reset()
    model = _gpt(tie=False)
    opt = _opt(model)
    if how == "whole":
        model = torch.compile(model)
    engine = worker.initialize(
        model, opt, config=worker.ZeroConfig(stage=stage, bucket_numel=300),
        parallel=ParallelConfig(pipeline_parallel=2, microbatches=4), loss_fn=lm_loss,
    )  # fmt: skip
    if how == "blocks":  # a stage's blocks, by their names in the model
        for block in engine.module.blocks.values():
            block.compile()
    dp, d = engine.shape.dp, engine.coords.dp
    for step in range(MESH_STEPS):
        idx, tgt = _batch(step, 4 * dp)
        engine.train_batch([(idx[4 * d : 4 * (d + 1)], tgt[4 * d : 4 * (d + 1)])])
    report = engine.compile_report()
    assert report.graphs >= 1 and report.graph_breaks == 0, str(report)
    full = engine.full_state_dict()
    engine.close()
    return full


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("stage", "how"), [(2, "blocks")])
def test_a_compiled_pipeline_equals_eager_torch(pools, stage: int, how: str) -> None:
    from tests.test_mesh import reference_untied

    want = reference_untied(1)  # the whole global batch in one process, eager
    for got in pools(2).run(compiled_pipeline, stage, how):
        diff, name = max_diff(got, want)
        assert diff < 1e-5, f"{name} differs from eager torch by {diff:.3g}"
