"""The reference engine's metric names: vLLM's own (``vllm:``) or fleetpilot's (``fleetpilot_``).

A colon in a metric name is reserved for recording rules (Prometheus' naming practice): the
``vllm:`` names are vLLM's, mirrored as it writes them; every series the reference engine adds of
its own is ``fleetpilot_*``.
"""

from __future__ import annotations

import re

from prometheus_client.parser import text_string_to_metric_families

from fleetpilot.engine.reference.engine import EngineStats
from fleetpilot.engine.reference.metrics import ServerMetrics

OURS = re.compile(r"fleetpilot_[a-z][a-z0-9_]*")
VLLMS = re.compile(r"vllm:[a-z][a-z0-9_]*")


def _every_family() -> dict[str, str]:
    """Each family a scrape shows (sample name -> family name), with every optional part on:
    LoRA, a host KV tier and P/D transfers."""
    metrics = ServerMetrics("m", max_model_len=512, max_lora=2)
    metrics.set_stats(
        EngineStats(
            kv_offload_num_blocks=64,
            kv_offload_bytes_per_block=4096,
            block_size=16,
            num_kv_blocks=128,
            kv_exported_blocks_total=3,
            kv_pins_evicted_total=1,
            lora_loads_total=2,
        )
    )
    metrics.count_kv_pull()
    text = metrics.render().decode()
    return {
        sample.name: family.name
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_every_name_is_vllms_or_ours_with_no_colon_of_our_own() -> None:
    samples = _every_family()
    ours = {name for name in samples if name.startswith("fleetpilot")}
    assert {n for n in samples if not (OURS.fullmatch(n) or VLLMS.fullmatch(n))} == set()
    # The series this checks are there: P/D, pins, LoRA, the host tier and forward passes.
    assert {
        "fleetpilot_kv_transfer_pulls_total",
        "fleetpilot_kv_transfer_fallbacks_total",
        "fleetpilot_kv_transfer_imported_tokens_total",
        "fleetpilot_kv_transfer_exported_blocks_total",
        "fleetpilot_kv_pins_evicted_total",
        "fleetpilot_lora_adapter_loads_total",
        "fleetpilot_lora_adapter_activations_total",
        "fleetpilot_kv_offload_cpu_blocks_used",
        "fleetpilot_kv_offload_cpu_evictions_total",
        "fleetpilot_engine_forward_passes_total",
    } <= ours
    assert "vllm:kv_offload_config_info" in samples  # the host tier's families were exported
    assert "vllm:lora_requests_info" in samples
