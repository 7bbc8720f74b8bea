"""Checkpoint folders: config.json + model.safetensors, as real checkpoints ship."""

from __future__ import annotations

import json
import struct
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from fleetpilot.engine.reference.checkpoint import (
    CheckpointError,
    load_checkpoint,
    save_checkpoint,
)
from fleetpilot.engine.reference.model import LlamaModel
from tests.engine.reference.conftest import TINY


def test_checkpoint_round_trip_gives_the_same_model(tmp_path: Path) -> None:
    """A model saved with non-default seed loads back with identical weights and logits."""
    model = LlamaModel(replace(TINY, init_seed=7, tie_word_embeddings=True))
    save_checkpoint(model, tmp_path / "ckpt")
    loaded = load_checkpoint(tmp_path / "ckpt")
    assert loaded.config == model.config
    ids = torch.arange(30)
    assert torch.equal(loaded.forward_dense(ids), model.forward_dense(ids))
    assert loaded.config.tie_word_embeddings
    assert "lm_head.weight" not in loaded.weights


def test_weights_file_is_standard_safetensors(tmp_path: Path) -> None:
    """Other tools read what we write: names, dtypes and metadata as safetensors stores them."""
    model = LlamaModel(TINY)
    save_checkpoint(model, tmp_path)
    with safe_open(tmp_path / "model.safetensors", framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        names = set(f.keys())
        embed = f.get_tensor("model.embed_tokens.weight")
    assert names == {name for name, _ in model.named_weights()}
    assert torch.equal(embed, model.weights["model.embed_tokens.weight"])


def test_checkpoint_written_by_another_tool_loads(tmp_path: Path) -> None:
    """A folder whose weights were saved by safetensors itself (as a hub download would be)."""
    model = LlamaModel(replace(TINY, init_seed=11))
    save_checkpoint(model, tmp_path)
    weights = {name: t.clone() for name, t in model.named_weights()}
    save_file(weights, tmp_path / "model.safetensors")
    loaded = load_checkpoint(tmp_path)
    ids = torch.arange(12)
    assert torch.equal(loaded.forward_dense(ids), model.forward_dense(ids))


def test_hugging_face_config_with_extra_keys_loads(tmp_path: Path) -> None:
    """A Llama config.json from elsewhere (extra keys, no head_dim) still loads."""
    model = LlamaModel(replace(TINY, head_dim=16, hidden_size=64))
    save_checkpoint(model, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg["head_dim"]
    cfg |= {"bos_token_id": 256, "transformers_version": "4.50"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert load_checkpoint(tmp_path).config.head_dim == 16


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (lambda raw: raw[:4], "not a valid safetensors file"),
        (lambda raw: struct.pack("<Q", 10**12) + raw[8:], "not a valid safetensors file"),
        (lambda raw: raw[:8] + b"\xff" + raw[9:], "not a valid safetensors file"),
        (lambda raw: raw[:-4], "not a valid safetensors file"),
    ],
)
def test_corrupt_weight_files_fail_with_a_checkpoint_error(
    tmp_path: Path, corrupt: object, message: str
) -> None:
    """Truncated or garbled files are refused with a message, never a crash or a bad model."""
    save_checkpoint(LlamaModel(TINY), tmp_path)
    path = tmp_path / "model.safetensors"
    path.write_bytes(corrupt(path.read_bytes()))  # type: ignore[operator]
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(tmp_path)


def test_checkpoint_for_another_architecture_is_refused(tmp_path: Path) -> None:
    """Weights that do not fit the config name what is missing."""
    save_checkpoint(LlamaModel(TINY), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["num_hidden_layers"] = 5
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="lacks"):
        load_checkpoint(tmp_path)
