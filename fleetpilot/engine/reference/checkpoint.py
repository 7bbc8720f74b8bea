"""Checkpoints: a Hugging Face-style folder with ``config.json`` and ``model.safetensors``.

Weights are read and written with the ``safetensors`` library, the format real checkpoints
ship in, so a folder written here loads in other tools and a real (small) Llama checkpoint
loads here. A malformed file is a :class:`CheckpointError` naming the file, never a crash.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from fleetpilot import files
from fleetpilot.engine.reference.model import LlamaModel, ModelConfig

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


class CheckpointError(ValueError):
    """A checkpoint file is malformed or does not match the model config."""


def load_weights(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file."""
    try:
        return load_file(path)
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{path} is not a valid safetensors file: {e}") from e


def save_checkpoint(model: LlamaModel, directory: Path) -> None:
    """Write ``config.json`` and ``model.safetensors`` into ``directory`` (created if needed)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / CONFIG_FILE).write_text(json.dumps(model.config.to_json_dict(), indent=2) + "\n")
    # Tied weights share storage; safetensors refuses shared tensors, so store copies.
    weights = {name: t.detach().contiguous().clone() for name, t in model.named_weights()}
    save_file(weights, directory / WEIGHTS_FILE, metadata={"format": "pt"})


def load_checkpoint(directory: Path, *, torch_dtype: str | None = None) -> LlamaModel:
    """Load the model in ``directory``; ``torch_dtype`` overrides the config's."""
    try:
        config_data = files.load_json(directory / CONFIG_FILE, what="model config")
    except files.FileError as e:
        raise CheckpointError(str(e)) from None
    if not isinstance(config_data, dict):
        raise CheckpointError(f"{directory / CONFIG_FILE}: must be a JSON object")
    if torch_dtype is not None:
        config_data["torch_dtype"] = torch_dtype
    try:
        config = ModelConfig.from_json_dict(config_data)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{directory / CONFIG_FILE}: {e}") from e
    weights = load_weights(directory / WEIGHTS_FILE)
    try:
        return LlamaModel(config, weights)
    except ValueError as e:
        raise CheckpointError(f"{directory}: {e}") from e
