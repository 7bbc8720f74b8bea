"""The Gateway API Inference Extension's own endpoint picker (GIE's full EPP, v1.3.0), for
the tests and benchmarks that put it behind the test gateway (e2e/gateway) beside fleetpilot's.

Built by ``e2e/gie-epp/build.sh`` from ``sigs.k8s.io/gateway-api-inference-extension/cmd/epp``
(pinned in e2e/gie-epp/go.mod); started here in GIE's standalone mode: no InferencePool object,
the model-server pods found by a label selector and target ports in one namespace of a real API
server (the test control plane's kubeconfig), as GIE's own "standalone" Helm chart runs it.
GIE scrapes each endpoint's vLLM metrics (``vllm:num_requests_waiting``,
``vllm:kv_cache_usage_perc``, ...) from its target port's ``/metrics``.

The scheduling configuration is a named profile of ``PROFILES`` (or a config text of one's
own): ``default`` is what GIE's InferencePool chart configures (queue, KV-utilization and
prefix-cache scorers weighted 2, 2, 3), ``prefix`` the prefix-cache scorer alone.
"""

from __future__ import annotations

import json
import re
import secrets
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Self

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fleetpilot.runtime.processes import StartsAndStops, free_ports, terminate
from fleetpilot.testing.binaries import go_tool, go_tool_skip_reason
from fleetpilot.testing.errors import ControlPlaneError
from fleetpilot.testing.polling import eventually

#: The module version e2e/gie-epp/go.mod pins (a test holds the two equal).
GIE_VERSION = "v1.3.0"

#: GIE v1.3.0's InferencePool chart's ``default-plugins.yaml``
#: (config/charts/inferencepool/templates/epp-config.yaml, latency predictor off).
DEFAULT_PROFILE = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: prefix-cache-scorer
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
    weight: 2
  - pluginRef: kv-cache-utilization-scorer
    weight: 2
  - pluginRef: prefix-cache-scorer
    weight: 3
"""

#: The prefix-cache scorer alone (GIE's max-score picker added by its loader's defaults).
PREFIX_ONLY_PROFILE = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: prefix-cache-scorer
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: prefix-cache-scorer
"""

PROFILES: Mapping[str, str] = {"default": DEFAULT_PROFILE, "prefix": PREFIX_ONLY_PROFILE}

#: How long GIE's EPP may take to connect to the API server, list the pods and serve health.
START_TIMEOUT_S = 60.0


def skip_reason() -> str | None:
    """Why GIE's EPP cannot run here (None: it can): it is built with Go."""
    return go_tool_skip_reason("GIE's endpoint picker")


def gie_epp_binary(*, build: bool = True) -> Path:
    """GIE's EPP, built first by e2e/gie-epp/build.sh (a no-op when up to date)."""
    return go_tool("gie-epp", "GIE's endpoint picker", build=build)


class GieEpp(StartsAndStops):
    """GIE's EPP picking among the Ready pods of ``namespace`` that carry every label of
    ``selector``, each pod an endpoint per port of ``target_ports`` (at most 8, GIE's limit).

    ``profile``: a name of ``PROFILES``, or ``config_text`` an EndpointPickerConfig of one's
    own. ``address`` is its ext_proc gRPC address (``127.0.0.1:port``, plaintext) for the
    gateway's ``--picker``; ``metrics_url`` its Prometheus metrics. ``start`` returns once
    its gRPC health service says SERVING (its view of the pods synced); which pods it knows
    shows in ``queue_sizes``. ``name`` is its Deployment's name in GIE's eyes (standalone mode
    reads it from POD_NAME), the ``name`` label of its pool metrics. ``verbosity`` is its
    ``--v``: GIE's chart runs 1; 3 (VERBOSE) logs each pick, which ``picks`` reads.

    With ``pool_name`` (and no selector or target ports) it runs as GIE's chart and its
    conformance suite deploy it instead: ``--pool-name``, the pods and target ports read from
    that InferencePool object of ``namespace`` (its CRD installed), health SERVING once GIE
    has read the pool."""

    def __init__(
        self,
        kubeconfig: Path,
        namespace: str,
        selector: Mapping[str, str],
        target_ports: Sequence[int],
        *,
        profile: str = "default",
        config_text: str | None = None,
        name: str = "gie-epp",
        verbosity: int = 1,
        pool_name: str | None = None,
    ) -> None:
        if pool_name is not None:
            if selector or target_ports:
                raise ValueError("an InferencePool names its own selector and target ports")
        elif not selector:
            raise ValueError("GIE's standalone mode needs a non-empty endpoint selector")
        elif not 1 <= len(target_ports) <= 8:
            raise ValueError("GIE takes 1 to 8 target ports")
        if config_text is None and profile not in PROFILES:
            raise ValueError(f"unknown GIE profile {profile!r}; known: {sorted(PROFILES)}")
        self.kubeconfig = kubeconfig
        self.namespace = namespace
        self.selector = dict(selector)
        self.target_ports = list(target_ports)
        self.config_text = config_text if config_text is not None else PROFILES[profile]
        self.name = name
        self.verbosity = verbosity
        self.pool_name = pool_name
        self.address = ""
        self.health_address = ""
        self.metrics_url = ""
        self._process: subprocess.Popen[bytes] | None = None
        self._log_dir: tempfile.TemporaryDirectory[str] | None = None

    def argv(self, grpc_port: int, health_port: int, metrics_port: int) -> list[str]:
        if self.pool_name is not None:
            pool = ["--pool-name", self.pool_name]
        else:
            pool = [
                "--endpoint-selector",
                ",".join(f"{k}={v}" for k, v in self.selector.items()),
                "--endpoint-target-ports",
                ",".join(str(p) for p in self.target_ports),
            ]
        return [
            str(gie_epp_binary()),
            *pool,
            "--pool-namespace",
            self.namespace,
            "--grpc-port",
            str(grpc_port),
            "--grpc-health-port",
            str(health_port),
            "--metrics-port",
            str(metrics_port),
            "--config-text",
            self.config_text,
            # Plaintext gRPC (the gateway's default), an open metrics endpoint, no tracing
            # exporter or pprof: nothing a test on loopback needs.
            "--secure-serving=false",
            "--metrics-endpoint-auth=false",
            "--tracing=false",
            "--enable-pprof=false",
            f"--v={self.verbosity}",
            "--zap-encoder=json",
        ]

    def start(self) -> Self:
        grpc_port, health_port, metrics_port = free_ports(3)
        self._log_dir = tempfile.TemporaryDirectory(prefix="gie-epp-")
        # Standalone mode names its "pool" after the Deployment in POD_NAME (<name>-<rs>-<id>).
        pod_name = f"{self.name}-{secrets.token_hex(4)}-{secrets.token_hex(3)}"
        with self.log_path.open("ab") as log:  # the child's own descriptor, appending
            self._process = subprocess.Popen(
                self.argv(grpc_port, health_port, metrics_port),
                stdout=log,
                stderr=subprocess.STDOUT,
                env={
                    "KUBECONFIG": str(self.kubeconfig),
                    "NAMESPACE": self.namespace,
                    "POD_NAME": pod_name,
                },
            )
        self.address = f"127.0.0.1:{grpc_port}"
        self.health_address = f"127.0.0.1:{health_port}"
        self.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        try:
            eventually(
                "GIE's endpoint picker serving its gRPC health",
                self._serving,
                START_TIMEOUT_S,
                error=ControlPlaneError,
                context=self.log,
            )
        except BaseException:
            self.stop()
            raise
        return self

    def _serving(self) -> bool | None:
        if self._process is not None and self._process.poll() is not None:
            raise ControlPlaneError(
                f"GIE's endpoint picker exited ({self._process.returncode}):\n{self.log()}"
            )
        with grpc.insecure_channel(self.health_address) as channel:
            # The stubs' HealthStub declares no methods (they are set at run time).
            stub: Any = health_pb2_grpc.HealthStub(channel)
            try:
                answer = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
            except grpc.RpcError:
                return None
        return True if answer.status == health_pb2.HealthCheckResponse.SERVING else None

    def metrics(self) -> str:
        """Its Prometheus metrics as text."""
        return httpx.get(self.metrics_url, timeout=10).text

    def queue_sizes(self) -> dict[str, float]:
        """The waiting-queue size each endpoint last reported to it (scraped every 50 ms),
        by endpoint name (``<pod>-rank-<i>``, one rank per target port)."""
        sizes: dict[str, float] = {}
        for line in self.metrics().splitlines():
            if line.startswith("inference_pool_per_pod_queue_size{"):
                match = re.search(r'model_server_pod="([^"]+)"', line)
                if match is not None:
                    sizes[match.group(1)] = float(line.rsplit(" ", 1)[1])
        return sizes

    def picks(self) -> list[str]:
        """The endpoint (``ip:port``) of each request it scheduled so far, in order, from its
        log's "Request handled" lines (logged at verbosity 3 and above)."""
        picks = []
        for line in self._read_log().splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if isinstance(entry, dict) and entry.get("msg") == "Request handled":
                picks.append(str(entry["endpoint"]))
        return picks

    def log(self) -> str:
        """What it wrote so far (its zap log), the last 20,000 characters."""
        return self._read_log()[-20_000:]

    @property
    def log_path(self) -> Path:
        if self._log_dir is None:
            raise ControlPlaneError("GIE's endpoint picker was not started")
        return Path(self._log_dir.name) / "gie-epp.log"

    def _read_log(self) -> str:
        if self._log_dir is None:
            return ""
        return self.log_path.read_bytes().decode(errors="replace")

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is not None:
            terminate(process, 15)
        log_dir, self._log_dir = self._log_dir, None
        if log_dir is not None:
            log_dir.cleanup()
