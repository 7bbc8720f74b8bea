{{/*
Names and labels shared by every template. Names are capped at 63 characters: Kubernetes
refuses longer label values and Service names.
*/}}

{{/* Chart name, or nameOverride. */}}
{{- define "fleetpilot.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Full name: fullnameOverride, else "<release>-<chart>", collapsed to the release name when that
already contains the chart name (release "fleetpilot" gives "fleetpilot", not
"fleetpilot-fleetpilot").
*/}}
{{- define "fleetpilot.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* "chart-version" for the helm.sh/chart label ('+' is not allowed in label values). */}}
{{- define "fleetpilot.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Labels that select the operator pod. Never change these in an upgrade: a Deployment's
selector is immutable.
*/}}
{{- define "fleetpilot.selectorLabels" -}}
app.kubernetes.io/name: {{ include "fleetpilot.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Labels on every object the chart creates. */}}
{{- define "fleetpilot.labels" -}}
helm.sh/chart: {{ include "fleetpilot.chart" . }}
{{ include "fleetpilot.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/component: operator
app.kubernetes.io/part-of: fleetpilot
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* The ServiceAccount the operator runs as (and the RBAC binds). */}}
{{- define "fleetpilot.serviceAccountName" -}}
{{- default (include "fleetpilot.fullname" .) .Values.serviceAccount.name }}
{{- end }}

{{/* The operator image: repository@digest when a digest is given, else repository:tag. */}}
{{- define "fleetpilot.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/* The router image passed to the operator: routerImage, else the operator's own image. */}}
{{- define "fleetpilot.routerImage" -}}
{{- default (include "fleetpilot.image" .) .Values.routerImage }}
{{- end }}

{{/* The kopf peering name (`--peering`): peering.name, else the full name. */}}
{{- define "fleetpilot.peeringName" -}}
{{- default (include "fleetpilot.fullname" .) .Values.peering.name }}
{{- end }}

{{/* "true" when the operator serves every namespace (watchNamespaces is empty). */}}
{{- define "fleetpilot.clusterWide" -}}
{{- if empty .Values.watchNamespaces }}true{{ end }}
{{- end }}

{{/*
RBAC rules for the namespaced resources the operator touches; one list, so the cluster-wide
ClusterRole and the per-namespace Roles cannot drift apart. tests/charts/test_chart.py holds
the same table: a change here must change it there too.
*/}}
{{- define "fleetpilot.namespacedRules" -}}
# The InferenceService API: kopf watches and patches (progress annotations, and removes the
# finalizer older releases added); the reconciler reads a service when a child changes.
- apiGroups: [fleetpilot.dev]
  resources: [inferenceservices]
  verbs: [get, list, watch, patch]
# Every child's ownerReference has blockOwnerDeletion, which clusters enforcing owner-reference
# permissions (OwnerReferencesPermissionEnforcement: OpenShift) allow only with this.
- apiGroups: [fleetpilot.dev]
  resources: [inferenceservices/finalizers]
  verbs: [update]
# Status is written with a merge patch to the status subresource.
- apiGroups: [fleetpilot.dev]
  resources: [inferenceservices/status]
  verbs: [get, patch]
# Every object a plan contains: server-side apply is a PATCH that needs create when the
# object is absent; list finds what to prune, delete prunes it; watch serves child events.
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, watch, create, patch, delete]
# ServiceAccounts: each router's (bound to its discovery Role) and the engine pods' (bound to
# nothing, no token mounted).
- apiGroups: [""]
  resources: [services, configmaps, serviceaccounts]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [rbac.authorization.k8s.io]
  resources: [roles, rolebindings]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [get, list, watch, create, patch, delete]
# spec.modelCache: the cache's claim, the Jobs that download models into it, and the one
# that removes the downloads no longer planned.
- apiGroups: [""]
  resources: [persistentvolumeclaims]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [batch]
  resources: [jobs]
  verbs: [get, list, watch, create, patch, delete]
# The NetworkPolicies that keep engine ports to the service's router and engines.
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [get, list, watch, create, patch, delete]
# Only used when the Prometheus Operator's PodMonitor CRD exists (detected at start).
- apiGroups: [monitoring.coreos.com]
  resources: [podmonitors]
  verbs: [get, list, watch, create, patch, delete]
# The workloads of roles whose replicas span nodes; only used when the LeaderWorkerSet CRD
# exists (detected at start: without it such a role is refused).
- apiGroups: [leaderworkerset.x-k8s.io]
  resources: [leaderworkersets]
  verbs: [get, list, watch, create, patch, delete]
# routing.gateway: a service's InferencePool (the Gateway API Inference Extension's) and its
# HTTPRoute (the Gateway API's); only used when their CRDs exist (detected at start). The
# pool's status (its gateways' answers) feeds the service's GatewayAccepted condition.
- apiGroups: [inference.networking.k8s.io]
  resources: [inferencepools]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [gateway.networking.k8s.io]
  resources: [httproutes]
  verbs: [get, list, watch, create, patch, delete]
# The operator's autoscaler loop scales engine workloads (Deployments, LeaderWorkerSets)
# through their scale subresource, under its own field manager (fleetpilot-autoscaler), so
# re-applied specs leave replicas alone.
- apiGroups: [apps]
  resources: [deployments/scale]
  verbs: [get, patch]
- apiGroups: [leaderworkerset.x-k8s.io]
  resources: [leaderworkersets/scale]
  verbs: [get, patch]
# Child pods feed status: crash loops, image pulls, scheduling.
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch]
# The model cache's download pods' last log lines: ModelReady's bytes and files done.
- apiGroups: [""]
  resources: [pods/log]
  verbs: [get]
# Events on InferenceServices: kopf's (created/updated/pruned/refused) and the autoscaler's
# (scaled, recommended, metrics lost).
- apiGroups: [""]
  resources: [events]
  verbs: [create, patch]
# Each router gets a Role to read these; RBAC escalation prevention only lets the operator
# grant what it holds itself.
- apiGroups: [discovery.k8s.io]
  resources: [endpointslices]
  verbs: [get, list, watch]
{{- end }}

{{/*
kopf's own cluster-scoped reads. It watches CRDs in either scope (to notice the
InferenceService CRD appear or change); it lists and watches namespaces only when it serves a
list of them (kopf's namespace_observer), so cluster-wide operators are not given that.
*/}}
{{- define "fleetpilot.kopfCrdRules" -}}
- apiGroups: [apiextensions.k8s.io]
  resources: [customresourcedefinitions]
  verbs: [list, watch]
{{- end }}

{{- define "fleetpilot.kopfNamespaceRules" -}}
- apiGroups: [""]
  resources: [namespaces]
  verbs: [list, watch]
{{- end }}

{{/*
kopf peering: each replica patches its keep-alive into the peering object's status and watches
it for peers. Cluster-wide operators use ClusterKopfPeering only, namespaced ones KopfPeering
only (kopf's peering.guess_selectors), so each scope is granted just its own kind.
*/}}
{{- define "fleetpilot.clusterPeeringRules" -}}
- apiGroups: [kopf.dev]
  resources: [clusterkopfpeerings]
  verbs: [get, list, watch, patch]
{{- end }}

{{- define "fleetpilot.namespacedPeeringRules" -}}
- apiGroups: [kopf.dev]
  resources: [kopfpeerings]
  verbs: [get, list, watch, patch]
{{- end }}
