"""Paged attention and the paged forward pass against dense references."""

from __future__ import annotations

import random

import pytest
import torch

from fleetpilot.engine.reference.blocks import KVCacheSpec, KVPool
from fleetpilot.engine.reference.model import (
    LlamaModel,
    ModelConfig,
    SeqSlice,
    build_attention_metadata,
    dense_attention,
    make_kv_pool,
    paged_attention,
)
from tests.engine.reference.conftest import TINY

BS = 4


def test_paged_attention_equals_dense_attention_for_a_mixed_batch() -> None:
    """Three sequences in one batch — a 1-token decode, a 3-token speculative verify and a
    20-token prefill chunk with cached context — with shuffled, non-contiguous block tables,
    attend exactly as dense causal attention over each whole sequence does."""
    torch.manual_seed(0)
    heads, kv_heads, dim = 4, 2, 8
    spec = KVCacheSpec(num_layers=1, num_kv_heads=kv_heads, head_dim=dim, block_size=BS)
    pool = KVPool(spec, 64)
    free = list(range(64))
    random.Random(0).shuffle(free)
    lengths = [(13, 1), (9, 3), (7, 20)]  # (cached tokens, new tokens)
    full = []
    seqs, new_k, new_v, new_q = [], [], [], []
    start = 0
    for cached, new in lengths:
        n = cached + new
        table = [free.pop() for _ in range(-(-n // BS))]
        q = torch.randn(n, heads, dim)
        k, v = torch.randn(n, kv_heads, dim), torch.randn(n, kv_heads, dim)
        full.append((q, k, v))
        slots = torch.tensor(
            [table[p // BS] * BS + p % BS for p in range(cached)], dtype=torch.long
        )
        pool.write(0, slots, k[:cached], v[:cached])  # earlier steps' KV
        seqs.append(SeqSlice(start, new, cached, table))
        new_q.append(q[cached:])
        new_k.append(k[cached:])
        new_v.append(v[cached:])
        start += new
    meta = build_attention_metadata(seqs, BS)
    assert len(meta.groups) == 2  # the two short queries are batched, the chunk runs alone
    pool.write(0, meta.slot_mapping, torch.cat(new_k), torch.cat(new_v))
    out = paged_attention(torch.cat(new_q), pool, 0, meta)
    start = 0
    for (cached, new), (q, k, v) in zip(lengths, full, strict=True):
        ref = dense_attention(q, k, v)[cached:]
        assert torch.allclose(out[start : start + new], ref, atol=1e-5)
        start += new


def forward_in_chunks(
    model: LlamaModel, ids: torch.Tensor, chunks: list[int], quantized: bool = False
) -> torch.Tensor:
    pool = make_kv_pool(model.config, block_size=BS, num_blocks=32, quantized=quantized)
    table = list(range(31, 31 - -(-len(ids) // BS), -1))  # reversed: nothing contiguous
    logits, done = [], 0
    for n in chunks:
        meta = build_attention_metadata([SeqSlice(0, n, done, table)], BS)
        logits.append(model.forward(ids[done : done + n], meta, pool))
        done += n
    return torch.cat(logits)


def test_paged_forward_equals_dense_forward_whatever_the_chunking(model: LlamaModel) -> None:
    """Prefill in one pass, in chunks, or token by token gives the dense model's logits."""
    ids = torch.randint(0, 258, (23,), generator=torch.Generator().manual_seed(1))
    ref = model.forward_dense(ids)
    for chunks in ([23], [5, 11, 7], [1] * 23):
        assert torch.allclose(forward_in_chunks(model, ids, chunks), ref, atol=1e-4)


def test_int8_kv_forward_stays_close_to_dense(model: LlamaModel) -> None:
    """Decoding through an int8 KV pool keeps the same greedy tokens as full precision."""
    ids = torch.randint(0, 258, (23,), generator=torch.Generator().manual_seed(2))
    ref = model.forward_dense(ids)
    out = forward_in_chunks(model, ids, [10] + [1] * 13, quantized=True)
    assert (out - ref).abs().max() < 0.1 * ref.std()
    assert torch.equal(out.argmax(-1), ref.argmax(-1))


def test_draft_early_exit_equals_the_first_layers_of_the_target(model: LlamaModel) -> None:
    """num_layers=1 computes exactly the dense model truncated after one layer."""
    ids = torch.randint(0, 258, (9,), generator=torch.Generator().manual_seed(3))
    pool = make_kv_pool(model.config, block_size=BS, num_blocks=8)
    meta = build_attention_metadata([SeqSlice(0, 9, 0, [0, 1, 2])], BS)
    out = model.forward(ids, meta, pool, num_layers=1)
    assert torch.allclose(out, model.forward_dense(ids, num_layers=1), atol=1e-4)
    assert not torch.allclose(out, model.forward_dense(ids), atol=1e-2)


def test_random_init_is_seeded_and_peaked() -> None:
    """Same seed, same weights; default logits are peaked enough for stable greedy decoding."""
    a, b = LlamaModel(TINY), LlamaModel(TINY)
    assert all(torch.equal(a.weights[n], b.weights[n]) for n in a.weights)
    ids = torch.arange(40)
    top2 = torch.topk(torch.softmax(a.forward_dense(ids), -1), 2).values
    assert float(top2[:, 0].mean()) > 0.3


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"num_attention_heads": 4, "num_key_value_heads": 3}, "multiple of"),
        ({"head_dim": 15}, "even"),
        ({"torch_dtype": "int4"}, "torch_dtype"),
    ],
)
def test_invalid_model_configs_are_refused(overrides: dict[str, object], message: str) -> None:
    """Configs that cannot build a GQA/RoPE model fail at construction with a clear message."""
    with pytest.raises(ValueError, match=message):
        ModelConfig(**overrides)  # type: ignore[arg-type]


def test_weights_of_the_wrong_shape_are_refused() -> None:
    """Loading weights for another architecture names the offending tensor."""
    weights = dict(LlamaModel(TINY).weights)
    weights["model.layers.0.mlp.up_proj.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match="up_proj"):
        LlamaModel(TINY, weights)
