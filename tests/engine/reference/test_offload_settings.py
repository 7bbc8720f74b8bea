"""The host tier's flags: vLLM's --kv-offloading-size / --kv-offloading-backend and the extra
config keys its native offloading reads, and the reference engine's --kv-offload-gb-per-second;
what this engine does not do is refused by name, never ignored."""

from __future__ import annotations

import argparse
import json

import pytest

from fleetpilot.api import RoleName
from fleetpilot.engine.reference.offload import PAGE_BYTES, OffloadConfig
from fleetpilot.engine.reference.settings import ConfigError, add_arguments, settings_from_args


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--model-config", "tiny", "--max-model-len", "256", *argv])


def offload_of(*argv: str) -> OffloadConfig | None:
    _, factory = settings_from_args(parse(*argv))
    engine = factory()
    return engine.config.kv_offload


def extra(**keys: object) -> str:
    return json.dumps({"kv_connector_extra_config": keys})


def test_no_size_no_host_tier_and_a_size_is_gib_of_host_memory_at_the_default_bandwidth() -> None:
    """Unset: the engine is as before. Set: GiB (2**30 bytes, as vLLM's cpu_bytes_to_use), in
    page-aligned blocks of this model, at 25 GB/s with vLLM's defaults (placeholder events,
    prompt blocks only)."""
    assert offload_of() is None
    settings, factory = settings_from_args(parse("--kv-offloading-size", "0.25"))
    engine = factory()
    config = engine.config.kv_offload
    assert config == OffloadConfig(capacity_bytes=1 << 28, bandwidth_bytes_per_s=25e9)
    assert config is not None
    assert not config.self_describing_kv_events
    assert config.offload_prompt_only
    assert engine.host is not None
    assert engine.host.num_blocks == (1 << 28) // (-(-engine.kv.spec.bytes_per_block // PAGE_BYTES)
                                                   * PAGE_BYTES)  # fmt: skip
    assert settings.kv.role == RoleName.UNIFIED


def test_only_extra_config_beside_the_size_is_a_unified_engine_with_those_settings() -> None:
    """vLLM's offloading reads kv_connector_extra_config from --kv-transfer-config with no
    kv_role or connector (its post-init sets them): a unified engine, its keys honoured."""
    argv = ("--kv-offloading-size", "0.01", "--kv-offload-gb-per-second", "0.5",
            "--kv-transfer-config",
            extra(self_describing_kv_events=True, offload_prompt_only=False,
                  eviction_policy="lru", blocks_per_chunk=1, store_threshold=0))  # fmt: skip
    settings, factory = settings_from_args(parse(*argv))
    config = factory().config.kv_offload
    assert config is not None
    assert config.self_describing_kv_events
    assert not config.offload_prompt_only
    assert config.bandwidth_bytes_per_s == 0.5e9
    assert settings.kv.role == RoleName.UNIFIED
    same_block = extra(block_size=16)
    assert offload_of("--kv-offloading-size", "0.01", "--kv-transfer-config", same_block)


def test_the_backend_flag_alone_changes_nothing_as_in_vllm() -> None:
    """vLLM offloads only when a size is set: lmcache without one is no offloading, not an
    error."""
    assert offload_of("--kv-offloading-backend", "lmcache") is None


NIXL_BOTH = '{"kv_connector": "NixlConnector", "kv_role": "kv_both"}'


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["--kv-offloading-backend", "lmcache"], ["--kv-offloading-backend lmcache", "LMCache"]),
        (["--kv-transfer-config", NIXL_BOTH], ["--kv-offloading-size", "kv_role kv_both"]),
        (["--kv-transfer-config", '{"kv_role": "kv_consumer"}'], ["kv_role kv_consumer"]),
        (["--role", "prefill"], ["--kv-offloading-size", "--role prefill"]),
        (["--kv-transfer-config", '{"kv_connector": "OffloadingConnector"}'],
         ["only kv_connector_extra_config", "kv_connector"]),
        (["--kv-transfer-config", extra(eviction_policy="arc")], ["eviction_policy", "'arc'"]),
        (["--kv-transfer-config", extra(blocks_per_chunk=2)], ["blocks_per_chunk", "one KV block"]),
        (["--kv-transfer-config", extra(block_size=32)], ["block_size", "one KV block"]),
        (["--kv-transfer-config", extra(block_size=16, blocks_per_chunk=1)], ["set one of"]),
        (["--kv-transfer-config", extra(store_threshold=2)], ["store_threshold"]),
        (["--kv-transfer-config", extra(spec_name="TieringSpec")], ["spec_name"]),
        (["--kv-transfer-config", extra(secondary_tiers=[{"medium": "disk"}])],
         ["secondary_tiers"]),
        (["--kv-transfer-config", extra(sync_load_budget_bytes=1 << 20)],
         ["sync_load_budget_bytes"]),
        (["--kv-transfer-config", extra(cpu_bytes_to_use=1 << 30)],
         ["cpu_bytes_to_use", "--kv-offloading-size"]),
        (["--kv-transfer-config", extra(self_describing_kv_events="yes")],
         ["self_describing_kv_events", "true or false"]),
        (["--no-enable-prefix-caching"], ["--kv-offloading-size", "prefix caching"]),
        (["--kv-offload-gb-per-second", "0"], ["--kv-offload-gb-per-second"]),
    ],
)  # fmt: skip
def test_what_the_host_tier_cannot_do_is_refused_by_name(argv: list[str], names: list[str]) -> None:
    """Each refusal names the flag or key at fault: the LMCache backend (no server here), a P/D
    role (vLLM's post-init would swap the P/D connector for its offloading one), a connector of
    one's own, and every extra-config value of vLLM's offloading this engine does not do."""
    with pytest.raises(ConfigError) as info:
        settings_from_args(parse("--kv-offloading-size", "0.01", *argv))
    for name in names:
        assert name in str(info.value)


def test_a_size_that_is_not_positive_is_refused() -> None:
    for size in ("0", "-1"):
        with pytest.raises(ConfigError, match="--kv-offloading-size must be positive"):
            settings_from_args(parse("--kv-offloading-size", size))


def test_without_a_size_the_p_d_cases_are_as_before() -> None:
    """A --kv-transfer-config without kv_role is still refused when nothing offloads."""
    with pytest.raises(ConfigError, match="kv_role must be one of"):
        settings_from_args(parse("--kv-transfer-config", extra(self_describing_kv_events=True)))
    settings, _ = settings_from_args(parse("--kv-transfer-config", NIXL_BOTH))
    assert settings.kv.role == "both"


def test_a_size_too_small_for_one_block_fails_the_engine_naming_the_sizes() -> None:
    """The block size is the model's, known when the engine is built: a tier that holds no
    block fails there, saying why."""
    _, factory = settings_from_args(parse("--kv-offloading-size", "1e-9"))
    with pytest.raises(ValueError, match="holds no KV block"):
        factory()
