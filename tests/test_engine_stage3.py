"""Stage 3 gathers each unit just before use, frees it right after, and prefetches."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import worker
from worker.flat import GatherUnit
from worker.models import GPT, GPTConfig

CFG = GPTConfig(vocab_size=32, block_size=8, n_layer=4, n_head=2, n_embd=16)


def gathered(unit: GatherUnit) -> bool:
    """What the memory says, not the state flag: is the unit's storage allocated?"""
    return all(b.full.untyped_storage().nbytes() > 0 for b in unit.buckets)


def trace_gathers(prefetch: int, reuse_distance: int = 0, live_blocks: int | None = None) -> dict:
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    max_live = 10**9
    if live_blocks is not None:  # the root's elements and this many blocks' (64: padding)
        block = sum(p.numel() for p in model.blocks[0].parameters())
        root = sum(p.numel() for p in model.parameters()) - len(model.blocks) * block
        max_live = root + live_blocks * block + 64
    config = worker.ZeroConfig(
        stage=3,
        stage3_prefetch=prefetch,
        stage3_max_reuse_distance=reuse_distance,
        stage3_max_live_parameters=max_live,
    )
    engine = worker.initialize(model, opt, config=config)
    units = {u.module: u for u in engine.units}
    blocks = [units[b] for b in model.blocks]
    events: list[tuple] = []

    def snapshot(tag: str, k: int) -> None:
        live = sum(b.full.numel() for u in engine.units if gathered(u) for b in u.buckets)
        events.append((tag, k, tuple(gathered(u) for u in blocks), live))

    for k, block in enumerate(model.blocks):
        block.register_forward_pre_hook(lambda m, a, k=k: snapshot("pre", k))
        block.register_forward_hook(lambda m, a, o, k=k: snapshot("post", k))
        # runs after the engine's post-accumulate hook on the same parameter
        block.fc.weight.register_post_accumulate_grad_hook(lambda p, k=k: snapshot("grad", k))

    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(2):
        events.clear()
        idx = torch.randint(0, CFG.vocab_size, (2, CFG.block_size), generator=g)
        engine.backward(engine(idx, idx))
        engine.step()
    return {
        "events": events,
        "after": [gathered(u) for u in engine.units],
        "n_blocks": len(blocks),
        "max_live": max_live,
    }


@pytest.mark.parametrize("prefetch", [0, 1])
def test_units_gathered_just_in_time_and_freed(pools, prefetch: int) -> None:
    case = pools(2).run(trace_gathers, prefetch)[0]
    n = case["n_blocks"]
    forward = [(tag, k, g) for tag, k, g, _ in case["events"] if tag in ("pre", "post")]
    assert len(forward) == 2 * n
    for tag, k, state in forward:
        if tag == "pre":
            want = {k} | ({k + 1} if prefetch and k + 1 < n else set())
        elif k + 1 < n:
            want = {k + 1} if prefetch else set()
        else:
            want = {k}  # the last block's backward comes first: kept, not gathered again
        assert {i for i, s in enumerate(state) if s} == want, (tag, k, state)
    grads = [(k, g) for tag, k, g, _ in case["events"] if tag == "grad"]
    assert [k for k, _ in grads] == list(reversed(range(n)))
    for k, state in grads:
        # while block k's gradients arrive, at most k itself and the prefetched k-1
        held = {i for i, s in enumerate(state) if s}
        assert held <= {k, k - 1}, (k, state)
        assert k in held
        if prefetch and k > 0:
            assert k - 1 in held, "block k-1 was not prefetched during block k's backward"
    assert not any(case["after"]), "units still gathered after the step"


@pytest.mark.parametrize("live_blocks", [None, 1, 2])
def test_prefetch_stays_within_max_live_parameters(pools, live_blocks: int | None) -> None:
    # prefetching 3 units ahead: the cap (the root and this many blocks) stops it
    case = pools(2).run(trace_gathers, 3, 0, live_blocks)[0]
    n = case["n_blocks"]
    ahead = 4 if live_blocks is None else live_blocks
    for tag, k, state, live in case["events"]:
        if tag == "pre":  # forward: block k and what was prefetched with it
            assert {i for i, s in enumerate(state) if s} == set(range(k, min(k + ahead, n)))
            assert live <= case["max_live"], (k, live, case["max_live"])
    assert not any(case["after"]), "units still gathered after the step"


@pytest.mark.parametrize("kept", [2, 4], ids=["last-two-blocks", "every-block"])
def test_units_within_the_reuse_distance_stay_gathered_into_backward(pools, kept: int) -> None:
    # [Note: units kept gathered into backward]: a block's distance is the elements
    # of the blocks whose forward ends after its own (all blocks are the same size)
    block = sum(p.numel() for p in GPT(CFG).blocks[0].parameters())
    distance = block + 64 if kept == 2 else 10**9  # 64: more than a block's padding
    case = pools(2).run(trace_gathers, 0, distance)[0]
    n = case["n_blocks"]
    keep = set(range(n - kept, n))
    for tag, k, state, _ in case["events"]:
        held = {i for i, s in enumerate(state) if s}
        if tag == "pre":
            assert held == {i for i in keep if i < k} | {k}, (tag, k, state)
        elif tag == "post":
            assert held == {i for i in keep if i <= k}, (tag, k, state)
        else:  # block k's gradients: the kept blocks not reduced yet, and k
            assert held == {i for i in keep if i < k} | {k}, (tag, k, state)
    assert not any(case["after"]), "units still gathered after the step"


def reads_outside_forward() -> dict:
    torch.manual_seed(0)
    model = GPT(CFG)
    engine = worker.initialize(
        model, torch.optim.SGD(model.parameters(), lr=0.1), config=worker.ZeroConfig(stage=3)
    )
    g = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randint(0, CFG.vocab_size, (2, CFG.block_size), generator=g)
    engine.backward(engine(x, x))
    engine.step()
    p = model.blocks[1].fc.weight
    errors = {}
    for what, read in {
        "state_dict": lambda: model.state_dict()["blocks.1.fc.weight"].sum(),
        "sum": lambda: p.sum(),
        "save": lambda: torch.save(model.state_dict(), "/dev/null"),
        "clone": lambda: p.clone(),
        "data": lambda: p.data.sum(),
    }.items():
        try:
            read()
            errors[what] = None
        except RuntimeError as exc:
            errors[what] = str(exc)
    metadata = (tuple(p.shape), p.dtype, p.grad is None, "fc.weight" in repr(p), {p: 1}[p])
    with engine.gathered_params():
        inside = {k: v.clone() for k, v in model.state_dict().items()}
    full = engine.full_state_dict()
    same = all(torch.equal(inside[k], full[k]) for k in full)
    # freed again on exit, and training goes on
    again = False
    try:
        p.sum()
    except RuntimeError:
        again = True
    engine.backward(engine(x, x))
    stepped = engine.step()
    return {
        "errors": errors,
        "metadata": metadata,
        "same": same,
        "again": again,
        "stepped": stepped,
    }


def test_a_parameter_read_outside_forward_raises_never_crashes(pools) -> None:
    """Reading a stage-3 parameter between steps used to read freed memory (a
    segfault). It raises an error that names the parameter and the two ways to
    the values; `engine.gathered_params()` (FSDP's summon_full_params) gives them."""
    for case in pools(2).run(reads_outside_forward):
        for what, error in case["errors"].items():
            assert error is not None, f"{what} read a sharded parameter without an error"
            assert "engine.full_state_dict()" in error and "gathered_params" in error, error
        assert "'blocks.1.fc.weight'" in case["errors"]["sum"]
        assert case["metadata"] == ((4 * CFG.n_embd, CFG.n_embd), torch.float32, True, True, 1)
        assert case["same"], "gathered_params() differs from full_state_dict()"
        assert case["again"] and case["stepped"]
