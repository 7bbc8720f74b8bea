"""Simulator profiles: GPU rooflines against published vLLM figures, measured profiles' files."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from fleetpilot.api import InferenceService, ResolvedRole, parse_service
from fleetpilot.simulate.profile import (
    H100,
    EngineCosts,
    EngineShape,
    MeasuredProfile,
    ProfileError,
    load_profile,
    role_model,
    roofline,
)

RESULTS = Path(__file__).parents[2] / "bench" / "results"


def service(model: str, **tier: Any) -> InferenceService:
    spec = {"name": "main", "model": {"name": model, "maxModelLen": 8192}, **tier}
    spec.setdefault("resources", {"gpuProduct": "NVIDIA-H100-80GB-HBM3"})
    return parse_service(
        {
            "apiVersion": "fleetpilot.dev/v1alpha1",
            "kind": "InferenceService",
            "metadata": {"name": "s", "namespace": "ns"},
            "spec": {"tiers": [spec]},
        }
    )


def role(model: str, **tier: Any) -> ResolvedRole:
    return service(model, **tier).spec.tiers[0].roles()[0]


def test_h100_llama3_8b_matches_published_vllm_figures() -> None:
    """Llama 3 8B on one H100: vLLM v0.6 publishes ~6-8 ms TPOT at low load and third-party
    runs ~12.5k output tokens/s at full batch; the roofline lands in that neighbourhood."""
    costs = roofline(H100, role("meta-llama/Llama-3.1-8B-Instruct")).costs
    assert 0.006 <= costs.step_s(1, 1000) <= 0.010
    full_batch = 256 / costs.step_s(256, 256 * 400)
    assert 8_000 <= full_batch <= 14_000
    assert 15_000 <= 1 / costs.prefill_per_token_s <= 40_000


def test_tensor_parallelism_divides_the_step_and_the_cold_start_weights() -> None:
    one = roofline(H100, role("Qwen/Qwen2.5-72B-Instruct", parallelism={"tensor": 4})).costs
    two = roofline(H100, role("Qwen/Qwen2.5-72B-Instruct", parallelism={"tensor": 8})).costs
    assert two.decode_base_s < one.decode_base_s
    assert two.prefill_per_token_s == pytest.approx(one.prefill_per_token_s / 2)
    assert two.cold_start_s < one.cold_start_s


def test_moe_computes_with_its_active_parameters() -> None:
    """Mixtral 8x7B holds 46.7B parameters but computes each token with 12.9B of them."""
    moe = roofline(H100, role("mistralai/Mixtral-8x7B-Instruct-v0.1", parallelism={"tensor": 2}))
    flops_per_token = moe.costs.prefill_per_token_s * H100.dense_bf16_flops * H100.prefill_mfu * 2
    assert flops_per_token == pytest.approx(2 * 12.9e9)


def test_shape_is_the_planner_capacity() -> None:
    model = roofline(H100, role("meta-llama/Llama-3.1-8B-Instruct"))
    # 80 GB x 0.9 - 2 GiB reserve - 16 GB of weights, over 128 KiB a token.
    assert 400_000 < model.shape.kv_tokens < 500_000
    assert model.shape.block_size == 16
    assert model.gpus == 1


def test_the_host_tier_is_the_planners_and_copies_back_at_the_pcie_rate() -> None:
    """128 GiB of host KV beside an 8B model on one H100: the planner's host tokens, and a
    token's 128 KiB copied back at 40 GB/s - about a tenth of computing it (~25k tokens/s)."""
    tier = {"engine": {"kvOffload": {"size": "128Gi"}}}
    model = roofline(H100, role("meta-llama/Llama-3.1-8B-Instruct", **tier))
    assert model.shape.host_kv_tokens == 1_048_576  # 128 GiB / 128 KiB
    assert model.costs.host_load_per_token_s == pytest.approx(131_072 / 40e9)
    ratio = model.costs.host_load_per_token_s / model.costs.prefill_per_token_s
    assert 0.05 < ratio < 0.2
    without = roofline(H100, role("meta-llama/Llama-3.1-8B-Instruct"))
    assert without.shape.host_kv_tokens == 0


def test_auto_profile_follows_each_tiers_gpu_and_names_an_unknown_one() -> None:
    l40s = role_model(
        None, role("meta-llama/Llama-3.1-8B-Instruct", resources={"gpuProduct": "NVIDIA-L40S"})
    )
    h100 = role_model(None, role("meta-llama/Llama-3.1-8B-Instruct"))
    assert l40s.costs.decode_base_s > 2 * h100.costs.decode_base_s
    with pytest.raises(ProfileError, match="gpuProduct 'NVIDIA-B200'"):
        role_model(
            None, role("meta-llama/Llama-3.1-8B-Instruct", resources={"gpuProduct": "NVIDIA-B200"})
        )


def test_a_model_the_planner_cannot_size_is_refused_with_the_fields_to_set() -> None:
    with pytest.raises(ProfileError, match=r"model\.architecture"):
        roofline(H100, role("acme/secret-model"))


def test_measured_profile_round_trips_through_its_file(tmp_path: Path) -> None:
    profile = MeasuredProfile(
        "reference-cpu",
        "measured here",
        EngineCosts(0.001, 2e-5, 0.004, 1e-4, 1e-7, 1e-6, 3.0),
        EngineShape(
            kv_tokens=8192,
            block_size=16,
            max_num_seqs=16,
            max_num_batched_tokens=512,
            chars_per_token=1.1,
        ),
        router_s=0.002,
        kv_bytes_per_token=768,
    )
    path = tmp_path / "p.json"
    path.write_text(json.dumps(profile.to_json()))
    assert load_profile(str(path)) == profile
    # A file from before the newer fields holds none of them: they default to 0.
    old = profile.to_json()
    del old["router_s"]
    del old["kv_bytes_per_token"]
    for name in ("first_token_per_stream_s", "prefill_per_context_token_s", "prefill_per_pair_s"):
        del old["costs"][name]
    path.write_text(json.dumps(old))
    before = load_profile(str(path))
    assert before == dataclasses.replace(profile, router_s=0.0, kv_bytes_per_token=0)
    # Every role runs as the measured engine, with the tier's own batch limit if lower.
    model = role_model(profile, role("whatever", engine={"maxNumSeqs": 4}))
    assert model.costs == profile.costs
    assert model.shape.max_num_seqs == 4
    assert model.shape.kv_tokens == 8192
    assert model.shape.host_kv_tokens == 0
    # A host tier holds what its size holds of the measured engine's KV, in whole blocks:
    # 1 MiB / (768 B x 16) = 85 blocks.
    offloading = role("whatever", engine={"backend": "reference", "kvOffload": {"size": "1Mi"}})
    assert role_model(profile, offloading).shape.host_kv_tokens == 85 * 16
    # A profile from before host tiers cannot say.
    assert isinstance(before, MeasuredProfile)
    with pytest.raises(ProfileError, match="calibrate again"):
        role_model(before, offloading)


@pytest.mark.parametrize("text", ["b300", "/nonexistent/profile.json"])
def test_unknown_profiles_are_refused(text: str) -> None:
    with pytest.raises(ProfileError, match="not auto, a GPU"):
        load_profile(text)


def test_a_broken_profile_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"name": "x", "costs": {"decode_base_s": -1}}))
    with pytest.raises(ProfileError, match="not a measured profile"):
        load_profile(str(path))


def test_a_profile_file_too_deep_or_not_utf8_is_refused_in_one_line(tmp_path: Path) -> None:
    """Regression: a 100,000-deep profile file was a RecursionError traceback."""
    path = tmp_path / "p.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ProfileError, match="JSON nested deeper than 100 levels"):
        load_profile(str(path))
    path.write_bytes(b'{"name": "caf\xe9"}')
    with pytest.raises(ProfileError, match=r"not UTF-8 text \(byte 13: 0xe9\)"):
        load_profile(str(path))


def test_a_negative_router_hop_is_refused(tmp_path: Path) -> None:
    doc = json.loads((RESULTS / "simulate_profile_reference.json").read_text())
    doc["router_s"] = -0.001
    path = tmp_path / "p.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ProfileError, match="router_s"):
        load_profile(str(path))


def test_negative_costs_are_refused() -> None:
    with pytest.raises(ValueError, match="prefill_per_token_s"):
        EngineCosts(0.0, -1.0, 0.01, 0.0, 0.0)
