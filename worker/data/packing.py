"""Tokenize-and-pack for language models, cached on disk.

[Note: packing]
Documents (a text file each, or strings) are tokenized, joined end to end
with the tokenizer's ``eos_id`` between them (when it has one), and cut into
samples of ``seq_len + 1`` tokens that overlap by one: sample ``i`` is
``tokens[i * seq_len : i * seq_len + seq_len + 1]``, its inputs the first
``seq_len`` tokens and its targets the last. Every position of every sample
is a real token, so no compute goes to padding; at most ``seq_len`` tokens at
the end are left out.

Tokenizing runs in a pool of worker threads over chunks of each document
(chunks end at a newline, ~1 MiB of text each); fast tokenizers (Rust, or
``str.encode``) release the GIL, so chunks tokenize in parallel.

The output is cached: ``cache_dir/<key>.npy`` (the token ids) and
``<key>.json`` (what went in), where ``key`` is the SHA-256 of the format
version, each document's content hash in order, the tokenizer's identity,
``eos_id`` and ``seq_len``. A restarted job, or another rank on the same
disk, finds the file and does not tokenize again; a changed file, tokenizer
or sequence length is another key. Files are written under a temporary name
and renamed, so ranks that build the same cache at once never read half of
one.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = [
    "PackedTokens",
    "Tokenizer",
    "byte_tokenizer",
    "hf_tokenizer",
    "pack_documents",
    "pack_text_files",
    "read_text",
]

logger = logging.getLogger(__name__)

PACK_FORMAT = "zeroplane-pack-v1"
CHUNK_CHARS = 1 << 20


@dataclass(frozen=True, kw_only=True)
class Tokenizer:
    """A tokenizer as the pack pipeline sees it.

    encode_batch: texts to token ids (one list per text, no special tokens).
    identity: names the tokenizer and its vocabulary; part of the cache key,
        so two tokenizers that can encode differently must not share one.
    vocab_size: ids are below it (chooses the cache file's integer type).
    eos_id: put between documents; None puts nothing.
    """

    encode_batch: Callable[[list[str]], list[list[int]]]
    identity: str
    vocab_size: int
    eos_id: int | None = None

    def __post_init__(self) -> None:
        if not self.identity:
            raise ValueError("Tokenizer.identity must be a non-empty string")
        if self.vocab_size < 1:
            raise ValueError(f"Tokenizer.vocab_size must be >= 1, got {self.vocab_size}")
        if self.eos_id is not None and not 0 <= self.eos_id < self.vocab_size:
            raise ValueError(
                f"Tokenizer.eos_id must be in [0, {self.vocab_size}), got {self.eos_id}"
            )


def _encode_bytes(texts: list[str]) -> list[list[int]]:
    return [list(t.encode("utf-8")) for t in texts]


def byte_tokenizer(eos_id: int | None = None) -> Tokenizer:
    """UTF-8 bytes as tokens (vocabulary 256), the demo's tokenizer."""
    return Tokenizer(
        encode_batch=_encode_bytes, identity="utf8-bytes", vocab_size=256, eos_id=eos_id
    )


def hf_tokenizer(tok: Any) -> Tokenizer:
    """A Hugging Face ``transformers`` tokenizer; its identity hashes its vocabulary."""
    vocab = json.dumps(sorted(tok.get_vocab().items()), separators=(",", ":"))
    digest = hashlib.sha256(vocab.encode()).hexdigest()[:16]

    def encode(texts: list[str]) -> list[list[int]]:
        return tok(texts, add_special_tokens=False)["input_ids"]

    return Tokenizer(
        encode_batch=encode,
        identity=f"hf:{type(tok).__name__}:{tok.name_or_path}:{digest}",
        vocab_size=len(tok),
        eos_id=tok.eos_token_id,
    )


def read_text(path: str | os.PathLike) -> str:
    """A UTF-8 text file; ``.gz`` files are decompressed."""
    raw = Path(path).read_bytes()
    if str(path).endswith(".gz"):
        raw = gzip.decompress(raw)
    return raw.decode("utf-8")


class PackedTokens:
    """Samples of ``seq_len + 1`` consecutive tokens, ``stride`` apart (a map-style dataset).

    Item ``i`` is ``(inputs, targets)``: ``tokens[i*stride : i*stride + seq_len]``
    and the same shifted by one, as int64 tensors. ``stride = seq_len`` (the
    default) is packing ([Note: packing]); ``stride = 1`` is every window.
    ``tokens``: a 1-D numpy array (a memory map of a cache file) or tensor.
    """

    def __init__(
        self,
        tokens: np.ndarray | torch.Tensor,
        seq_len: int,
        *,
        stride: int | None = None,
        cache_hit: bool = False,
        path: Path | None = None,
    ) -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if tokens.ndim != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
        self.tokens = tokens
        self.seq_len = seq_len
        self.stride = seq_len if stride is None else stride
        if self.stride < 1:
            raise ValueError(f"stride must be >= 1, got {self.stride}")
        self.cache_hit = cache_hit
        self.path = path
        n = len(tokens)
        self._len = (n - seq_len - 1) // self.stride + 1 if n > seq_len else 0

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not -self._len <= i < self._len:
            raise IndexError(f"sample {i} out of range for {self._len} samples")
        start = (i % self._len) * self.stride
        window = self.tokens[start : start + self.seq_len + 1]
        if isinstance(window, np.ndarray):
            window = torch.from_numpy(np.asarray(window, dtype=np.int64))
        else:
            window = window.long()
        return window[:-1], window[1:]

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)


def _chunks(text: str) -> list[str]:
    """``text`` cut at newlines into pieces of about CHUNK_CHARS characters."""
    out, start = [], 0
    while start < len(text):
        end = text.find("\n", start + CHUNK_CHARS)
        end = len(text) if end < 0 else end + 1
        out.append(text[start:end])
        start = end
    return out


def _cache_key(doc_hashes: Sequence[str], tokenizer: Tokenizer, seq_len: int) -> str:
    desc = json.dumps(
        [PACK_FORMAT, list(doc_hashes), tokenizer.identity, tokenizer.eos_id, seq_len]
    )
    return hashlib.sha256(desc.encode()).hexdigest()[:32]


def _tokenize(docs: Sequence[str], tokenizer: Tokenizer, num_workers: int) -> np.ndarray:
    pieces = [(d, c) for d, text in enumerate(docs) for c in _chunks(text)]
    # a few chunks per call: fast tokenizers batch internally
    calls = [pieces[i : i + 4] for i in range(0, len(pieces), 4)]

    def run(call: list[tuple[int, str]]) -> list[list[int]]:
        return tokenizer.encode_batch([c for _, c in call])

    if num_workers > 1 and len(calls) > 1:
        with ThreadPoolExecutor(num_workers, thread_name_prefix="zp-tokenize") as pool:
            results = list(pool.map(run, calls))
    else:
        results = [run(call) for call in calls]
    dtype = np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.int32
    parts: list[np.ndarray] = []
    flat = [ids for result in results for ids in result]
    for k, ((doc, _), ids) in enumerate(zip(pieces, flat, strict=True)):
        parts.append(np.asarray(ids, dtype=dtype))
        last_of_doc = k + 1 == len(pieces) or pieces[k + 1][0] != doc
        if last_of_doc and tokenizer.eos_id is not None and k + 1 < len(pieces):
            parts.append(np.asarray([tokenizer.eos_id], dtype=dtype))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)


def _pack(
    doc_hashes: list[str],
    load: Callable[[], list[str]],
    describe: list[str],
    tokenizer: Tokenizer,
    seq_len: int,
    cache_dir: str | os.PathLike,
    num_workers: int,
) -> PackedTokens:
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    cache = Path(cache_dir)
    key = _cache_key(doc_hashes, tokenizer, seq_len)
    file = cache / f"{key}.npy"
    if file.exists():
        logger.info("packed tokens cached in %s", file)
        return PackedTokens(np.load(file, mmap_mode="r"), seq_len, cache_hit=True, path=file)
    tokens = _tokenize(load(), tokenizer, num_workers)
    if len(tokens) <= seq_len:
        raise ValueError(
            f"{describe[:3]} tokenize to {len(tokens)} tokens, fewer than one sample "
            f"of seq_len + 1 = {seq_len + 1}"
        )
    meta = {
        "format": PACK_FORMAT,
        "documents": describe,
        "sha256": doc_hashes,
        "tokenizer": tokenizer.identity,
        "eos_id": tokenizer.eos_id,
        "seq_len": seq_len,
        "tokens": len(tokens),
        "dtype": str(tokens.dtype),
    }
    try:
        cache.mkdir(parents=True, exist_ok=True)
        for suffix, write in (
            (".json", lambda f: f.write(json.dumps(meta, indent=1).encode())),
            (".npy", lambda f: np.save(f, tokens)),
        ):
            fd, tmp = tempfile.mkstemp(dir=cache, prefix=f".{key}", suffix=suffix)
            with os.fdopen(fd, "wb") as f:
                write(f)
            os.replace(tmp, cache / f"{key}{suffix}")  # .npy last: it marks the entry complete
    except OSError as exc:  # a read-only or full disk costs the cache, not the job
        logger.warning("packed tokens not cached in %s: %s", cache, exc)
        return PackedTokens(tokens, seq_len, cache_hit=False, path=None)
    logger.info("packed %d tokens into %s", len(tokens), file)
    return PackedTokens(np.load(file, mmap_mode="r"), seq_len, cache_hit=False, path=file)


def pack_text_files(
    files: Sequence[str | os.PathLike],
    tokenizer: Tokenizer,
    *,
    seq_len: int,
    cache_dir: str | os.PathLike,
    num_workers: int = 2,
) -> PackedTokens:
    """Tokenize and pack text files (one document each, ``.gz`` read as gzip), or
    load the result from ``cache_dir`` ([Note: packing])."""
    if not files:
        raise ValueError("pack_text_files needs at least one file")
    texts = [read_text(f) for f in files]  # read once: hashed here, tokenized on a miss
    hashes = [hashlib.sha256(t.encode()).hexdigest() for t in texts]
    return _pack(
        hashes, lambda: texts, [str(f) for f in files], tokenizer, seq_len, cache_dir, num_workers
    )


def pack_documents(
    documents: Sequence[str],
    tokenizer: Tokenizer,
    *,
    seq_len: int,
    cache_dir: str | os.PathLike,
    num_workers: int = 2,
) -> PackedTokens:
    """Tokenize and pack strings (e.g. a ``datasets`` text column), cached like files."""
    if not documents:
        raise ValueError("pack_documents needs at least one document")
    docs = list(documents)
    hashes = [hashlib.sha256(d.encode()).hexdigest() for d in docs]
    return _pack(
        hashes, lambda: docs, [f"{len(docs)} documents"], tokenizer, seq_len, cache_dir, num_workers
    )
