"""Which engine pods the operator syncs adapters into, at which address, with which list (the
calls themselves: tests/engine/test_adapter_client.py, and e2e/test_operator.py on the real
control plane)."""

from __future__ import annotations

from typing import Any

from fleetpilot.api import InferenceService
from fleetpilot.operator.adapter_loading import EngineTarget, dynamic_tiers, engines_to_sync
from fleetpilot.operator.handlers import loads_adapters_at_run_time
from tests.factories import make_manifest, make_service, make_tier


def _service(*, dynamic: bool = True) -> InferenceService:
    lora = make_tier(
        "lora",
        adapters=[{"name": "tax", "source": {"pvc": {"claimName": "loras", "path": "tax"}}}],
    )
    lora["lora"] = {"dynamic": dynamic}
    return make_service(tiers=[make_tier("plain", up_to=0.5), lora])


def _pod(name: str, tier: str, ip: str | None = "10.1.2.3", ready: bool = True) -> dict[str, Any]:
    status: dict[str, Any] = {
        "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]
    }
    if ip:
        status["podIP"] = ip
    labels = {"fleetpilot.dev/service": "chat", "fleetpilot.dev/tier": tier}
    return {"metadata": {"name": name, "labels": labels}, "status": status}


def test_only_ready_pods_of_dynamic_tiers_are_synced_each_with_its_tiers_list() -> None:
    pods = [
        _pod("chat-lora-b", "lora"),
        _pod("chat-lora-a", "lora", ip="fd00::5"),
        _pod("chat-lora-starting", "lora", ready=False),
        _pod("chat-lora-no-ip", "lora", ip=None),
        _pod("chat-plain-a", "plain"),
    ]
    gone = _pod("chat-lora-gone", "lora")
    gone["metadata"]["deletionTimestamp"] = "2026-12-03T00:00:00Z"
    adapters = {"tax": "/adapter-volumes/loras/tax"}
    assert engines_to_sync(_service(), [*pods, gone]) == [
        EngineTarget("chat-lora-a", "lora", "http://[fd00::5]:8000", adapters),
        EngineTarget("chat-lora-b", "lora", "http://10.1.2.3:8000", adapters),
    ]
    assert engines_to_sync(_service(dynamic=False), pods) == []


def test_only_the_leader_of_a_multi_node_group_is_synced() -> None:
    """A multi-node replica's workers run vllm --headless (no API): the operator calls the
    leader, which loads the adapter for the whole group."""
    leader, worker = _pod("chat-lora-0", "lora"), _pod("chat-lora-0-1", "lora", ip="10.1.2.4")
    leader["metadata"]["labels"]["leaderworkerset.sigs.k8s.io/worker-index"] = "0"
    worker["metadata"]["labels"]["leaderworkerset.sigs.k8s.io/worker-index"] = "1"
    targets = engines_to_sync(_service(), [leader, worker])
    assert [t.pod for t in targets] == ["chat-lora-0"]


def test_a_dynamic_tier_with_no_adapters_is_synced_to_none() -> None:
    """Emptying the list unloads everything: the tier is still dynamic, its list is empty."""
    tier = make_tier("lora")
    tier["lora"] = {"dynamic": True}
    assert dynamic_tiers(make_service(tiers=[tier])) == {"lora": {}}


def test_the_quick_look_agrees_with_the_parsed_service() -> None:
    for dynamic in (True, False):
        tier = make_tier("lora")
        tier["lora"] = {"dynamic": dynamic}
        manifest = make_manifest("chat", tiers=[make_tier("plain", up_to=0.5), tier])
        assert loads_adapters_at_run_time(manifest) is dynamic
    assert not loads_adapters_at_run_time({"spec": {"tiers": [{"name": "x"}]}})
    assert not loads_adapters_at_run_time({})
