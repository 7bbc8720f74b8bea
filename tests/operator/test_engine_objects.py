"""Engine pods of a tier with ``engine.backend: reference``: the CPU reference engine a
GPU-less cluster (kind, a GitOps CI job) runs.

Protects: the pod runs the reference image with the one shared command (the local runtime's
mapping, bound as a pod binds), asks for no GPU and lands on any node, asks for the CPU and
memory it was sized for, keeps a vLLM pod's ports and probes, plans no model download, and -
the point of it all - its planned command, run as a process with the pod's environment,
really serves /health and a chat completion.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from fleetpilot.api import parse_service
from fleetpilot.engine.reference import settings
from fleetpilot.engine.reference_launch import POD_DRAIN_GRACE_S, reference_engine_args
from fleetpilot.engine.vllm_args import launch_for
from fleetpilot.operator.engine_objects import REFERENCE_RESOURCES
from fleetpilot.operator.plan_types import K8sObject, PlanOptions
from fleetpilot.operator.planner import plan
from fleetpilot.routing.policies.pd import decode_request, kv_params_of, prefill_request
from fleetpilot.runtime.processes import free_ports
from fleetpilot.testing.polling import eventually
from tests.factories import make_manifest, make_service, make_tier

REFERENCE = {"backend": "reference"}
IMAGE = "registry.example/fleetpilot-reference:test"


def reference_tier(name: str = "small", **extra: Any) -> dict[str, Any]:
    engine = {**REFERENCE, **extra.pop("engine", {})}
    return make_tier(name, model="reference-tiny", engine=engine, **extra)


def planned(*tiers: dict[str, Any], **spec: Any) -> list[K8sObject]:
    service = make_service(tiers=list(tiers), **spec)
    return plan(service, PlanOptions(reference_image=IMAGE))


def deployment(objects: list[K8sObject], name: str) -> K8sObject:
    (found,) = [o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == name]
    return found


def pod_spec(objects: list[K8sObject], name: str) -> dict[str, Any]:
    return deployment(objects, name)["spec"]["template"]["spec"]  # type: ignore[no-any-return]


def engine_settings(args: list[str]) -> settings.ServerSettings:
    """What the reference engine's own parser and checks make of ``args``."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend")
    settings.add_arguments(parser)
    server_settings, _ = settings.settings_from_args(parser.parse_args(args))
    return server_settings


def test_reference_pod_runs_the_shared_command_from_the_reference_image() -> None:
    """The engine container is the reference image's ``fleetpilot engine`` with exactly the
    flags of the one mapping (engine.reference_launch) for the tier's launch, bound as a pod:
    every interface, the planned port, the tier's preset and settings - flags the reference
    engine itself accepts."""
    tier = reference_tier(engine={"referenceModel": "small", "maxNumSeqs": 32})
    tier["model"] = {"name": "reference-small", "maxModelLen": 3000}
    service = make_service(tiers=[tier])
    (container,) = pod_spec(planned(tier), "chat-small")["containers"]
    assert container["image"] == IMAGE
    assert container["command"] == ["fleetpilot", "engine"]
    role = service.spec.tiers[0].roles()[0]
    assert container["args"] == reference_engine_args(
        launch_for(role), None, "small", POD_DRAIN_GRACE_S
    )
    engine = engine_settings(container["args"])
    assert (engine.host, engine.port) == ("0.0.0.0", 8000)
    assert engine.served_model_names == ("reference-small",)
    assert engine.max_model_len == 3000
    assert engine.drain_grace_s == POD_DRAIN_GRACE_S
    assert engine.kv_events.active


def test_reference_pod_asks_for_no_gpu_and_lands_on_any_node() -> None:
    """No nvidia.com/gpu request, GPU toleration or GPU product selector (a kind node has none:
    the pod would stay Pending), even where the tier names a GPU product; the spec's own
    scheduling is kept. CPU and memory are the reference engine's sizing, not the GPU
    defaults (8 CPUs, 64Gi), and the workload says it takes no GPU."""
    tier = reference_tier(resources={"gpuProduct": "NVIDIA-H100-80GB-HBM3", "cpu": "8"})
    scheduling = {
        "nodeSelector": {"pool": "cpu"},
        "tolerations": [{"key": "spot", "operator": "Exists", "effect": "NoSchedule"}],
    }
    objects = planned(tier, scheduling=scheduling)
    spec = pod_spec(objects, "chat-small")
    assert "gpu" not in json.dumps(spec).lower()
    assert spec["nodeSelector"] == {"pool": "cpu"}
    assert spec["tolerations"] == [{"key": "spot", "operator": "Exists", "effect": "NoSchedule"}]
    assert spec["containers"][0]["resources"] == REFERENCE_RESOURCES
    annotations = deployment(objects, "chat-small")["metadata"]["annotations"]
    assert annotations["fleetpilot.dev/gpus-per-replica"] == "0"
    bare = pod_spec(planned(reference_tier()), "chat-small")
    assert "tolerations" not in bare
    assert "nodeSelector" not in bare


def test_reference_pod_keeps_the_vllm_pods_ports_probes_and_pod_settings() -> None:
    """Ports (HTTP, KV events and replay: the router subscribes to them), probes, grace period,
    security and the unmounted token are a vLLM pod's: the router, the NetworkPolicy and the
    Deployment's rollout treat both engines alike. Only the start is probed more often: a new
    reference pod is Ready seconds after it starts, not at the next 10-second probe."""
    vllm = pod_spec(planned(make_tier("small")), "chat-small")
    reference = pod_spec(planned(reference_tier()), "chat-small")
    (v,) = vllm["containers"]
    (r,) = reference["containers"]
    for key in ("ports", "readinessProbe", "livenessProbe", "securityContext"):
        assert r[key] == v[key], key
    # Started in seconds, not minutes: probed every 2 s, for as long as 4 minutes.
    assert r["startupProbe"] == v["startupProbe"] | {"periodSeconds": 2, "failureThreshold": 120}
    for key in (
        "terminationGracePeriodSeconds",
        "serviceAccountName",
        "automountServiceAccountToken",
        "securityContext",
        "topologySpreadConstraints",
    ):
        assert reference[key] == vllm[key], key


def test_reference_tier_plans_no_model_download() -> None:
    """The reference model is built from a seed: beside a vLLM tier of a service with a model
    cache, only the vLLM tier's weights get a download Job, and the reference pods wait for
    none, mount no cache or model volume and run no init container."""
    tiers = [make_tier("big", up_to=0.5), reference_tier("cheap")]
    objects = planned(*tiers, modelCache={"size": "100Gi"})
    fetches = [o for o in objects if o["kind"] == "Job" and "-fetch-" in o["metadata"]["name"]]
    assert [j["metadata"]["annotations"]["fleetpilot.dev/model"] for j in fetches] == [
        "Qwen/Qwen2.5-7B-Instruct@main"
    ]
    spec = pod_spec(objects, "chat-cheap")
    assert spec["volumes"] == [{"name": "cache", "emptyDir": {}}]
    assert "initContainers" not in spec
    annotations = deployment(objects, "chat-cheap")["metadata"]["annotations"]
    assert "fleetpilot.dev/model-fetch-job" not in annotations
    assert "HF_HUB_OFFLINE" not in json.dumps(spec)


def test_reference_pd_pods_advertise_their_pod_ip_for_the_hand_off() -> None:
    """A P/D reference tier's engines take both sides of the hand-off (vLLM's kv_both with
    NIXL), advertise the pod's IP (the kubelet expands $(POD_IP) from status.podIP) and take
    KV from peer pods at any address (the NetworkPolicy admits only the service's engines)."""
    objects = planned(reference_tier(mode="disaggregated"))
    for role in ("prefill", "decode"):
        (container,) = pod_spec(objects, f"chat-small-{role}")["containers"]
        assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in (
            container["env"]
        )
        args = [kubelet_expand(a, {"POD_IP": "10.244.0.7"}) for a in container["args"]]
        engine = engine_settings(args)
        assert engine.kv.role == "both"
        assert engine.kv.advertise_host == "10.244.0.7"
        assert engine.kv.allowed_remote_hosts.allows_pull("10.244.3.9", 8000)
        assert engine.kv.allowed_remote_hosts.allows_caller("10.244.3.9")


def kubelet_expand(value: str, env: dict[str, str]) -> str:
    """The kubelet's $(VAR) expansion of a container's command and args."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), value)


# -- the planned command, run -------------------------------------------------------------


def pod_process(
    container: dict[str, Any], tmp_path: Path, pod_ip: str
) -> tuple[list[str], dict[str, str], dict[int, int]]:
    """The container as a process on this machine, as a node would run it: the image's
    ``fleetpilot`` is this environment's, the env is the pod's (downward-API fields resolved,
    the emptyDir mounts as folders), $(VAR) expanded. A pod's own network namespace is what
    frees its fixed ports; on a shared machine each planned port maps to a free one instead
    (the returned map), changed wherever the command names it - free on every interface, as
    the pod binds them (a port free on loopback may still be held elsewhere)."""
    assert container["command"][0] == "fleetpilot"
    mounts = {m["mountPath"]: tmp_path / m["name"] for m in container["volumeMounts"]}
    for folder in mounts.values():
        folder.mkdir(exist_ok=True)
    env: dict[str, str] = {}
    for item in container["env"]:
        if "value" in item:
            value = item["value"]
            for mount, folder in mounts.items():
                if value == mount or value.startswith(f"{mount}/"):
                    value = str(folder) + value[len(mount) :]
            env[item["name"]] = value
        else:
            assert item["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
            env[item["name"]] = pod_ip
    planned_ports = [p["containerPort"] for p in container["ports"]]
    ports = dict(zip(planned_ports, free_ports(len(planned_ports), "0.0.0.0"), strict=True))
    argv = [sys.executable, "-m", "fleetpilot", *container["command"][1:], *container["args"]]
    argv = [kubelet_expand(a, env) for a in argv]
    for planned_port, port in ports.items():
        argv = [
            str(port) if a == str(planned_port) else a.replace(f':{planned_port}"', f':{port}"')
            for a in argv
        ]
    keep = {k: os.environ[k] for k in ("PATH", "PYTHONPATH") if k in os.environ}
    return argv, {**keep, **env}, ports


@contextlib.contextmanager
def run_pod(container: dict[str, Any], folder: Path, pod_ip: str) -> Iterator[str]:
    """The container running as :func:`pod_process` starts it, until /health answers 200;
    yields its base URL (at ``pod_ip``)."""
    folder.mkdir()
    argv, env, ports = pod_process(container, folder, pod_ip)
    log_path = folder / "engine.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            url = f"http://{pod_ip}:{ports[8000]}"

            def healthy() -> int | None:
                if process.poll() is not None:
                    raise AssertionError(f"the engine exited: {log_path.read_text()}")
                status = httpx.get(f"{url}/health", timeout=2).status_code
                return status if status == 200 else None

            eventually(
                "the engine's /health",
                healthy,
                120,
                interval=0.2,
                ignoring=(httpx.TransportError,),
                context=log_path.read_text,
            )
            yield url
        finally:
            process.terminate()
            try:
                process.wait(timeout=POD_DRAIN_GRACE_S + 10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def served_tier(mode: str) -> list[K8sObject]:
    tier = reference_tier(mode=mode, engine={"maxNumSeqs": 4})
    tier["model"] |= {"servedName": "cpu-model", "maxModelLen": 512}
    return planned(tier)


@pytest.fixture
def running(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, str]]:
    """The planned engine container of the role ``request.param`` running; yields its base URL
    and served model name."""
    objects = served_tier(request.param)
    name = "chat-small" if request.param == "unified" else "chat-small-prefill"
    (container,) = pod_spec(objects, name)["containers"]
    with run_pod(container, tmp_path / "pod", "127.0.0.1") as url:
        yield url, "cpu-model"


@pytest.mark.parametrize("running", ["unified", "disaggregated"], indirect=True)
def test_planned_reference_command_serves_health_and_chat(running: tuple[str, str]) -> None:
    """The planned container command really starts an engine (not just parses): run with the
    pod's environment (for P/D, the prefill pod, whose args take $(POD_IP)), it answers
    /health 200 and a chat completion under the tier's served name, and reports its KV cache
    as vLLM does."""
    url, model = running
    reply = httpx.post(
        f"{url}/v1/chat/completions",
        json={"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 5},
        timeout=60,
    )
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["model"] == model
    assert body["usage"]["completion_tokens"] == 5
    metrics = httpx.get(f"{url}/metrics", timeout=10).text
    assert "vllm:kv_cache_usage_perc" in metrics


def test_vllm_tier_ignores_the_reference_preset() -> None:
    """engine.referenceModel set on a vLLM tier changes nothing of its pods (it has a default,
    so a stored object always carries one)."""
    plain = planned(make_tier("small"))
    named = planned(make_tier("small", engine={"referenceModel": "small"}))
    assert plain == named
    assert parse_service(make_manifest()).spec.tiers[0].engine.backend.value == "vllm"


def test_planned_pd_pods_hand_off_kv_between_pod_addresses(tmp_path: Path) -> None:
    """A P/D reference tier's planned prefill and decode pods, each run with its own pod IP,
    complete the router's two hops: the prefill answers a KV handle advertising its pod IP
    (its $(POD_IP), expanded as the kubelet does), and the decode pulls the prompt's KV from
    there rather than computing it again (no fallback counted)."""
    objects = served_tier("disaggregated")
    (prefill,) = pod_spec(objects, "chat-small-prefill")["containers"]
    (decode,) = pod_spec(objects, "chat-small-decode")["containers"]
    body = {
        "model": "cpu-model",
        "messages": [{"role": "user", "content": "a prompt long enough to fill blocks " * 4}],
        "max_tokens": 6,
    }
    with (
        run_pod(prefill, tmp_path / "prefill", "127.0.0.2") as prefill_url,
        run_pod(decode, tmp_path / "decode", "127.0.0.3") as decode_url,
    ):
        first = httpx.post(
            f"{prefill_url}/v1/chat/completions",
            json=prefill_request(body, "cpu-model"),
            timeout=60,
        )
        assert first.status_code == 200, first.text
        handle = kv_params_of(first.json())
        assert handle is not None
        assert handle["remote_host"] == "127.0.0.2"
        second = httpx.post(
            f"{decode_url}/v1/chat/completions",
            json=decode_request(body, "cpu-model", handle),
            timeout=60,
        )
        assert second.status_code == 200, second.text
        assert second.json()["usage"]["completion_tokens"] == 6
        metrics = httpx.get(f"{decode_url}/metrics", timeout=10).text
        fallbacks = [
            line
            for line in metrics.splitlines()
            if line.startswith("fleetpilot_kv_transfer_fallbacks_total")
        ]
        assert fallbacks
        assert all(line.endswith(" 0.0") for line in fallbacks), fallbacks


# -- a host KV tier (engine.kvOffload): memory and /dev/shm of the pod ------------------------


def _vllm_offload_tier(size: str, **extra: Any) -> dict[str, Any]:
    resources = {
        "gpuProduct": "NVIDIA-H100-80GB-HBM3",
        "memory": "64Gi",
        **extra.pop("resources", {}),
    }
    return make_tier(
        "main",
        model="meta-llama/Llama-3.1-8B-Instruct",
        engine={"kvOffload": {"size": size}},
        resources=resources,
        **extra,
    )


def _engine(spec: dict[str, Any]) -> dict[str, Any]:
    return spec["containers"][0]  # type: ignore[no-any-return]


def _volume(spec: dict[str, Any], name: str) -> dict[str, Any] | None:
    return next((v for v in spec["volumes"] if v["name"] == name), None)


def test_a_host_kv_tier_grows_the_vllm_pods_memory_and_dev_shm() -> None:
    """vLLM pins the host tier in a /dev/shm file of the pod: its memory request and limit
    grow by the tier and a 10% margin (64Gi + 70.4Gi = 137626Mi), and even a one-GPU pod
    mounts a /dev/shm of the tier's size plus resources.sharedMemory (the runtime's 64 MiB
    would make vLLM refuse to start). Without a tier, the spec's quantity as written."""
    spec = pod_spec(planned(_vllm_offload_tier("64Gi")), "chat-main")
    resources = _engine(spec)["resources"]
    assert resources["requests"]["memory"] == resources["limits"]["memory"] == "137626Mi"
    assert resources["requests"]["nvidia.com/gpu"] == "1"
    assert _volume(spec, "dshm") == {
        "name": "dshm",
        "emptyDir": {"medium": "Memory", "sizeLimit": f"{80 * 1024}Mi"},  # 16Gi + 64Gi
    }
    assert {"name": "dshm", "mountPath": "/dev/shm"} in _engine(spec)["volumeMounts"]
    plain = make_tier("main", model="meta-llama/Llama-3.1-8B-Instruct")
    spec = pod_spec(planned(plain), "chat-main")
    assert _engine(spec)["resources"]["requests"]["memory"] == "64Gi"
    assert _volume(spec, "dshm") is None


def test_each_data_parallel_engine_of_a_pod_has_its_own_host_tier() -> None:
    """--kv-offloading-size is per engine: a pod of 2 data-parallel ranks holds two tiers."""
    spec = pod_spec(planned(_vllm_offload_tier("10Gi", parallelism={"data": 2})), "chat-main")
    assert _engine(spec)["resources"]["limits"]["memory"] == f"{64 * 1024 + 22528}Mi"
    assert _volume(spec, "dshm") == {
        "name": "dshm",
        "emptyDir": {"medium": "Memory", "sizeLimit": f"{(16 + 20) * 1024}Mi"},
    }


def test_the_pods_of_an_engine_over_two_nodes_each_fill_half_its_host_tier() -> None:
    """One engine over two nodes (tensor 8 x pipeline 2 on nodes of 8): each pod's workers
    fill their own half of the tier, so each asks for half (with the margin); but vLLM checks
    /dev/shm has room for the whole region on every node before mapping it."""
    tier = _vllm_offload_tier("200Gi", parallelism={"tensor": 8, "pipeline": 2})
    tier["model"] = {"name": "meta-llama/Llama-3.1-405B-Instruct"}
    objects = plan(make_service(tiers=[tier]))
    (group,) = [o for o in objects if o["kind"] == "LeaderWorkerSet"]
    templates = group["spec"]["leaderWorkerTemplate"]
    for template in (templates["leaderTemplate"], templates["workerTemplate"]):
        spec = template["spec"]
        assert _engine(spec)["resources"]["requests"]["memory"] == f"{64 * 1024 + 112640}Mi"
        assert _volume(spec, "dshm") == {
            "name": "dshm",
            "emptyDir": {"medium": "Memory", "sizeLimit": f"{(16 + 200) * 1024}Mi"},
        }


def test_a_reference_pods_memory_grows_by_its_host_tier() -> None:
    """The reference engine holds its host tier in its own memory (no /dev/shm): its pod's
    1Gi grows by the tier and the margin, in the request and the limit; CPU as before."""
    spec = pod_spec(planned(reference_tier(engine={"kvOffload": {"size": "512Mi"}})), "chat-small")
    resources = _engine(spec)["resources"]
    assert resources["requests"] == {"cpu": "1", "memory": f"{1024 + 564}Mi"}
    assert resources["limits"] == {"cpu": "2", "memory": f"{1024 + 564}Mi"}
    assert _volume(spec, "dshm") is None
    assert (
        pod_spec(planned(reference_tier()), "chat-small")["containers"][0]["resources"]
        == REFERENCE_RESOURCES
    )
