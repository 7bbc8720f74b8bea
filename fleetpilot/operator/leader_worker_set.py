"""The LeaderWorkerSet of a role whose replicas span nodes. Purely computational.

One LeaderWorkerSet (leaderworkerset.x-k8s.io/v1) per such role: each of its ``replicas`` is a
group of ``size`` pods, one per node, the leader serving the API and running vLLM's front end,
the workers running ``vllm serve --headless`` (engine.vllm_args.multi_node_args). Scaling it
through its scale subresource adds or removes whole groups, as the autoscaler wants.

Choices, and why:

- ``startupPolicy: LeaderCreated`` (the controller's default), not ``LeaderReady``: a vLLM
  leader's ``/health`` answers only once its workers have joined (torch.distributed, or the
  data-parallel handshake), so waiting for a Ready leader before creating workers never ends.
- ``restartPolicy: RecreateGroupOnPodRestart``: a process group cannot take a restarted member
  back, so a group restarts whole.
- A rolling update surges one group and keeps every old one until its replacement is Ready, as
  the engine Deployments do (``maxSurge`` 1, ``maxUnavailable`` 0).
- The controller makes a headless Service named as the set, which publishes not-ready pods:
  the groups find their leader by it (``LWS_LEADER_ADDRESS``) before anything is Ready. The
  router's Service is another (``names.leaders_service_name``), listing Ready leaders only.
"""

from __future__ import annotations

from fleetpilot.api import InferenceService, ResolvedRole
from fleetpilot.api.layout import role_layout
from fleetpilot.kube import names
from fleetpilot.operator.engine_objects import (
    engine_labels,
    engine_pod_template,
    workload_annotations,
)
from fleetpilot.operator.plan_types import K8sObject, PlanOptions, object_meta

API_VERSION = "leaderworkerset.x-k8s.io/v1"
# One replica per value of this node label (the service's scheduling.groupTopologyKey).
EXCLUSIVE_TOPOLOGY_ANNOTATION = "leaderworkerset.sigs.k8s.io/exclusive-topology"


def engine_leader_worker_set(
    service: InferenceService, role: ResolvedRole, options: PlanOptions | None = None
) -> K8sObject:
    tier = role.tier
    layout = role_layout(role)
    name = names.leader_worker_set_name(service.name, tier.name, role.name)
    annotations = workload_annotations(service, role, options)
    topology = service.spec.scheduling.group_topology_key
    if topology:
        annotations[EXCLUSIVE_TOPOLOGY_ANNOTATION] = topology
    return {
        "apiVersion": API_VERSION,
        "kind": "LeaderWorkerSet",
        "metadata": {
            **object_meta(service, name, engine_labels(service, role)),
            "annotations": annotations,
        },
        "spec": {
            "replicas": role.replicas.start,
            "startupPolicy": "LeaderCreated",
            "rolloutStrategy": {
                "type": "RollingUpdate",
                "rollingUpdateConfiguration": {"maxSurge": 1, "maxUnavailable": 0},
            },
            "leaderWorkerTemplate": {
                "size": layout.nodes,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": engine_pod_template(service, role, options),
                "workerTemplate": engine_pod_template(service, role, options, worker=True),
            },
        },
    }
