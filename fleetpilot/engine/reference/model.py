"""A small Llama-style decoder (RMSNorm, RoPE, GQA, SwiGLU) whose attention reads a paged KV pool.

Weights are plain tensors named as in Hugging Face Llama checkpoints, so a checkpoint written by
``checkpoint.save_checkpoint`` (or a tiny HF Llama with a byte vocabulary) loads directly. The
forward pass works on a *flattened* batch: the new tokens of every scheduled sequence are
concatenated ([T, hidden]) for the matmuls, and only attention looks at sequences, through
their block tables (``AttentionMetadata``).

Random initialisation is seeded and scaled so the model behaves like a trained one in the ways
the engine cares about: next-token distributions are peaked (logits with a few units of spread,
so greedy decoding is stable under float rounding), and each layer refines rather than replaces
the residual stream (residual branches are scaled down), so the model's first layers make a
useful early-exit draft for speculative decoding.

LoRA: a forward pass may carry a ``LoRABatch`` saying which rows of the flattened batch use
which adapter (lora.py loads them). Each adapted projection adds ``(x @ A.T) @ B.T`` (scaling
folded into ``B``) to the rows of its adapter only, as vLLM's punica kernels do, so sequences
with different adapters, or none, share one pass; the stacked qkv and gate_up projections take
each sub-projection's delta in its own columns. A batch without adapters costs nothing extra.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 (the conventional alias)

from fleetpilot.engine.reference.blocks import KVCacheSpec, KVPool
from fleetpilot.engine.reference.tokenizer import MIN_VOCAB_SIZE

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class ModelConfig:
    """Architecture; field names follow Hugging Face's ``LlamaConfig`` where one exists."""

    vocab_size: int = MIN_VOCAB_SIZE
    hidden_size: int = 128
    intermediate_size: int = 352  # ~2.75 x hidden, Llama's SwiGLU ratio
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    torch_dtype: str = "float32"
    # Random-init knobs (ignored when weights are loaded).
    init_seed: int = 0
    init_logit_std: float = 4.0
    init_residual_std: float = 0.15

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads}) for grouped-query attention"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.torch_dtype not in _DTYPES:
            raise ValueError(
                f"torch_dtype must be one of {sorted(_DTYPES)}, got {self.torch_dtype}"
            )

    @property
    def dtype(self) -> torch.dtype:
        return _DTYPES[self.torch_dtype]

    def kv_spec(self, block_size: int, *, quantized: bool = False) -> KVCacheSpec:
        return KVCacheSpec(
            num_layers=self.num_hidden_layers,
            num_kv_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            block_size=block_size,
            dtype=self.dtype,
            quantized=quantized,
        )

    def to_json_dict(self) -> dict[str, Any]:
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **asdict(self)}

    @classmethod
    def from_json_dict(cls, data: Mapping[str, Any]) -> ModelConfig:
        """Known fields only, so a Hugging Face config.json with extra keys loads."""
        names = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in names}
        if "head_dim" not in data and "hidden_size" in data and "num_attention_heads" in data:
            kwargs["head_dim"] = data["hidden_size"] // data["num_attention_heads"]
        if "num_key_value_heads" not in data and "num_attention_heads" in data:
            kwargs["num_key_value_heads"] = data["num_attention_heads"]
        return cls(**kwargs)


def weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model needs, by Hugging Face Llama name."""
    h, d = config.hidden_size, config.head_dim
    q_dim, kv_dim = config.num_attention_heads * d, config.num_key_value_heads * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, h)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q_dim, h),
            p + "self_attn.k_proj.weight": (kv_dim, h),
            p + "self_attn.v_proj.weight": (kv_dim, h),
            p + "self_attn.o_proj.weight": (h, q_dim),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (config.intermediate_size, h),
            p + "mlp.up_proj.weight": (config.intermediate_size, h),
            p + "mlp.down_proj.weight": (h, config.intermediate_size),
        }
    shapes["model.norm.weight"] = (h,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    return shapes


def random_weights(config: ModelConfig) -> dict[str, torch.Tensor]:
    """Seeded weights; see the module docstring for why they are scaled as they are."""
    gen = torch.Generator().manual_seed(config.init_seed)
    weights: dict[str, torch.Tensor] = {}
    for name, shape in weight_shapes(config).items():
        if name.endswith("norm.weight"):
            w = torch.ones(shape)
        elif name == "model.embed_tokens.weight":
            w = torch.randn(shape, generator=gen)
        elif name == "lm_head.weight":
            w = torch.randn(shape, generator=gen) * (config.init_logit_std / math.sqrt(shape[1]))
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            w = torch.randn(shape, generator=gen) * (config.init_residual_std / math.sqrt(shape[1]))
        else:
            w = torch.randn(shape, generator=gen) / math.sqrt(shape[1])
        weights[name] = w.to(config.dtype)
    return weights


@dataclass(frozen=True)
class LoRATarget:
    """Where a PEFT module's delta lands: its stacked projection, output columns and input width."""

    projection: str
    column: int  # first output column of the sub-projection in the stacked weight
    out_features: int
    in_features: int


def lora_targets(config: ModelConfig) -> dict[str, LoRATarget]:
    """Every adaptable module of one layer, by PEFT name (``q_proj`` ...). Pure."""
    h, inter = config.hidden_size, config.intermediate_size
    q_dim = config.num_attention_heads * config.head_dim
    kv_dim = config.num_key_value_heads * config.head_dim
    return {
        "q_proj": LoRATarget("qkv", 0, q_dim, h),
        "k_proj": LoRATarget("qkv", q_dim, kv_dim, h),
        "v_proj": LoRATarget("qkv", q_dim + kv_dim, kv_dim, h),
        "o_proj": LoRATarget("o_proj", 0, h, q_dim),
        "gate_proj": LoRATarget("gate_up", 0, inter, h),
        "up_proj": LoRATarget("gate_up", inter, inter, h),
        "down_proj": LoRATarget("down", 0, h, inter),
    }


@dataclass(frozen=True)
class LoRAProjection:
    """One adapter's delta on one stacked projection of one layer.

    ``a`` stacks the A matrices of every adapted sub-projection ([sum of ranks, in]), so the
    shrink is one matmul; ``parts`` are ``(rank_start, rank_end, column, B)`` with B
    [out_sub, rank] already multiplied by the module's scaling.
    """

    a: torch.Tensor
    parts: tuple[tuple[int, int, int, torch.Tensor], ...]


@dataclass(frozen=True)
class LoRAWeights:
    """An adapter ready for the forward pass: per layer, stacked projection -> its delta."""

    layers: tuple[Mapping[str, LoRAProjection], ...]


@dataclass(frozen=True)
class LoRABatch:
    """Which rows of a flattened batch use which adapter; rows in no group use none."""

    groups: tuple[tuple[LoRAWeights, torch.Tensor], ...]  # (adapter, rows [n] long)


def _add_lora(
    y: torch.Tensor, x: torch.Tensor, layer: int, projection: str, lora: LoRABatch
) -> None:
    """Add each group's delta to its rows of ``y`` (the stacked projection of ``x``), in place."""
    for weights, rows in lora.groups:
        p = weights.layers[layer].get(projection)
        if p is None:
            continue
        shrunk = F.linear(x[rows], p.a)
        for r0, r1, column, b in p.parts:
            y[:, column : column + b.shape[0]].index_add_(0, rows, F.linear(shrunk[:, r0:r1], b))


@dataclass(frozen=True)
class SeqSlice:
    """One sequence's part of a flattened batch.

    ``query_start``/``query_len``: where its new tokens sit in the batch. ``num_computed``:
    tokens already in the KV pool before this step (its new tokens take positions
    ``num_computed .. num_computed + query_len - 1``). ``block_table``: its physical blocks.
    """

    query_start: int
    query_len: int
    num_computed: int
    block_table: Sequence[int]


@dataclass(frozen=True)
class AttentionGroup:
    """Sequences attended together, padded to a common query and key length."""

    token_index: torch.Tensor  # [S, Qmax] rows of the flattened batch (padding repeats row 0)
    valid: torch.Tensor  # [S, Qmax] which of those are real tokens
    key_slots: torch.Tensor  # [S, Kmax] pool slots of every key position (padding: slot 0)
    mask: torch.Tensor  # [S, 1, Qmax, Kmax] key position <= query position


@dataclass(frozen=True)
class AttentionMetadata:
    """Everything attention needs for one forward pass, built once and shared by all layers."""

    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T] where each new token's K/V is written
    groups: tuple[AttentionGroup, ...]


# Sequences with at most this many new tokens (decodes, speculative verification) are padded
# into one batched attention call; longer ones (prefill chunks) run one per call, since padding
# 30 decodes up to a 256-token chunk would multiply the work by ~30.
_SHORT_QUERY_MAX = 16


def build_attention_metadata(seqs: Sequence[SeqSlice], block_size: int) -> AttentionMetadata:
    """Positions, slots and padded attention groups for a flattened batch. Pure."""
    positions: list[int] = []
    slots: list[int] = []
    for s in seqs:
        for pos in range(s.num_computed, s.num_computed + s.query_len):
            positions.append(pos)
            slots.append(s.block_table[pos // block_size] * block_size + pos % block_size)
    short = [s for s in seqs if s.query_len <= _SHORT_QUERY_MAX]
    groups = [_group(short, block_size)] if short else []
    groups += [_group([s], block_size) for s in seqs if s.query_len > _SHORT_QUERY_MAX]
    return AttentionMetadata(
        positions=torch.tensor(positions, dtype=torch.long),
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        groups=tuple(groups),
    )


def _group(seqs: Sequence[SeqSlice], block_size: int) -> AttentionGroup:
    q_max = max(s.query_len for s in seqs)
    k_max = max(s.num_computed + s.query_len for s in seqs)
    n_blocks = math.ceil(k_max / block_size)
    token_index = torch.zeros(len(seqs), q_max, dtype=torch.long)
    query_pos = torch.zeros(len(seqs), q_max, dtype=torch.long)
    valid = torch.zeros(len(seqs), q_max, dtype=torch.bool)
    tables = torch.zeros(len(seqs), n_blocks, dtype=torch.long)
    for i, s in enumerate(seqs):
        token_index[i, : s.query_len] = torch.arange(s.query_start, s.query_start + s.query_len)
        query_pos[i, : s.query_len] = torch.arange(s.num_computed, s.num_computed + s.query_len)
        valid[i, : s.query_len] = True
        used = math.ceil((s.num_computed + s.query_len) / block_size)
        tables[i, :used] = torch.tensor(list(s.block_table[:used]), dtype=torch.long)
    key_slots = (tables[:, :, None] * block_size + torch.arange(block_size)).reshape(len(seqs), -1)
    key_pos = torch.arange(key_slots.shape[1])
    # Causal by absolute position; a padded query row has position 0 and sees key 0 only, which
    # keeps softmax finite (its output is discarded). Keys past a sequence's length are masked
    # because they lie after its last query position.
    mask = (key_pos[None, None, :] <= query_pos[:, :, None]).unsqueeze(1)
    return AttentionGroup(token_index, valid, key_slots[:, :k_max], mask[..., :k_max])


def paged_attention(
    q: torch.Tensor, kv: KVPool, layer: int, meta: AttentionMetadata
) -> torch.Tensor:
    """Attention of the batch's queries q [T, heads, dim] over K/V gathered through block tables."""
    out = torch.empty_like(q)
    for g in meta.groups:
        k, v = kv.read(layer, g.key_slots)  # [S, Kmax, kv_heads, dim]
        qg = q[g.token_index].transpose(1, 2)  # [S, heads, Qmax, dim]
        o = F.scaled_dot_product_attention(
            qg,
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=g.mask,
            enable_gqa=True,
        ).transpose(1, 2)  # [S, Qmax, heads, dim]
        out[g.token_index[g.valid]] = o[g.valid]
    return out


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of one contiguous sequence, q [T, heads, dim], k/v [T, kv_heads, dim].

    The reference that paged attention must equal.
    """
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, enable_gqa=True
    )
    return o.transpose(0, 1)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    var = x.float().pow(2).mean(-1, keepdim=True)
    return (x.float() * torch.rsqrt(var + eps)).to(x.dtype) * weight


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@dataclass(frozen=True)
class _Layer:
    input_norm: torch.Tensor
    qkv: torch.Tensor  # q, k and v projections stacked: one matmul instead of three
    o_proj: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor  # gate and up stacked
    down: torch.Tensor


class LlamaModel:
    """The decoder. Stateless across calls: all KV state lives in the ``KVPool`` passed in."""

    def __init__(self, config: ModelConfig, weights: Mapping[str, torch.Tensor] | None = None):
        self.config = config
        weights = dict(weights) if weights is not None else random_weights(config)
        expected = weight_shapes(config)
        missing = sorted(set(expected) - set(weights))
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
        for name, shape in expected.items():
            if tuple(weights[name].shape) != shape:
                raise ValueError(
                    f"tensor {name} has shape {tuple(weights[name].shape)}, config needs {shape}"
                )
        self.weights = {n: weights[n].to(config.dtype).contiguous() for n in expected}
        w = self.weights
        self.embed = w["model.embed_tokens.weight"]
        self.norm = w["model.norm.weight"]
        self.lm_head = w[
            "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
        ]
        self.layers: list[_Layer] = []
        for i in range(config.num_hidden_layers):
            p = f"model.layers.{i}."
            self.layers.append(
                _Layer(
                    input_norm=w[p + "input_layernorm.weight"],
                    qkv=torch.cat([w[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]),
                    o_proj=w[p + "self_attn.o_proj.weight"],
                    post_norm=w[p + "post_attention_layernorm.weight"],
                    gate_up=torch.cat([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]]),
                    down=w[p + "mlp.down_proj.weight"],
                )
            )
        d = config.head_dim
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        angles = torch.outer(
            torch.arange(config.max_position_embeddings, dtype=torch.float64), inv_freq
        )
        angles = torch.cat((angles, angles), dim=-1)
        self.cos = angles.cos().to(config.dtype)
        self.sin = angles.sin().to(config.dtype)

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.weights.items()

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos = self.cos[positions][:, None, :]
        sin = self.sin[positions][:, None, :]
        return x * cos + _rotate_half(x) * sin

    def _layer(
        self,
        i: int,
        x: torch.Tensor,
        positions: torch.Tensor,
        attend: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
        lora: LoRABatch | None = None,
    ) -> torch.Tensor:
        c = self.config
        layer = self.layers[i]
        n_q, n_kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        h = _rms_norm(x, layer.input_norm, c.rms_norm_eps)
        qkv = F.linear(h, layer.qkv)
        if lora is not None:
            _add_lora(qkv, h, i, "qkv", lora)
        q, k, v = torch.split(qkv, [n_q, n_kv, n_kv], dim=-1)
        q = self._rope(q.view(-1, c.num_attention_heads, c.head_dim), positions)
        k = self._rope(k.view(-1, c.num_key_value_heads, c.head_dim), positions)
        v = v.view(-1, c.num_key_value_heads, c.head_dim)
        a = attend(i, q, k, v).reshape(x.shape[0], n_q)
        o = F.linear(a, layer.o_proj)
        if lora is not None:
            _add_lora(o, a, i, "o_proj", lora)
        x = x + o
        h = _rms_norm(x, layer.post_norm, c.rms_norm_eps)
        gate_up = F.linear(h, layer.gate_up)
        if lora is not None:
            _add_lora(gate_up, h, i, "gate_up", lora)
        gate, up = gate_up.chunk(2, dim=-1)
        m = F.silu(gate) * up
        down = F.linear(m, layer.down)
        if lora is not None:
            _add_lora(down, m, i, "down", lora)
        return x + down

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata,
        kv: KVPool,
        *,
        logits_indices: torch.Tensor | None = None,
        num_layers: int | None = None,
        lora: LoRABatch | None = None,
    ) -> torch.Tensor:
        """Logits [len(logits_indices), vocab] for a flattened batch; writes its K/V into ``kv``.

        ``num_layers`` stops after the first layers (the early-exit draft of speculative
        decoding); those layers' K/V are the same as the full model's, so the draft shares the
        pool. ``logits_indices`` picks the rows that need logits (default: all). ``lora``: the
        rows' adapters (none: the base model).
        """
        if lora is not None and not lora.groups:
            lora = None

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            kv.write(i, meta.slot_mapping, k, v)
            return paged_attention(q, kv, i, meta)

        x = self.embed[input_ids]
        for i in range(num_layers if num_layers is not None else len(self.layers)):
            x = self._layer(i, x, meta.positions, attend, lora)
        if logits_indices is not None:
            x = x[logits_indices]
        return F.linear(_rms_norm(x, self.norm, self.config.rms_norm_eps), self.lm_head).float()

    @torch.inference_mode()
    def forward_dense(
        self,
        input_ids: torch.Tensor,
        *,
        num_layers: int | None = None,
        lora: LoRAWeights | None = None,
    ) -> torch.Tensor:
        """Logits [T, vocab] of one sequence with plain causal attention and no KV pool.

        The reference the paged forward pass is tested against; ``lora`` adapts every token.
        """

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return dense_attention(q, k, v)

        positions = torch.arange(input_ids.shape[0])
        batch = None if lora is None else LoRABatch(((lora, positions),))
        x = self.embed[input_ids]
        for i in range(num_layers if num_layers is not None else len(self.layers)):
            x = self._layer(i, x, positions, attend, batch)
        return F.linear(_rms_norm(x, self.norm, self.config.rms_norm_eps), self.lm_head).float()


def make_kv_pool(
    config: ModelConfig,
    *,
    block_size: int,
    num_blocks: int | None = None,
    memory_bytes: int | None = None,
    quantized: bool = False,
) -> KVPool:
    """The model's KV pool, sized by block count or by a memory budget in bytes."""
    spec = config.kv_spec(block_size, quantized=quantized)
    if num_blocks is None:
        if memory_bytes is None:
            raise ValueError("give num_blocks or memory_bytes")
        num_blocks = spec.num_blocks_for_budget(memory_bytes)
        if num_blocks < 1:
            raise ValueError(
                f"a KV budget of {memory_bytes} bytes holds no block "
                f"of {spec.bytes_per_block} bytes"
            )
    return KVPool(spec, num_blocks)
