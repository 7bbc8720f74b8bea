"""`make cluster-demo`: the whole loop on Kubernetes, on this machine, then nothing left running.

The real control plane (e2e/controlplane), two process nodes (e2e/processnode) that run pods as
local processes, the chart's operator installed as `helm install` would (its templates rendered
by Helm's own engine, applied with `kubectl apply --server-side`), then what a user does:
`kubectl apply -f examples/cpu-two-tier.yaml`, `kubectl wait` for Ready, chats through the router
pod with the `openai` client showing the tier that served each and the prefix-cache hits, a
scale-up (the small tier's Deployment to 2 through /scale, as the autoscaler writes it) waited
for and served by the new pod, `kubectl get
inferenceservices,pods` as a user sees them, and teardown.

Needs root and Go (the process node) and kubectl. There is no kube-proxy or cluster DNS: the
router is reached at the address its Service's EndpointSlice lists.

    python -m fleetpilot.testing.cluster_demo [--dir .cache/cluster-demo]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import helm_python as helm
import openai
import yaml

from fleetpilot.engine.vllm_args import ENGINE_PORT
from fleetpilot.kube import names
from fleetpilot.operator.router_objects import ROUTER_PORT
from fleetpilot.testing.binaries import repo_root
from fleetpilot.testing.controlplane import ControlPlane
from fleetpilot.testing.polling import eventually
from fleetpilot.testing.processnode import ProcessNode, skip_reason

T = TypeVar("T")


def demo_wait(what: str, probe: Callable[[], T | None]) -> T:
    """A demo's wait: a TimeoutError (the demo's failure, not a test's) after two minutes."""
    return eventually(what, probe, 120.0, interval=0.5, error=TimeoutError)


NAMESPACE = "default"  # the example's
OPERATOR_NAMESPACE = "fleetpilot-system"
RELEASE = "fleetpilot"
SERVICE = "cpu"
NODES = ("demo-node-0", "demo-node-1")
#: A prompt long enough for a prefix-cache hit to show (the reference tokenizer is bytes:
#: about 900 tokens), short enough for the small tier's 2048.
SHARED_DOCUMENT = " ".join(f"line {i} of a long shared document." for i in range(25))


def say(text: str) -> None:
    print(text, flush=True)


class Kubectl:
    """kubectl against the demo's cluster; commands echoed as a user would type them."""

    def __init__(self, kubeconfig: Path) -> None:
        self.env = {**os.environ, "KUBECONFIG": str(kubeconfig)}

    def run(self, *args: str, stdin: str | None = None, echo: bool = True) -> str:
        if echo:
            say(f"$ kubectl {' '.join(args)}")
        result = subprocess.run(
            ["kubectl", *args], input=stdin, env=self.env, capture_output=True, text=True
        )
        if result.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)}: {result.stderr.strip()}")
        if echo and result.stdout.strip():
            say(result.stdout.rstrip())
        return result.stdout

    def json(self, *args: str) -> Any:
        return json.loads(self.run(*args, "-o", "json", echo=False))


def established(crd: dict[str, Any]) -> bool | None:
    """True once the CRD's Established condition is True; None before."""
    conditions = (crd.get("status") or {}).get("conditions") or []
    ok = any(c.get("type") == "Established" and c.get("status") == "True" for c in conditions)
    return True if ok else None


def install_operator(kubectl: Kubectl, root: Path) -> None:
    """The chart's CRDs, then its templates (hooks aside, as `helm install --no-hooks`)."""
    chart_dir = root / "charts" / "fleetpilot"
    kubectl.run("apply", "--server-side", "-f", str(chart_dir / "crds"))
    # Not `kubectl wait --for=condition=Established`: it fails at once, rather than waits, when
    # it reads the CRD before the API server has written any condition (".status.conditions
    # accessor error: <nil>"), which a busy machine showed.
    say("$ kubectl get crd/inferenceservices.fleetpilot.dev  # until Established")
    eventually(
        "the InferenceService CRD Established",
        lambda: established(kubectl.json("get", "crd/inferenceservices.fleetpilot.dev")),
        60.0,
        interval=0.2,
        error=TimeoutError,
    )
    kubectl.run("create", "namespace", OPERATOR_NAMESPACE)
    with helm.Chart.load(chart_dir) as chart:
        manifests = chart.render({}, name=RELEASE, namespace=OPERATOR_NAMESPACE, is_install=True)
    objects = [
        o
        for path in sorted(manifests)
        if path.endswith(".yaml")
        for o in yaml.safe_load_all(manifests[path])
        if o and "helm.sh/hook" not in o["metadata"].get("annotations", {})
    ]
    say(f"(the chart rendered: {', '.join(o['kind'] for o in objects)})")
    kubectl.run(
        "-n", OPERATOR_NAMESPACE, "apply", "--server-side", "-f", "-",
        stdin=yaml.safe_dump_all(objects),
    )  # fmt: skip
    deployment = next(o for o in objects if o["kind"] == "Deployment")["metadata"]["name"]
    kubectl.run(
        "-n", OPERATOR_NAMESPACE, "rollout", "status", f"deployment/{deployment}",
        "--timeout=120s",
    )  # fmt: skip


def router_address(kubectl: Kubectl) -> str | None:
    """The router pod's address from its Service's EndpointSlice (no kube-proxy here)."""
    selector = f"kubernetes.io/service-name={names.router_name(SERVICE)}"
    slices = kubectl.json("-n", NAMESPACE, "get", "endpointslices", "-l", selector)["items"]
    for s in slices:
        for e in s.get("endpoints") or []:
            if e.get("conditions", {}).get("ready"):
                return str(e["addresses"][0])
    return None


def chat(api: openai.OpenAI, model: str, text: str) -> tuple[str, Any]:
    raw = api.chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "user", "content": text}], max_tokens=8
    )
    return raw.headers.get("x-fleetpilot-route", ""), raw.parse().usage


def show(label: str, route: str, usage: Any) -> None:
    details = usage.prompt_tokens_details
    cached = details.cached_tokens if details is not None else 0
    say(
        f"  {label:<28} {route.split('; ')[0]:<12} prompt {usage.prompt_tokens:>4} tokens, "
        f"served from prefix cache {cached}"
    )


def engine_served(ip: str) -> float:
    """The engine's successful requests, from its own /metrics."""
    with urllib.request.urlopen(f"http://{ip}:{ENGINE_PORT}/metrics", timeout=5) as response:
        text = response.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:request_success_total")
    )


def demo(kubectl: Kubectl, root: Path) -> None:
    install_operator(kubectl, root)
    started = time.monotonic()
    kubectl.run("apply", "-f", str(root / "examples" / "cpu-two-tier.yaml"))
    kubectl.run(
        "-n", NAMESPACE, "wait", "--for=condition=Ready", f"inferenceservice/{SERVICE}",
        "--timeout=150s",
    )  # fmt: skip
    say(f"(Ready {time.monotonic() - started:.1f}s after the apply)")
    kubectl.run("-n", NAMESPACE, "get", "inferenceservices,pods", "-o", "wide")
    ip = demo_wait("the router's EndpointSlice address", lambda: router_address(kubectl))
    say(f"\n== chats through the router pod at {ip}:{ROUTER_PORT} (its EndpointSlice address)")
    with openai.OpenAI(
        base_url=f"http://{ip}:{ROUTER_PORT}/v1", api_key="unused", max_retries=0, timeout=60
    ) as api:
        show("easy question (auto)", *chat(api, "auto", "Hi! What is 2+2?"))
        show("asks for large-model", *chat(api, "large-model", "Hi! What is 2+2?"))
        show("long document, first time", *chat(api, "auto", SHARED_DOCUMENT))
        show("long document, again", *chat(api, "auto", SHARED_DOCUMENT))

        # Through the Deployment's /scale subresource, as the autoscaler's actuator writes it
        # (raising serving.replicas.min leaves an autoscaled tier's live replicas to the
        # autoscaler, which needs Prometheus, not run here).
        deployment = names.engine_name(SERVICE, "small", "unified")
        say(f"\n== scale-up: {deployment} to 2 replicas through /scale, as the autoscaler does")
        scaled = time.monotonic()
        kubectl.run("-n", NAMESPACE, "scale", f"deployment/{deployment}", "--replicas=2")
        selector = ",".join(
            f"{k}={v}" for k, v in names.engine_selector(SERVICE, "small", "unified").items()
        )

        def new_pod_ip() -> str | None:
            pods = kubectl.json("-n", NAMESPACE, "get", "pods", "-l", selector)["items"]
            ready = [
                p["status"]["podIP"]
                for p in pods
                if any(
                    c["type"] == "Ready" and c["status"] == "True"
                    for c in p["status"].get("conditions", [])
                )
            ]
            fresh = [i for i in ready if engine_served(i) == 0]
            return fresh[0] if len(ready) == 2 and fresh else None

        fresh_ip = demo_wait("a second small engine Ready", new_pod_ip)
        ready_s = time.monotonic() - scaled
        sent = 0
        while engine_served(fresh_ip) == 0:
            chat(api, "auto", f"Hi number {sent}!")
            sent += 1
            if time.monotonic() - scaled > 60:
                raise TimeoutError("the new engine served nothing in 60s")
        say(
            f"  new engine {fresh_ip} Ready {ready_s:.1f}s after the scale, serving after "
            f"{time.monotonic() - scaled:.1f}s ({sent} chats)"
        )
    # The service stays Ready through a scale-up: the operator counts the new replica in.
    kubectl.run(
        "-n", NAMESPACE, "wait", "--for=condition=Ready", f"inferenceservice/{SERVICE}",
        "--timeout=60s",
    )  # fmt: skip
    kubectl.run("-n", NAMESPACE, "get", "inferenceservices,pods", "-o", "wide")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fleetpilot.testing.cluster_demo")
    parser.add_argument("--dir", type=Path, default=None, help="work folder (default: a temp)")
    args = parser.parse_args(argv)
    reason = skip_reason()
    if reason is None and shutil.which("kubectl") is None:
        reason = "the demo runs kubectl, which is not on PATH"
    root = repo_root()
    if reason is None and root is None:
        reason = "the demo runs from a fleetpilot checkout"
    if reason is not None or root is None:
        print(f"cluster-demo: {reason}", file=sys.stderr)
        return 2
    workdir = args.dir or Path(tempfile.mkdtemp(prefix="fleetpilot-cluster-demo-"))
    begun = time.monotonic()
    say("== the control plane and two process nodes")
    plane = ControlPlane(workdir / "controlplane")
    plane.start()
    node = ProcessNode(
        plane.kubeconfig, workdir / "processnode", NODES, backoff_base_s=1.0, taints=()
    )
    leftovers: list[int] = []
    try:
        node.start()
        try:
            kubectl = Kubectl(plane.kubeconfig)
            kubectl.run("get", "nodes")
            demo(kubectl, root)
        finally:
            say("\n== teardown")
            node.stop()
    finally:
        plane.stop()
        leftovers = plane.leftover_processes()
    say(f"processes left behind: {leftovers}")
    say(f"(the demo took {time.monotonic() - begun:.0f}s)")
    if leftovers:
        return 1
    if args.dir is None:
        shutil.rmtree(workdir, ignore_errors=True)  # logs are kept only where asked for
    return 0


if __name__ == "__main__":
    sys.exit(main())
