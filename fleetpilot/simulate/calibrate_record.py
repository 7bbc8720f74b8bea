"""The step recorder: ``python -m fleetpilot.simulate.calibrate_record OUT ENGINE_FLAGS...``
serves exactly as ``fleetpilot engine --backend reference ENGINE_FLAGS...`` does, but wraps the
engine's ``step`` and its scheduler's ``schedule`` from outside to note, per step, what ran
(decoding sequences, their KV tokens, prompt tokens computed, the context they attend to) and
when it started; on shutdown it writes the engine's settings and the steps to OUT (JSON), which
:func:`fleetpilot.simulate.calibrate_fit.step_records` turns into step costs.

It runs in the engine's child process (torch is loaded there, never in the calibration's).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fleetpilot.engine.reference.engine import LLMEngine
    from fleetpilot.engine.reference.request import RequestOutput
    from fleetpilot.engine.reference.scheduler import SchedulerOutput


def _composition(plan: SchedulerOutput) -> tuple[int, int, int, int, float]:
    """(decoding sequences, their KV tokens, prompt tokens computed, the prefilling
    sequences' tokens already computed or cached, their attention pairs) of a step's plan."""
    running = kv = prefill = context = 0
    pairs = 0.0
    for s in plan.scheduled:
        r = s.request
        decoding = r.num_output_tokens > 0 and r.num_computed_tokens == r.num_tokens - 1
        if decoding and s.num_new_tokens == 1:
            running += 1
            kv += r.num_tokens
        else:
            new, prior = s.num_new_tokens, r.num_computed_tokens
            prefill += new
            context += prior
            pairs += new * (prior + new / 2)
    return running, kv, prefill, context, pairs


class StepRecorder:
    """Wraps an engine's ``step`` and its scheduler's ``schedule`` from outside (the engine has
    no hook for it), noting per step its wall-clock and monotonic start, end, composition and
    whether work remained after it (the runner then steps again at once)."""

    def __init__(self) -> None:
        self.steps: list[list[float]] = []
        self.engine: dict[str, Any] = {}
        self._plan: tuple[int, int, int, int, float] = (0, 0, 0, 0, 0.0)

    def attach(self, engine: LLMEngine) -> LLMEngine:
        import torch  # the engine process has it loaded already

        from fleetpilot.engine.reference.offload import DEFAULT_BANDWIDTH_BYTES_PER_S

        schedule, step = engine.scheduler.schedule, engine.step

        def planned() -> SchedulerOutput:
            plan = schedule()
            self._plan = _composition(plan)
            return plan

        def timed() -> list[RequestOutput]:
            self._plan = (0, 0, 0, 0, 0.0)
            wall, start = time.time(), time.perf_counter()
            outputs = step()
            end = time.perf_counter()
            busy = engine.has_unfinished_requests()
            self.steps.append([wall, start, end, *self._plan, float(busy)])
            return outputs

        # Instance attributes shadow the methods: the runner and step() look them up there.
        engine.scheduler.schedule = planned  # type: ignore[method-assign]
        engine.step = timed  # type: ignore[method-assign]
        config = engine.config
        self.engine = {
            "num_blocks": engine.kv.num_blocks,
            "kv_bytes_per_block": engine.kv.spec.bytes_per_block,
            # What paces its copies back from a host tier: the one it has, else the default.
            "host_bandwidth_bytes_per_s": (
                config.kv_offload.bandwidth_bytes_per_s
                if config.kv_offload is not None
                else DEFAULT_BANDWIDTH_BYTES_PER_S
            ),
            "block_size": config.block_size,
            "max_num_seqs": config.max_num_seqs,
            "max_num_batched_tokens": config.max_num_batched_tokens,
            "enable_prefix_caching": config.enable_prefix_caching,
            "torch_threads": torch.get_num_threads(),
        }
        return engine


def record_main(argv: Sequence[str]) -> int:
    """``python -m fleetpilot.simulate.calibrate_record OUT ENGINE_FLAGS...``: serve as
    ``fleetpilot engine --backend reference ENGINE_FLAGS...`` does, then write the engine's
    settings and its steps to OUT (JSON) on shutdown."""
    from fleetpilot.engine.reference import server as engine_server
    from fleetpilot.logs import configure_logging

    if not argv:
        print(
            "usage: python -m fleetpilot.simulate.calibrate_record OUT ENGINE_FLAGS...",
            file=sys.stderr,
        )
        return 2
    parser = argparse.ArgumentParser(prog="fleetpilot engine --backend reference (recording)")
    engine_server.add_arguments(parser)
    args = parser.parse_args(argv[1:])
    configure_logging(args.log_level, args.log_format)
    server = engine_server.build_server(args)
    recorder = StepRecorder()
    build = server.engine_factory
    server.engine_factory = lambda: recorder.attach(build())
    code = asyncio.run(engine_server.serve(server))
    Path(argv[0]).write_text(json.dumps({"engine": recorder.engine, "steps": recorder.steps}))
    return code


if __name__ == "__main__":
    raise SystemExit(record_main(sys.argv[1:]))
