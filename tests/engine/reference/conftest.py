"""Shared builders for the reference-engine tests: tiny models and engines that run in ms."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
import torch

from fleetpilot.engine.reference import EngineConfig, LlamaModel, LLMEngine
from fleetpilot.engine.reference.settings import MODEL_PRESETS
from fleetpilot.engine.reference.tokenizer import EOS_TOKEN_ID

# The tests' matrices are tiny: one thread avoids thread hand-off costs that exceed the work.
torch.set_num_threads(1)

# The server's "tiny" preset, with a shorter context: no engine test needs more.
TINY = replace(MODEL_PRESETS["tiny"], max_position_embeddings=512)


def tiny_model(**overrides: Any) -> LlamaModel:
    return LlamaModel(replace(TINY, **overrides))


EngineFactory = Callable[..., LLMEngine]


@pytest.fixture(scope="session")
def model() -> LlamaModel:
    return tiny_model()


@pytest.fixture
def make_engine(model: LlamaModel) -> EngineFactory:
    """``make_engine(**config_overrides)``: an engine on the shared tiny model."""

    def make(model_: LlamaModel | None = None, **overrides: Any) -> LLMEngine:
        config = EngineConfig(**{"num_kv_blocks": 256, "max_model_len": 256, **overrides})
        return LLMEngine(config, model_ or model)

    return make


def eos_model() -> LlamaModel:
    """A model whose greedy next token is always EOS.

    Hidden dimension 0 carries a large constant from the embeddings that no layer writes to, so
    after the final norm it dominates, and only EOS's lm_head row reads it.
    """
    weights = dict(tiny_model().weights)
    weights = {k: v.clone() for k, v in weights.items()}
    weights["model.embed_tokens.weight"][:, 0] = 50.0
    for i in range(TINY.num_hidden_layers):
        weights[f"model.layers.{i}.self_attn.o_proj.weight"][0, :] = 0.0
        weights[f"model.layers.{i}.mlp.down_proj.weight"][0, :] = 0.0
    weights["lm_head.weight"][:, 0] = 0.0
    weights["lm_head.weight"][EOS_TOKEN_ID, 0] = 10.0
    return LlamaModel(TINY, weights)
