"""The router of a service: config, identity, Deployment, Service. Purely computational (the
reference tokenizer's files are read once from the package: data fixed at install)."""

from __future__ import annotations

import functools
from datetime import timedelta
from decimal import Decimal

import yaml

from fleetpilot.api import InferenceService, RoleName
from fleetpilot.api.router_config import (
    ROUTER_CONFIG_FILE,
    EndpointGroup,
    FlowConfig,
    KVIndexConfig,
    Peers,
    RouterConfig,
    RouterTier,
)
from fleetpilot.api.spec import EngineBackend, Tier
from fleetpilot.api.units import quantity_decimal
from fleetpilot.engine.reference_launch import REFERENCE_TOKENIZER
from fleetpilot.engine.vllm_args import ENGINE_PORT, launch_for
from fleetpilot.kube import names
from fleetpilot.operator.engine_objects import hub_token_env
from fleetpilot.operator.plan_types import Capacities, K8sObject, PlanOptions, object_meta, sized
from fleetpilot.operator.pod_policy import container_security, pod_security, spread
from fleetpilot.operator.router_auth import auth_config, auth_volumes
from fleetpilot.routing.features import CHARS_PER_TOKEN
from fleetpilot.routing.policies.kv_index import DEFAULT_MAX_BLOCKS

ROUTER_PORT = 8000
# The router's /metrics on a port of its own (RouterConfig.metricsPort): its Service exposes
# only ROUTER_PORT to clients, the PodMonitor scrapes this one, and the NetworkPolicy lets in
# only the metrics namespaces - the exposition names replicas, tenants and their counts.
# 9090: the port Prometheus exporters conventionally serve on; nothing else in the pod uses it.
ROUTER_METRICS_PORT = 9090
# A deleted router pod (a drain, a rolling update) keeps serving this long after SIGTERM: it
# leaves its Service's EndpointSlices at that moment, and whatever routes to it (kube-proxy,
# a gateway, a client's own list) learns so a moment later. Then it finishes what it holds
# (routing.cli.SHUTDOWN_TIMEOUT_S, 30 s), inside the pod's grace period.
ROUTER_SHUTDOWN_DELAY_S = 5
ROUTER_TERMINATION_GRACE_S = 45
METRICS_PORT_NAME = "metrics"
# With ``routing.gateway``: the endpoint picker (ext_proc over TLS), on the port GIE's own
# picker serves it on, so a gateway set up for either finds it where it expects; the Service's
# port is named as GIE's chart names it, and like it sets no appProtocol: gateways configure
# the picker's cluster themselves (gRPC over TLS), and a mesh reading "http2" there would take
# the picker's own TLS for cleartext HTTP/2.
ROUTER_EPP_PORT = 9002
EPP_PORT_NAME = "grpc-ext-proc"
CONFIG_DIR = "/etc/fleetpilot"
# The router downloads each tier's tokenizer files (a few MB) here; its root filesystem is
# read-only.
TOKENIZER_CACHE = "/var/cache/fleetpilot/hf"
# A reference tier's engines tokenize with the files the package ships (6 KB); the router's
# image may hold the package elsewhere than the operator's, so the files travel in the
# router's ConfigMap (as REFERENCE_TOKENIZER_KEY_PREFIX + name) and are mounted here.
REFERENCE_TOKENIZER_DIR = "/etc/fleetpilot-tokenizers/reference"
REFERENCE_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
REFERENCE_TOKENIZER_KEY_PREFIX = "reference-"


@functools.cache
def reference_tokenizer_data() -> dict[str, str]:
    """The router ConfigMap's copy of the reference engine's tokenizer files. Reads the
    package's own data files, fixed at install: the same bytes on every call."""
    return {
        REFERENCE_TOKENIZER_KEY_PREFIX + file: (REFERENCE_TOKENIZER / file).read_text("utf-8")
        for file in REFERENCE_TOKENIZER_FILES
    }


def has_reference_tier(service: InferenceService) -> bool:
    return any(t.engine.backend is EngineBackend.REFERENCE for t in service.spec.tiers)


def reference_tokenizer_volume(
    service: InferenceService, config_map: str
) -> tuple[list[K8sObject], list[K8sObject]]:
    """The router pod's volume and mount of the reference tokenizer (none without a reference
    tier): the ConfigMap's copies under their own names."""
    if not has_reference_tier(service):
        return [], []
    items = [
        {"key": REFERENCE_TOKENIZER_KEY_PREFIX + file, "path": file}
        for file in REFERENCE_TOKENIZER_FILES
    ]
    volume = {"name": "reference-tokenizer", "configMap": {"name": config_map, "items": items}}
    mount = {"name": "reference-tokenizer", "mountPath": REFERENCE_TOKENIZER_DIR, "readOnly": True}
    return [volume], [mount]


def router_labels(service: InferenceService) -> dict[str, str]:
    return {
        **names.service_labels(service.name),
        **names.router_selector(service.name),
        names.LABEL_NAME: "fleetpilot-router",
    }


def endpoint_url(service: InferenceService) -> str:
    """The OpenAI-compatible base URL clients inside the cluster use."""
    host = f"{names.router_name(service.name)}.{service.namespace}.svc"
    return f"http://{host}:{ROUTER_PORT}/v1"


# A replica's first byte is due within a few TTFT SLOs: the SLO is a p95, queueing under a
# burst can triple a tail, and 4x leaves room for that before a request is moved. The floor
# keeps a tight SLO (100 ms) from turning a GC pause or a busy node into failovers.
FIRST_BYTE_SLO_FACTOR = 4.0
FIRST_BYTE_FLOOR = timedelta(seconds=2)


def first_byte_timeout(ttft_p95: timedelta | None) -> timedelta | None:
    """The tier's time-to-first-byte budget: max(2s, 4 x ttftP95); None without a TTFT SLO
    (the router's config-wide default applies). Purely computational."""
    if ttft_p95 is None:
        return None
    return max(FIRST_BYTE_FLOOR, ttft_p95 * FIRST_BYTE_SLO_FACTOR)


def tokenizer_ref(tier: Tier) -> str | None:
    """Where the router gets the tier model's tokenizer: the Hub repository the engines load
    (at the same revision), None for weights on a PVC (the router does not mount the engines'
    volume) or a name that is no ``org/name`` repository: the router then guesses what the
    engines cache from prompt text. A reference tier's engines tokenize with the files shipped
    in the package: the router reads its ConfigMap's copy (:func:`reference_tokenizer_volume`)."""
    source = tier.model.source
    if tier.engine.backend is EngineBackend.REFERENCE:
        return REFERENCE_TOKENIZER_DIR
    if source.pvc is not None or tier.model.name.count("/") != 1:
        return None  # a PVC, or a model name that is no Hub repository id
    revision = source.huggingface.revision if source.huggingface is not None else None
    return f"hf://{tier.model.name}@{revision or 'main'}"


def tokenizer_env(service: InferenceService) -> list[K8sObject]:
    """The Hub cache directory, and the Hub token of the first tier that names one (from its
    Secret, never in the config): tiers of one service are expected to share a token."""
    env: list[K8sObject] = [{"name": "HF_HUB_CACHE", "value": TOKENIZER_CACHE}]
    for tier in service.spec.tiers:
        token = hub_token_env(tier.model.source.huggingface)
        if token:
            return env + token
    return env


# What the observed cold start (pod created to Ready) leaves out of a scale from zero: the
# autoscaler seeing the held request (its 5 s tick) and the Deployment creating the pod, and
# the Ready endpoint reaching the router - plus, on Kubernetes, one Prometheus scrape interval
# before the router's pending gauge is read at all.
COLD_START_MARGIN = timedelta(seconds=10)


def observed_cold_start(service: InferenceService, tier: Tier) -> timedelta | None:
    """The tier's observed cold start from the service's status: the longest pod-created-to-
    Ready (``coldStart.pod.maxSeconds``) among its roles. The roles of a disaggregated tier
    start side by side from zero and a request is best served by both, so the slowest is what
    it waits for; the max of the kept starts rather than their p50, as a hold cut short by a
    typical start refuses the requests of every slower one. Starts of restarted containers
    (``start`` only) do not count: a scale from zero creates pods. None before any was seen.
    Whole seconds, changing only when a start slower than the kept ones comes (or leaves the
    kept ten): the router's ConfigMap is rarely rewritten for it."""
    if service.status is None:
        return None
    roles = {role.name.value for role in tier.roles()}
    seconds = [
        role.cold_start.pod.max_seconds
        for observed in service.status.tiers
        if observed.name == tier.name
        for role in observed.roles
        if role.role in roles and role.cold_start is not None and role.cold_start.pod is not None
    ]
    return timedelta(seconds=max(seconds)) if seconds else None


def router_config(service: InferenceService, capacities: Capacities | None = None) -> RouterConfig:
    """What the router needs to know: tiers, their thresholds and where their pods are
    (``capacities``: the roles sized, else sized here)."""
    spec = service.spec
    tiers = []
    for tier in spec.tiers:
        groups = []
        for role in tier.roles():
            launch = launch_for(role)
            groups.append(
                EndpointGroup(
                    role=role.name,
                    service=names.engine_service_name(service.name, role),
                    selector=names.engine_selector(service.name, tier.name, role.name),
                    port=ENGINE_PORT,
                    # One endpoint fronts every data-parallel rank of its replica, each with
                    # its own batch: the replica is full at all of them together.
                    max_num_seqs=tier.engine.max_num_seqs * launch.data,
                    kv_events_port=launch.kv_events_port,
                    kv_replay_port=launch.kv_replay_port,
                    # The ranks whose KV events the router can reach: those on the pod it
                    # discovers (a multi-node replica's leader runs the first dataLocal).
                    data_parallel=launch.data_local or launch.data,
                    block_size=tier.engine.kv_cache.block_size,
                )
            )
        tiers.append(
            RouterTier(
                name=tier.name,
                model=tier.model.alias,
                adapters=[adapter.name for adapter in tier.adapters],
                max_loras=tier.lora_settings.max_loras if tier.lora_settings else 1,
                up_to=tier.complexity.up_to,
                mode=tier.serving.mode,
                endpoints=groups,
                first_byte_timeout=first_byte_timeout(tier.autoscaling.slo.ttft_p95),
                tokenizer=tokenizer_ref(tier),
                cold_start_observed=observed_cold_start(service, tier),
            )
        )
    routing = spec.routing
    # A tier allowed to sit at zero replicas gets its first one on demand: the router holds
    # such a request instead of answering 503 - for the tier's observed cold start x 1.5 plus
    # a margin (hold.ColdStartHold), at most maxColdStartHold (default: as long as any request
    # may take; never longer).
    may_be_zero = any(role.replicas.min == 0 for tier in spec.tiers for role in tier.roles())
    hold_max = routing.request_timeout
    if routing.max_cold_start_hold is not None:
        hold_max = min(hold_max, routing.max_cold_start_hold)
    index = prefix_index_blocks(service, capacities)
    bound = kv_index_max_blocks(service, capacities)
    return RouterConfig(
        service=service.name,
        namespace=service.namespace,
        port=ROUTER_PORT,
        metrics_port=ROUTER_METRICS_PORT,
        tiers=tiers,
        affinity=routing.affinity,
        load_weight=routing.load_weight,
        adapter_weight=routing.adapter_weight,
        retries=routing.retries,
        stream_resumes=routing.stream_resumes,
        spillover=routing.spillover,
        request_timeout=routing.request_timeout,
        max_body_bytes=routing.max_body_bytes,
        auth=auth_config(service),
        flow=(
            FlowConfig.model_validate(routing.flow_control.model_dump())
            if routing.flow_control is not None
            else None
        ),
        cold_start_wait=hold_max if may_be_zero else timedelta(0),
        cold_start_margin=COLD_START_MARGIN + spec.monitoring.scrape_interval,
        # Every replica shares its in-flight counts with the others (one alone finds only
        # itself behind the Service, and skips it), so a scaled or surging Deployment needs
        # no new config.
        peers=Peers(
            service=f"{names.router_peers_name(service.name)}.{service.namespace}.svc",
            port=ROUTER_METRICS_PORT,
        ),
        epp_port=ROUTER_EPP_PORT if routing.gateway is not None else None,
        epp_tls=routing.gateway is not None,
        **({"prefix_index_blocks": index} if index is not None else {}),
        **({"kv_index": KVIndexConfig(max_blocks=bound)} if bound is not None else {}),
    )


# What one entry of the router's KV index takes (kv_index.DEFAULT_MAX_BLOCKS' comment: ~400
# bytes for a block on both media), and the share of the router's memory the index may grow
# to: the rest is its requests' buffers, the tokenizers and the Python heap.
KV_INDEX_ENTRY_BYTES = 400
KV_INDEX_MEMORY_SHARE = 0.5


def kv_index_max_blocks(
    service: InferenceService, capacities: Capacities | None = None
) -> int | None:
    """The router's KV index bound for a fleet with host KV tiers (``engine.kvOffload``): the
    blocks every engine can hold at the roles' most replicas, an offloading engine its host
    tier's (written through, a superset of its device's), within half the router's memory.
    None (the index's default) without a host tier, or where the default holds them all."""
    blocks = 0
    offloading = False
    for tier in service.spec.tiers:
        for role in tier.roles():
            capacity = sized(capacities, role)
            if capacity is None or not capacity.fits:
                continue
            offloading |= capacity.kv_offload_bytes is not None
            tokens = max(capacity.kv_tokens, capacity.host_kv_tokens)
            blocks += role.replicas.max * tokens // tier.engine.kv_cache.block_size
    if not offloading or blocks <= DEFAULT_MAX_BLOCKS:
        return None
    memory = quantity_decimal(service.spec.routing.memory)
    room = int(memory * Decimal(KV_INDEX_MEMORY_SHARE)) // KV_INDEX_ENTRY_BYTES
    return max(DEFAULT_MAX_BLOCKS, min(blocks, room))


def prefix_index_blocks(
    service: InferenceService, capacities: Capacities | None = None
) -> int | None:
    """Per replica, how many prompt blocks the router's guessed index remembers: the KV cache
    of the largest sized replica that prefills (unified or prefill role), in the router's
    blocks of ``affinity.blockChars`` characters at ~``CHARS_PER_TOKEN`` characters a token.
    Remembering more than a cache holds predicts hits its engine has evicted; fewer forgets
    hits it still has. None when no such role can be sized (the router's default then)."""
    tokens = [
        capacity.kv_tokens
        for tier in service.spec.tiers
        for role in tier.roles()
        if role.name is not RoleName.DECODE
        and (capacity := sized(capacities, role))
        and capacity.fits
    ]
    if not tokens:
        return None
    return max(1, max(tokens) * CHARS_PER_TOKEN // service.spec.routing.affinity.block_chars)


def router_objects(
    service: InferenceService, options: PlanOptions, capacities: Capacities | None = None
) -> list[K8sObject]:
    """ServiceAccount, Role, RoleBinding, ConfigMap, Service, peer Service, Deployment and
    PDB. The Service exposes the API port, and with ``routing.gateway`` the endpoint picker's
    (the InferencePool's ``endpointPickerRef``): /metrics is on the pods' ``metrics`` port,
    for the PodMonitor and, through the headless peer Service, the other router replicas."""
    name = names.router_name(service.name)
    labels = router_labels(service)
    selector = names.router_selector(service.name)
    meta = object_meta(service, name, labels)
    routing = service.spec.routing
    config = router_config(service, capacities)
    config_text = yaml.safe_dump(config.to_wire(), sort_keys=False)
    probe = {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 5}
    key_volumes, key_mounts = auth_volumes(service)
    tokenizer_volumes, tokenizer_mounts = reference_tokenizer_volume(service, name)
    data = {ROUTER_CONFIG_FILE: config_text}
    service_ports: list[K8sObject] = [
        {"name": "http", "port": ROUTER_PORT, "targetPort": "http", "protocol": "TCP"}
    ]
    container_ports: list[K8sObject] = [
        {"name": "http", "containerPort": ROUTER_PORT, "protocol": "TCP"},
        {"name": METRICS_PORT_NAME, "containerPort": ROUTER_METRICS_PORT, "protocol": "TCP"},
    ]
    if config.epp_port is not None:
        service_ports.append(
            {
                "name": EPP_PORT_NAME,
                "port": config.epp_port,
                "targetPort": EPP_PORT_NAME,
                "protocol": "TCP",
            }
        )
        container_ports.append(
            {"name": EPP_PORT_NAME, "containerPort": config.epp_port, "protocol": "TCP"}
        )
    if has_reference_tier(service):
        data |= reference_tokenizer_data()
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": meta,
            # Discovery only: the router watches the Ready endpoints of its engine Services.
            "rules": [
                {
                    "apiGroups": ["discovery.k8s.io"],
                    "resources": ["endpointslices"],
                    "verbs": ["get", "list", "watch"],
                }
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": meta,
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": service.namespace}],
        },
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": meta,
            "data": data,
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": meta,
            "spec": {
                "type": "ClusterIP",
                "selector": selector,
                "ports": service_ports,
            },
        },
        {
            # Headless: its DNS name resolves to every router pod's address, for the
            # replicas to share their counts on the metrics port (``routing.peers``).
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": object_meta(service, names.router_peers_name(service.name), labels),
            "spec": {
                "clusterIP": "None",
                "selector": selector,
                "ports": [
                    {
                        "name": "metrics",
                        "port": ROUTER_METRICS_PORT,
                        "targetPort": "metrics",
                        "protocol": "TCP",
                    }
                ],
            },
        },
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": meta,
            "spec": {
                "replicas": routing.replicas,
                "selector": {"matchLabels": selector},
                "template": {
                    "metadata": {
                        "labels": labels,
                        "annotations": {
                            "prometheus.io/scrape": "true",
                            "prometheus.io/port": str(ROUTER_METRICS_PORT),
                            "prometheus.io/path": "/metrics",
                        },
                    },
                    "spec": {
                        "serviceAccountName": name,
                        "enableServiceLinks": False,
                        "securityContext": pod_security(),
                        "topologySpreadConstraints": spread(selector),
                        "terminationGracePeriodSeconds": ROUTER_TERMINATION_GRACE_S,
                        **(
                            {"priorityClassName": routing.priority_class_name}
                            if routing.priority_class_name
                            else {}
                        ),
                        "containers": [
                            {
                                "name": "router",
                                "image": options.fleetpilot_image,
                                "command": ["fleetpilot", "router"],
                                "args": [
                                    "--config",
                                    f"{CONFIG_DIR}/{ROUTER_CONFIG_FILE}",
                                    "--port",
                                    str(ROUTER_PORT),
                                    "--shutdown-delay",
                                    str(ROUTER_SHUTDOWN_DELAY_S),
                                ],
                                "ports": container_ports,
                                "resources": {
                                    "requests": {"cpu": routing.cpu, "memory": routing.memory},
                                    "limits": {"memory": routing.memory},
                                },
                                "readinessProbe": probe,
                                "livenessProbe": {**probe, "periodSeconds": 10},
                                "securityContext": container_security(read_only_root=True),
                                "env": tokenizer_env(service),
                                "volumeMounts": [
                                    {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
                                    {"name": "tokenizers", "mountPath": TOKENIZER_CACHE},
                                    *tokenizer_mounts,
                                    *key_mounts,
                                ],
                            }
                        ],
                        "volumes": [
                            {"name": "config", "configMap": {"name": name}},
                            {"name": "tokenizers", "emptyDir": {"sizeLimit": "1Gi"}},
                            *tokenizer_volumes,
                            *key_volumes,
                        ],
                    },
                },
            },
        },
        {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": meta,
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector}},
        },
    ]
