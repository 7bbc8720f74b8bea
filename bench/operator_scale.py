"""The operator at scale, on the real control plane: N InferenceServices applied at once.

For each N (default 200 and 1,000), on a fresh control plane (etcd, kube-apiserver,
controller-manager, scheduler built from Go modules; no kubelet, so the pods stay Pending):

- **settle time**: from the first apply until every service has its engine and router
  Deployments and a status of its generation;
- **operator memory**: the `fleetpilot operator` process's resident set when settled, and its
  peak (VmHWM);
- **API writes of a settled resync**: the operator is restarted (kopf resumes every service,
  a full reconcile each) and the API server's own `apiserver_request_total` counts the writes
  (POST/PUT/PATCH/APPLY/DELETE) to the kinds the operator manages, from the restart until
  every service has been reconciled again. Goal: 0 - an unchanged service costs no write.
  The controller-manager and scheduler write too (pods, events, leases), so only the
  operator's kinds are counted; Events are reported apart.

Goals (issue 17): 1,000 services settled in under 2 minutes; memory under 500 MB.

The baseline arm (`--arms direct`) is the floor no operator can beat on this machine: no
operator runs, and the bench itself applies each service's planned objects and one status write
as soon as the service is applied - the same writes, with no reads, no Events, no kopf. What the
control plane spends on them (and on the ReplicaSets, pods and Events the controllers make in
turn) is on the same two cores; the CPU seconds each process used are reported.

Run: .venv/bin/python bench/operator_scale.py [--services 200 1000] [--save] [--no-resync]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import yaml
from router_support import machine as machine_info
from router_support import measured_at, process_memory_mib

from fleetpilot.api import parse_service
from fleetpilot.kube.client import Kube, KubeError
from fleetpilot.kube.managers import OPERATOR_MANAGER
from fleetpilot.operator.planner import plan
from fleetpilot.runtime.processes import free_ports
from fleetpilot.testing.controlplane import ControlPlane

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
NAMESPACE = "scale"
MANAGER = "bench"
POLL_S = 5.0
ALL_VERBS = {"GET", "LIST", "WATCH", "POST", "PUT", "PATCH", "APPLY", "DELETE"}
WRITE_VERBS = {"POST", "PUT", "PATCH", "APPLY", "DELETE"}
# What the operator writes (and kopf, on InferenceServices); Events are counted apart.
OPERATOR_KINDS = {
    "inferenceservices",
    "deployments",
    "services",
    "configmaps",
    "serviceaccounts",
    "roles",
    "rolebindings",
    "poddisruptionbudgets",
    "networkpolicies",
}
# What the chart's operator Deployment sets in the environment (templates/deployment.yaml).
CHART_ENV = {"PYTHONUNBUFFERED": "1", "MALLOC_ARENA_MAX": "2"}
CRDS = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
SAMPLE = re.compile(r"^apiserver_request_total\{(?P<labels>[^}]*)\} (?P<value>\S+)$")
LABEL = re.compile(r'(\w+)="([^"]*)"')


# The tier's autoscaling mode (--autoscaling): None leaves the default (autoscaled).
AUTOSCALING_MODE: str | None = None


def service(index: int) -> dict[str, Any]:
    tier: dict[str, Any] = {
        "name": "small",
        "model": {"name": "meta-llama/Llama-3.1-8B-Instruct"},
        "resources": {"gpuProduct": "NVIDIA-H100-80GB-HBM3"},
        "serving": {"replicas": {"min": 1, "max": 4}},
    }
    if AUTOSCALING_MODE is not None:
        tier["autoscaling"] = {"mode": AUTOSCALING_MODE}
    return {
        "apiVersion": "fleetpilot.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": f"svc-{index:04d}", "namespace": NAMESPACE},
        "spec": {
            "routing": {"replicas": 1},
            "tiers": [tier],
        },
    }


def api_writes(kube: Kube, verbs: set[str] | None = None, code: str | None = None) -> Counter[str]:
    """The API server's request counts by resource[/subresource], from its /metrics: the
    writes, or the requests of ``verbs``; only those answered ``code`` if given."""
    response = kube.api.call_api(
        "GET", f"{kube.api.configuration.host}/metrics", header_params={"Accept": "text/plain"}
    )
    text = response.read().decode()  # type: ignore[no-untyped-call]
    counts: Counter[str] = Counter()
    for line in text.splitlines():
        match = SAMPLE.match(line)
        if not match:
            continue
        labels = dict(LABEL.findall(match["labels"]))
        if labels.get("verb") not in (verbs or WRITE_VERBS):
            continue
        if code is not None and labels.get("code") != code:
            continue
        resource = labels.get("resource", "")
        if labels.get("subresource"):
            resource += "/" + labels["subresource"]
        counts[resource] += int(float(match["value"]))
    return counts


def _operators(resource: str) -> bool:
    """A write the operator (or kopf) makes: its kinds, and of subresources only its status
    (a Deployment's or PDB's status is the controller-manager's)."""
    kind, _, sub = resource.partition("/")
    return kind in OPERATOR_KINDS and (not sub or resource == "inferenceservices/status")


def wait_quiet(kube: Kube, timeout_s: float, window_s: float = 10.0) -> float:
    """Seconds until a ``window_s`` passes with no write but Events and Leases (the
    controllers' heartbeats); gives up after ``timeout_s``."""
    started = time.monotonic()
    last = api_writes(kube)
    while time.monotonic() - started < timeout_s:
        time.sleep(window_s)
        now = api_writes(kube)
        busy = {k for k in now if now[k] != last[k] and k.split("/")[0] not in ("events", "leases")}
        if not busy:
            break
        last = now
    return time.monotonic() - started


def cpu_s(pid: int) -> float:
    """User plus system CPU seconds a process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_by_process(
    plane: ControlPlane, operator: subprocess.Popen[bytes] | None
) -> dict[str, float]:
    writer = {"operator": operator.pid} if operator else {"bench (direct writes)": os.getpid()}
    return {name: cpu_s(pid) for name, pid in {**plane.pids, **writer}.items()}


def write_directly(kube: Kube, index: int) -> None:
    """The direct arm: what the operator writes for a new service, with nothing else."""
    live = kube.apply(service(index), MANAGER)
    for obj in plan(parse_service(live)):
        kube.apply(obj, OPERATOR_MANAGER)
    meta = live["metadata"]
    kube.patch_status(
        "InferenceService",
        NAMESPACE,
        meta["name"],
        {"observedGeneration": meta["generation"]},
        OPERATOR_MANAGER,
    )


def start_operator(kubeconfig: Path, metrics_port: int, log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(
            [
                sys.executable, "-m", "fleetpilot", "operator",
                "--kubeconfig", str(kubeconfig), "--namespace", NAMESPACE, "--standalone",
                "--bind", "127.0.0.1", "--liveness-port", "0",
                "--metrics-port", str(metrics_port), "--log-format", "json",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **CHART_ENV},
        )  # fmt: skip


def reconciles(metrics_port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return 0
    return sum(
        int(float(line.rsplit(" ", 1)[1]))
        for line in text.splitlines()
        if line.startswith("fleetpilot_operator_reconciles_total{")
    )


def settled(kube: Kube, count: int) -> int:
    """How many services have both Deployments and a status of their generation."""
    services = kube.request(
        "GET", f"/apis/fleetpilot.dev/v1alpha1/namespaces/{NAMESPACE}/inferenceservices"
    )["items"]
    deployments = {
        d["metadata"]["name"]
        for d in kube.request("GET", f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments")["items"]
    }
    done = 0
    for item in services:
        name = item["metadata"]["name"]
        status = item.get("status") or {}
        if (
            status.get("observedGeneration") == item["metadata"]["generation"]
            and f"{name}-small" in deployments
            and f"{name}-router" in deployments
        ):
            done += 1
    return done


def stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        os.killpg(process.pid, 15)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)
            process.wait()


def run(
    count: int, workdir: Path, timeout_s: float, arm: str, resync: bool = True
) -> dict[str, Any]:
    plane = ControlPlane(workdir / "plane")
    plane.start()
    operator: subprocess.Popen[bytes] | None = None
    try:
        with plane.api_client() as api:
            kube = Kube(api)
            for crd in sorted((REPO / "crds").glob("*.yaml")):
                body = yaml.safe_load(crd.read_text())
                kube.request(
                    "PATCH",
                    f"{CRDS}/{body['metadata']['name']}",
                    query=[("fieldManager", MANAGER), ("force", "true")],
                    body=body,
                    content_type="application/apply-patch+yaml",
                )
            kube.request(
                "POST",
                "/api/v1/namespaces",
                body={"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}},
            )
            time.sleep(3)  # the CRD served
            (metrics_port,) = free_ports(1)
            log = workdir / "operator.log"
            if arm == "operator":
                operator = start_operator(plane.kubeconfig, metrics_port, log)
                time.sleep(3)
            requests_before = api_writes(kube, ALL_VERBS)
            conflicts_before = api_writes(kube, ALL_VERBS, "409")
            cpu_before = cpu_by_process(plane, operator)
            started = time.monotonic()
            with ThreadPoolExecutor(16) as pool:
                if operator is not None:
                    list(pool.map(lambda i: kube.apply(service(i), MANAGER), range(count)))
                else:
                    list(pool.map(lambda i: write_directly(kube, i), range(count)))
            applied_s = time.monotonic() - started
            done = 0
            while done < count and time.monotonic() - started < timeout_s:
                # Every few seconds: listing a thousand services costs the API server too.
                time.sleep(POLL_S)
                try:
                    done = settled(kube, count)
                except KubeError:
                    continue
            settle_s = time.monotonic() - started
            rss, peak = process_memory_mib(operator.pid) if operator else (0.0, 0.0)
            cpu_after = cpu_by_process(plane, operator)
            settle_cpu = {k: round(cpu_after[k] - cpu_before[k], 1) for k in cpu_after}
            requests_after = api_writes(kube, ALL_VERBS)
            conflicts = api_writes(kube, ALL_VERBS, "409") - conflicts_before
            settle_requests = {
                k: requests_after[k] - requests_before[k]
                for k in requests_after
                if requests_after[k] > requests_before[k]
            }
            print(f"{count} ({arm}): applied in {applied_s:.1f} s, {done} settled in "
                  f"{settle_s:.1f} s, "
                  f"operator RSS {rss:.0f} MB (peak {peak:.0f}); API requests meanwhile "
                  f"{sum(settle_requests.values())}; CPU seconds {settle_cpu}",
                  flush=True)  # fmt: skip

            settle = {
                "arm": arm,
                "services": count,
                "applied_s": round(applied_s, 1),
                "settled": done,
                "settle_s": round(settle_s, 1),
                "operator_rss_mb": round(rss),
                "operator_peak_rss_mb": round(peak),
                "settle_cpu_s": settle_cpu,
                "settle_api_requests_total": sum(settle_requests.values()),
                "settle_api_requests": dict(sorted(settle_requests.items(), key=lambda kv: -kv[1])),
                # Writes that lost a race (409: a stale resourceVersion), each read and retried.
                "settle_api_conflicts": dict(conflicts),
            }
            if operator is None or not resync:
                return settle

            # A settled resync: once the cluster is quiet (the controller-manager has made
            # every ReplicaSet and pod, the scheduler has tried them), restart the operator and
            # count writes until every service is reconciled again (and 5 s more).
            quiet_s = wait_quiet(kube, timeout_s)
            stop(operator)
            before = api_writes(kube)
            operator = start_operator(plane.kubeconfig, metrics_port, log)
            restarted = time.monotonic()
            while reconciles(metrics_port) < count and time.monotonic() - restarted < timeout_s:
                time.sleep(1.0)  # the operator's own /metrics: no load on the API server
            resync_s = time.monotonic() - restarted
            resumed = reconciles(metrics_port)
            time.sleep(5.0)
            after = api_writes(kube)
            writes = {k: after[k] - before[k] for k in after if after[k] - before[k] > 0}
            ours = {k: v for k, v in writes.items() if _operators(k)}
            resync_rss, resync_peak = process_memory_mib(operator.pid)
            print(f"{count}: resync of {resumed} services in {resync_s:.1f} s: writes to the "
                  f"operator's kinds {ours or 0}; events {writes.get('events', 0)}; "
                  f"RSS {resync_rss:.0f} MB (peak {resync_peak:.0f})", flush=True)  # fmt: skip
            return {
                **settle,
                "cluster_quiet_after_s": round(quiet_s, 1),
                "resync_services": resumed,
                "resync_s": round(resync_s, 1),
                "resync_writes_operator_kinds": ours,
                "resync_writes_all": writes,
                "resync_peak_rss_mb": round(resync_peak),
            }
    finally:
        if operator is not None:
            stop(operator)
        plane.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--services", type=int, nargs="+", default=[200, 1000])
    parser.add_argument("--timeout", type=float, default=900.0, help="per phase, seconds")
    parser.add_argument(
        "--arms",
        nargs="+",
        choices=["operator", "direct"],
        default=["operator"],
        help="operator: the fleetpilot operator; direct: the floor (see above)",
    )
    parser.add_argument(
        "--no-resync", action="store_true", help="measure the settle only, not the restart"
    )
    parser.add_argument(
        "--autoscaling",
        choices=["auto", "recommend", "disabled", "external"],
        help="the services' autoscaling.mode (default: the API's default, autoscaled)",
    )
    parser.add_argument(
        "--save",
        action="store_true",
        help="record the runs in bench/results/operator_scale.json, in place of the runs "
        "there of the same arm and count (the others are kept)",
    )
    parser.add_argument(
        "--commit", help="the commit measured, recorded with --save (default: git's HEAD)"
    )
    parser.add_argument(
        "--keep-logs",
        type=Path,
        help="keep each run's operator log (and control plane files) under this folder",
    )
    args = parser.parse_args()
    global AUTOSCALING_MODE
    AUTOSCALING_MODE = args.autoscaling
    results = []
    started = machine_info()
    for count in args.services:
        for arm in args.arms:
            if args.keep_logs is not None:
                workdir = args.keep_logs / f"{arm}-{count}"
                workdir.mkdir(parents=True, exist_ok=True)
                result = run(count, workdir, args.timeout, arm, not args.no_resync)
            else:
                with tempfile.TemporaryDirectory(prefix="fp-scale-") as tmp:
                    result = run(count, Path(tmp), args.timeout, arm, not args.no_resync)
            results.append({**result, "date": measured_at()})
    machine = {**started, "loadavg": os.getloadavg()}
    report = {"machine": machine, "runs": results}
    print(json.dumps(report, indent=2))
    if args.save:
        save(results, machine, args.commit or head_commit())


def head_commit() -> str:
    return subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()


def save(runs: list[dict[str, Any]], machine: dict[str, Any], commit: str) -> None:
    """Record ``runs`` in the results file, each in place of an earlier run of its arm and
    count (the machine, the commit and the date go with each run)."""
    path = RESULTS / "operator_scale.json"
    report = json.loads(path.read_text()) if path.exists() else {"runs": []}
    stamped = [{**run, "commit": commit, "machine": machine} for run in runs]
    measured = {(run["arm"], run["services"]) for run in runs}
    kept = [r for r in report["runs"] if (r["arm"], r["services"]) not in measured]
    order = {(r["arm"], r["services"]): i for i, r in enumerate(report["runs"])}
    merged = sorted(kept + stamped, key=lambda r: order.get((r["arm"], r["services"]), len(order)))
    # The file's commit and date (what bench/tables.py captions: the newest run's day) only
    # when every run shares the commit; else the table's "measured on" column says each row's.
    commits = {r.get("commit") for r in merged}
    dates = [r.get("date") for r in merged]
    report.pop("commit", None)
    report.pop("date", None)
    report["machine"] = machine
    if len(commits) == 1 and None not in commits:
        report["commit"] = commits.pop()
        if None not in dates:
            report["date"] = max(str(d) for d in dates)
    RESULTS.mkdir(exist_ok=True)
    path.write_text(json.dumps({**report, "runs": merged}, indent=2) + "\n")


if __name__ == "__main__":
    main()
