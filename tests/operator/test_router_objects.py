"""The router of a service with CPU reference tiers: it tokenizes prompts with the reference
engine's own tokenizer files, carried in its ConfigMap, so the engines' KV events (block
hashes of token ids) match what it routes. A vLLM-only service's router is unchanged."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import yaml

from fleetpilot.api import load_services
from fleetpilot.api.router_config import ROUTER_CONFIG_FILE, RouterConfig
from fleetpilot.engine.reference.tokenizer import ByteTokenizer
from fleetpilot.engine.reference_launch import REFERENCE_TOKENIZER
from fleetpilot.operator.plan_types import K8sObject
from fleetpilot.operator.planner import plan
from fleetpilot.operator.router_objects import REFERENCE_TOKENIZER_DIR
from fleetpilot.routing.cli import SHUTDOWN_TIMEOUT_S, add_arguments
from fleetpilot.routing.tokenizer.request import load_tokenizer
from tests.factories import make_service, make_tier

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def router_parts(objects: list[K8sObject]) -> tuple[dict[str, str], dict[str, Any]]:
    """The router's ConfigMap data and pod spec."""
    (config_map,) = [o for o in objects if o["kind"] == "ConfigMap"]
    (deployment,) = [
        o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"].endswith("router")
    ]
    return config_map["data"], deployment["spec"]["template"]["spec"]


def mounted(data: dict[str, str], pod: dict[str, Any], path: str, root: Path) -> Path:
    """The folder the router container sees at ``path``, written from the ConfigMap as the
    kubelet projects a configMap volume's items."""
    (container,) = pod["containers"]
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == path]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    folder = root / path.strip("/")
    folder.mkdir(parents=True)
    for item in volume["configMap"]["items"]:
        (folder / item["path"]).write_text(data[item["key"]], encoding="utf-8")
    return folder


def test_the_router_tokenizes_as_the_reference_engines_do(tmp_path: Path) -> None:
    """Each reference tier's router config names the mounted tokenizer folder; the folder the
    pod gets from the ConfigMap holds the package's files byte for byte, and the router's own
    loader reads from it the token ids the engines compute (their byte tokenizer)."""
    (service,) = load_services(EXAMPLES / "cpu-two-tier.yaml")
    data, pod = router_parts(plan(service))
    config = RouterConfig.model_validate(yaml.safe_load(data[ROUTER_CONFIG_FILE]))
    assert {tier.tokenizer for tier in config.tiers} == {REFERENCE_TOKENIZER_DIR}
    folder = mounted(data, pod, REFERENCE_TOKENIZER_DIR, tmp_path)
    for file in REFERENCE_TOKENIZER.iterdir():
        assert (folder / file.name).read_bytes() == file.read_bytes(), file.name
    text = "Route me by my prefix: déjà vu, 42."
    ids = load_tokenizer(str(folder)).token_ids("completions", {"prompt": text})
    assert ids == ByteTokenizer().encode(text)


def test_a_vllm_only_router_carries_no_reference_tokenizer() -> None:
    """Without a reference tier the ConfigMap holds the router config alone and the pod mounts
    no tokenizer copy (the byte-identical plans of GPU services)."""
    data, pod = router_parts(plan(make_service(tiers=[make_tier("small")])))
    assert list(data) == [ROUTER_CONFIG_FILE]
    assert "reference-tokenizer" not in str(pod)


def test_a_deleted_router_pod_serves_on_then_drains_within_its_grace_period() -> None:
    """The router pod's flags, as the router's own parser reads them, keep it serving for a
    while after SIGTERM (clients learn late that it left its Service); the delay and the
    drain that follows both fit in the pod's grace period, so no reply is cut by SIGKILL."""
    _, pod = router_parts(plan(make_service(tiers=[make_tier("small")])))
    (container,) = pod["containers"]
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(container["args"])
    assert args.shutdown_delay > 0
    assert pod["terminationGracePeriodSeconds"] >= args.shutdown_delay + SHUTDOWN_TIMEOUT_S
