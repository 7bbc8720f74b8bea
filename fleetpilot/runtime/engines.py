"""What a local fleet runs for each planned engine: the CPU reference engine, or vLLM.

:class:`~fleetpilot.runtime.local.LocalFleet` decides what runs (tiers, roles, replicas, every
port) from the planner's launch of each role; a backend turns one such launch, already on its
local ports, into a command and environment, and says what the router of the fleet needs to
know of its engines (the tokenizer, the batch limit). Purely computational.

- :class:`ReferenceBackend` (the default): ``fleetpilot engine --backend reference`` as a
  cluster's reference pods run it for a tier with ``engine.backend: reference``, else with a
  tiny random model, capped for a CPU (:mod:`fleetpilot.engine.reference_launch`); optionally
  with a cold start (``fleetpilot up --cold-start``) and a step delay (``--step-delay``).
- :class:`VllmBackend`: the launcher's exact ``vllm serve`` line
  (:func:`~fleetpilot.engine.vllm_args.vllm_serve_args`) with a local checkpoint and a share
  of one GPU, on loopback: the GPU check of ``bench/gpu/vllm_check.py``.
"""

from __future__ import annotations

import sys
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from fleetpilot.engine.reference_launch import (
    CPU_MODEL_CONFIG,
    REFERENCE_TOKENIZER,
    cpu_launch,
    reference_argv,
)
from fleetpilot.engine.vllm_args import RUNTIME_LORA_ENV, EngineLaunch, vllm_serve_args

NIXL_SIDE_CHANNEL = "nixl-side-channel"
# Several engines share one GPU, so each gets a slice of its memory (vLLM's default, 0.9, is
# the whole device for one engine): a unified engine and a prefill/decode pair take 0.6.
SHARED_GPU_MEMORY_UTILIZATION = 0.2


@dataclass(frozen=True)
class EngineCommand:
    """One engine process: its command line and the environment it adds to the fleet's."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)


class EngineBackend(ABC):
    """How a local fleet turns a planned launch (on its local ports) into an engine process."""

    # Ports each engine needs besides its HTTP and two KV-event ports, by name: the fleet
    # allocates every engine its own, so engines of one machine never share one.
    extra_ports: tuple[str, ...] = ()
    # Start each engine only once the one before it answers /health.
    one_at_a_time: bool = False

    @abstractmethod
    def command(self, launch: EngineLaunch, host: str, extra_ports: Sequence[int]) -> EngineCommand:
        """The process serving ``launch`` on ``host``; ``extra_ports`` as :attr:`extra_ports`
        names them."""

    @abstractmethod
    def router_tokenizer(self) -> str:
        """What the router tokenizes prompts with to match them against the engines' KV
        events: the engines' own tokenizer."""

    def max_num_seqs(self, launch: EngineLaunch) -> int:
        """The batch limit the engines of ``launch`` run with, for the router's saturation
        estimate."""
        return launch.max_num_seqs


@dataclass(frozen=True)
class ReferenceBackend(EngineBackend):
    """The CPU reference engine with a seeded random model of ``model_config`` (a preset name
    or a ModelConfig JSON object)."""

    python: str = sys.executable
    model_config: str = CPU_MODEL_CONFIG
    # Where the seeded stand-ins of LoRA adapters are written (None: base models only).
    adapter_root: Path | None = None
    # Seconds each engine waits after loading before /health answers 200 (0: none).
    cold_start_s: float = 0.0
    # Seconds each engine sleeps after every busy step (0: none): a GPU's pace, not the CPU's.
    step_delay_s: float = 0.0

    def command(self, launch: EngineLaunch, host: str, extra_ports: Sequence[int]) -> EngineCommand:
        argv = reference_argv(
            launch,
            host,
            self.python,
            self.model_config,
            self.adapter_root,
            self.cold_start_s,
            self.step_delay_s,
        )
        runtime_lora = launch.lora is not None and launch.lora.runtime_updates
        return EngineCommand(argv, {RUNTIME_LORA_ENV: "True"} if runtime_lora else {})

    def router_tokenizer(self) -> str:
        return str(REFERENCE_TOKENIZER)

    def max_num_seqs(self, launch: EngineLaunch) -> int:
        # A GPU tier's engines run with the CPU batch limit: saturation comes sooner.
        return cpu_launch(launch).max_num_seqs


@dataclass(frozen=True)
class VllmBackend(EngineBackend):
    """``vllm serve`` as the launcher runs it, serving the checkpoint in ``model_dir`` (which
    holds its tokenizer too), each engine with ``gpu_memory_utilization`` of one shared GPU."""

    executable: str
    model_dir: Path
    gpu_memory_utilization: float = SHARED_GPU_MEMORY_UTILIZATION

    # vLLM's NIXL connector listens for its P/D peers on a side channel, port 5600 for every
    # engine unless told otherwise: two engines of one machine would collide.
    extra_ports = (NIXL_SIDE_CHANNEL,)
    # vLLM sizes its KV cache from the GPU memory it sees free while it starts; another
    # engine allocating or freeing memory meanwhile skews that measure (or fails its check).
    one_at_a_time = True

    def command(self, launch: EngineLaunch, host: str, extra_ports: Sequence[int]) -> EngineCommand:
        local = replace(
            launch, model=str(self.model_dir), gpu_memory_utilization=self.gpu_memory_utilization
        )
        (side_channel,) = extra_ports
        env = {
            "VLLM_NIXL_SIDE_CHANNEL_HOST": host,
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_channel),
            # The checkpoint is a local folder: nothing to ask the Hub, and nothing to report
            # (a machine lent for a check may have no network to wait on).
            "HF_HUB_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
        }
        return EngineCommand([self.executable, "serve", *vllm_serve_args(local, host)], env)

    def router_tokenizer(self) -> str:
        return str(self.model_dir)


__all__ = [
    "NIXL_SIDE_CHANNEL",
    "SHARED_GPU_MEMORY_UTILIZATION",
    "EngineBackend",
    "EngineCommand",
    "ReferenceBackend",
    "VllmBackend",
]
