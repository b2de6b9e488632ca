"""worker.data: step-addressed loading across world sizes, prefetch, checkpoints, packing."""

from __future__ import annotations

import collections
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import worker
from tests.reference import OPTIMIZERS, VOCAB, seeded_model
from worker.checkpoint import CheckpointError
from worker.data import (
    LoaderConfig,
    PackedTokens,
    StepLoader,
    StreamLoader,
    Tokenizer,
    byte_tokenizer,
    micro_batch_counts,
    pack_documents,
    pack_text_files,
    split_global_batch,
)

N, GLOBAL = 50, 12  # 4 steps an epoch, 2 samples left out of each


@settings(max_examples=400, deadline=None)
@given(
    batch=st.integers(1, 40),
    world=st.integers(1, 9),
    micro=st.one_of(st.none(), st.integers(1, 8)),
)
def test_any_world_size_takes_every_sample_once(batch: int, world: int, micro) -> None:
    """worker/data/sampler.py [Note: uneven shares]: the same number of micro-batches
    on every rank, none over ``micro``, the real ones the batch in order, once each;
    weights N·count/B that sum to N, and 1/accumulation when the world divides."""
    samples = list(range(100, 100 + batch))
    counts = [micro_batch_counts(batch, r, world, micro) for r in range(world)]
    splits = [split_global_batch(samples, r, world, micro) for r in range(world)]
    assert len({len(c) for c in counts}) == 1
    taken = []
    for c, s in zip(counts, splits, strict=True):
        assert len(c) == len(s)
        for n, m in zip(c, s, strict=True):
            assert (len(m) == n or (n == 0 and len(m) == 1)) and len(m) <= (micro or batch)
            taken += m if n else []
    assert taken == samples
    shares = [sum(c) for c in counts]
    assert max(shares) - min(shares) <= 1
    if batch % world == 0 and micro is not None and (batch // world) % micro == 0:
        assert all(n == micro for c in counts for n in c)


class Items:
    """Item i is the tensor [i]: what a rank received names the sample it read."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i])


def received(loader, step: int, world: int) -> list[int]:
    """The samples every rank of ``world`` received at ``step``, in rank order."""
    return [
        int(i)
        for rank in range(world)
        for micro in loader.batches(step, rank, world)
        for i in micro.flatten()
    ]


def whole_run(steps: int, seed: int = 0) -> list[list[int]]:
    """Brute force: an uninterrupted single-rank run taking global batches in order,
    each epoch a torch.randperm drawn from (seed, epoch) with its tail left out."""
    batches, per_epoch = [], N // GLOBAL
    for epoch in range(steps // per_epoch + 1):
        g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        order = torch.randperm(N, generator=g).tolist()
        batches += [order[k * GLOBAL : (k + 1) * GLOBAL] for k in range(per_epoch)]
    return batches[:steps]


@pytest.mark.parametrize("workers", ["sync", "thread"])
def test_each_sample_once_per_epoch_while_the_world_changes(workers: str) -> None:
    # 1 rank for 2 steps, 3 ranks across the epoch boundary, then 2 ranks
    worlds = [1, 1, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2]
    config = LoaderConfig(
        global_batch=GLOBAL,
        micro_batch=2,
        seed=5,
        num_workers=0 if workers == "sync" else 2,
        prefetch=0 if workers == "sync" else 3,
    )
    with StepLoader(Items(N), config) as loader:
        got = [received(loader, step, world) for step, world in enumerate(worlds)]
    assert got == whole_run(len(worlds), seed=5)
    per_epoch = N // GLOBAL
    for epoch in range(len(worlds) // per_epoch):
        seen = collections.Counter(
            i for b in got[epoch * per_epoch : (epoch + 1) * per_epoch] for i in b
        )
        assert max(seen.values()) == 1 and len(seen) == per_epoch * GLOBAL


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", ["thread", "process"])
def test_prefetched_batches_equal_synchronous_ones(workers: str) -> None:
    data = PackedTokens(torch.arange(400), 7)
    sync = StepLoader(data, LoaderConfig(global_batch=6, num_workers=0, prefetch=0))
    ahead = StepLoader(
        data,
        LoaderConfig(global_batch=6, micro_batch=1, num_workers=1, prefetch=3, workers=workers),
    )
    # rank 1 of 2 for steps 0-6, a rollback to 4, then rank 0 of 3
    requests = [(s, 1, 2) for s in range(7)] + [(s, 0, 3) for s in range(4, 10)]
    with sync, ahead:
        for step, rank, world in requests:
            want = sync.batches(step, rank, world)[0]
            micro = ahead.batches(step, rank, world)
            assert len(micro) == 6 // world
            assert torch.equal(torch.cat([x for x, _ in micro]), want[0])
            assert torch.equal(torch.cat([y for _, y in micro]), want[1])
    # every step but the first of each run was already being prepared
    assert ahead.stats.prefetched == len(requests) - 2 and ahead.stats.missed == 2


def test_bad_configs_name_the_field() -> None:
    with pytest.raises(ValueError, match=r"LoaderConfig\.global_batch"):
        LoaderConfig(global_batch=0)
    with pytest.raises(ValueError, match=r"LoaderConfig\.prefetch"):
        LoaderConfig(global_batch=4, num_workers=0, prefetch=2)
    with pytest.raises(ValueError, match=r"LoaderConfig\.workers"):
        LoaderConfig(global_batch=4, workers="fork")
    sync = LoaderConfig(global_batch=GLOBAL, num_workers=0, prefetch=0)
    with StepLoader(Items(N), sync) as loader, pytest.raises(ValueError, match=r"\[0, 5\)"):
        loader.batches(0, 5, 5)
    with pytest.raises(TypeError, match="map-style"):
        StepLoader(iter(range(3)), LoaderConfig(global_batch=2))
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"pin_memory=True needs CUDA"):
            StepLoader(Items(N), LoaderConfig(global_batch=GLOBAL, pin_memory=True))


# -- checkpoints --------------------------------------------------------------------


def token_data(seed: int = 0) -> PackedTokens:
    g = torch.Generator().manual_seed(seed)
    return PackedTokens(torch.randint(0, VOCAB, (40 * 5 + 1,), generator=g), 5)


def engine_with_loader(seed: int = 0) -> tuple[worker.ZeroEngine, StepLoader]:
    model = seeded_model()
    engine = worker.initialize(model, OPTIMIZERS["adamw"](model))
    loader = StepLoader(token_data(), LoaderConfig(global_batch=4, seed=seed, num_workers=1))
    return engine, loader.attach(engine)


def test_checkpoint_resumes_at_the_same_next_batch(tmp_path: Path) -> None:
    engine, loader = engine_with_loader()
    for _ in range(3):
        ((x, y),) = loader.current()
        engine.backward(engine(x, y, False))
        engine.step()
    engine.save_checkpoint(tmp_path)
    assert loader.state_dict()["step"] == 3
    ((want_x, want_y),) = loader.current()
    loader.close()

    fresh, resumed = engine_with_loader()
    fresh.load_checkpoint(tmp_path)
    assert fresh.global_steps == 3 and resumed.position == 3
    ((x, y),) = resumed.current()
    assert torch.equal(x, want_x) and torch.equal(y, want_y)
    resumed.close()

    # a loader whose order differs is refused, and nothing is loaded
    other, other_loader = engine_with_loader(seed=1)
    with pytest.raises(CheckpointError, match=r"'data' state does not fit: .*seed=0.*seed=1"):
        other.load_checkpoint(tmp_path)
    assert other.global_steps == 0
    other_loader.close()


def test_checkpoint_without_loader_state_still_loads(tmp_path: Path) -> None:
    model = seeded_model()
    worker.initialize(model, OPTIMIZERS["adamw"](model)).save_checkpoint(tmp_path)
    engine, loader = engine_with_loader()
    engine.load_checkpoint(tmp_path)  # written before the engine saved extras
    assert loader.position == 0
    loader.close()


# -- streams ------------------------------------------------------------------------


def stream_received(loader: StreamLoader, steps, world: int) -> list[list[int]]:
    return [received(loader, step, world) for step in steps]


def test_stream_resumes_without_rereading() -> None:
    datasets = pytest.importorskip("datasets")

    def source():
        rows = {"x": list(range(N))}
        return datasets.Dataset.from_dict(rows).to_iterable_dataset(num_shards=5)

    def collate(items):
        return torch.tensor([it["x"] for it in items])

    config = LoaderConfig(global_batch=GLOBAL, num_workers=1, prefetch=2)
    # brute force: each epoch read straight through (datasets orders the shards by
    # epoch), cut into global batches, the tail of each left out
    want = []
    for epoch in range(2):
        ds = source()
        ds.set_epoch(epoch)
        xs = [row["x"] for row in ds]
        want += [xs[k * GLOBAL : (k + 1) * GLOBAL] for k in range(N // GLOBAL)]
    with StreamLoader(source, config, collate=collate) as a:
        got = stream_received(a, range(3), 1) + stream_received(a, range(3, 5), 3)
        state = a.state_dict()  # at step 5
        # a rollback to step 3 at another world size reads from the recorded position
        got_again = stream_received(a, range(3, 6), 2)
        assert a.reread == 0
    assert got == want[:5] and got_again == want[3:6]
    assert state["step"] == 5 and state["stream"] is not None

    with StreamLoader(source, config, collate=collate) as b:
        b.load_state_dict(state)
        assert stream_received(b, range(5, 8), 2) == want[5:8]
        assert b.reread == 0

    with pytest.raises(TypeError, match="pass a function that creates the stream"):
        StreamLoader(source(), config)
    # a source without a position resumes by reading from the start and skipping
    with StreamLoader(list(range(N)), config) as c:
        c.load_state_dict(state | {"stream": None})
        assert stream_received(c, [5], 1) == [list(range(GLOBAL, 2 * GLOBAL))]  # epoch 1
        assert c.reread == 5 * GLOBAL


def test_hf_map_style_dataset_is_a_source() -> None:
    datasets = pytest.importorskip("datasets")
    hf = datasets.Dataset.from_dict({"x": list(range(N))}).with_format("torch")
    config = LoaderConfig(global_batch=GLOBAL, num_workers=1, seed=2)
    with StepLoader(hf, config, collate=lambda rows: torch.stack([r["x"] for r in rows])) as ld:
        got = [received(ld, step, 2) for step in range(4)]
    assert got == whole_run(4, seed=2)


# -- packing --------------------------------------------------------------------------


def counting(tokenizer: Tokenizer, calls: list[int]) -> Tokenizer:
    def encode(texts: list[str]) -> list[list[int]]:
        calls.append(len(texts))
        return tokenizer.encode_batch(texts)

    return Tokenizer(
        encode_batch=encode,
        identity=tokenizer.identity,
        vocab_size=tokenizer.vocab_size,
        eos_id=tokenizer.eos_id,
    )


def test_pack_has_no_padding_and_a_cache_hit_does_not_tokenize(tmp_path: Path) -> None:
    texts = ["the first file\nof two lines\n", "a second one", "and a third, é included\n"]
    files = []
    for i, text in enumerate(texts):
        files.append(tmp_path / f"doc{i}.txt")
        files[-1].write_text(text, encoding="utf-8")
    # reference: the documents' bytes end to end, token 0 (never in the text) between them
    stream = [*texts[0].encode(), 0, *texts[1].encode(), 0, *texts[2].encode()]
    calls: list[int] = []
    tok = counting(byte_tokenizer(eos_id=0), calls)
    seq = 8

    packed = pack_text_files(files, tok, seq_len=seq, cache_dir=tmp_path / "cache")
    assert not packed.cache_hit and calls
    assert len(packed) == (len(stream) - 1) // seq
    for i in range(len(packed)):
        x, y = packed[i]
        assert x.tolist() == stream[i * seq : i * seq + seq]  # every position a real token
        assert y.tolist() == stream[i * seq + 1 : i * seq + seq + 1]
    left_out = len(stream) - len(packed) * seq - 1
    assert 0 <= left_out < seq

    calls.clear()
    again = pack_text_files(files, tok, seq_len=seq, cache_dir=tmp_path / "cache")
    assert again.cache_hit and calls == []  # restarted job: no tokenizing
    assert torch.equal(again[3][0], packed[3][0])

    # another sequence length, file content or tokenizer is another cache entry
    assert not pack_text_files(files, tok, seq_len=seq + 1, cache_dir=tmp_path / "cache").cache_hit
    files[1].write_text("changed", encoding="utf-8")
    assert not pack_text_files(files, tok, seq_len=seq, cache_dir=tmp_path / "cache").cache_hit
    other = Tokenizer(encode_batch=tok.encode_batch, identity="other", vocab_size=256, eos_id=0)
    assert not pack_documents(texts, other, seq_len=seq, cache_dir=tmp_path / "cache").cache_hit
    assert len(calls) >= 3


def test_hf_tokenizer_packs_and_names_its_vocabulary(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from worker.data import hf_tokenizer

    def word_level(vocab: dict[str, int]) -> Tokenizer:
        rust = RustTokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
        rust.pre_tokenizer = pre_tokenizers.Whitespace()
        tok = PreTrainedTokenizerFast(tokenizer_object=rust, eos_token="<eos>", unk_token="[UNK]")
        return hf_tokenizer(tok)

    words = {"[UNK]": 0, "<eos>": 1, "the": 2, "cat": 3, "sat": 4}
    tok = word_level(words)
    docs = ["the cat sat the cat", "sat sat the"]
    packed = pack_documents(docs, tok, seq_len=3, cache_dir=tmp_path)
    stream = [2, 3, 4, 2, 3, 1, 4, 4, 2]  # the words' ids, <eos> between the documents
    assert [packed[i][0].tolist() for i in range(len(packed))] == [stream[0:3], stream[3:6]]
    assert packed[1][1].tolist() == stream[4:7]
    # another vocabulary is another tokenizer, so another cache entry
    other = word_level({**words, "dog": 5})
    assert other.identity != tok.identity
    assert not pack_documents(docs, other, seq_len=3, cache_dir=tmp_path).cache_hit


class _EngineOn:
    """What a loader reads of an engine, on a device of our choosing."""

    def __init__(self, device: str) -> None:
        self.device = torch.device(device)
        self.global_steps, self.rank, self.world_size = 0, 0, 1
        self.data_rank = (0, 1)
        self.registered: dict[str, object] = {}

    def register_state(self, name: str, obj: object) -> None:
        self.registered[name] = obj

    def set_micro_batches(self, counts: list[int], global_batch: int) -> None:
        pass


def test_an_attached_loader_delivers_to_the_engines_device() -> None:
    # the meta device stands in for a GPU here: batches go where the engine trains
    data = torch.arange(24.0).reshape(12, 2)
    config = LoaderConfig(global_batch=4, num_workers=0, prefetch=0)
    with StepLoader(data, config) as loader:
        (batch,) = loader.attach(_EngineOn("meta")).current()
        assert batch.device.type == "meta"
    with StepLoader(data, config, device="cpu") as loader:  # an explicit device wins
        (batch,) = loader.attach(_EngineOn("meta")).current()
        assert batch.device.type == "cpu"
