{{/*
Refuse values the operator cannot run with, with a message that says what to change.
values.schema.json checks types and enums first; these checks repeat the ones that matter
(they still hold under --skip-schema-validation) and add the rules a schema cannot express.
Every message starts with "fleetpilot:" so tests and users can tell it from Helm's own errors.
*/}}
{{- define "fleetpilot.validateValues" -}}
{{- $replicas := int .Values.replicas }}
{{- if lt $replicas 1 }}
{{- fail (printf "fleetpilot: replicas must be at least 1 (got %d); uninstall the release to stop the operator" $replicas) }}
{{- end }}
{{- if and (gt $replicas 1) (not .Values.leaderElection.enabled) }}
{{- fail (printf "fleetpilot: replicas must be 1 without leaderElection.enabled (got %d): kopf peering pauses every operator replica that sees a peer of the same priority, so a second replica would stop the operator instead of standing by" $replicas) }}
{{- end }}
{{- if eq (toString .Values.image.tag) "latest" }}
{{- fail "fleetpilot: image.tag \"latest\" is not allowed: pin a release tag (default: the chart's appVersion) or set image.digest" }}
{{- end }}
{{- if and .Values.image.digest (not (regexMatch "^sha256:[a-f0-9]{64}$" .Values.image.digest)) }}
{{- fail (printf "fleetpilot: image.digest must look like sha256:<64 hex digits> (got %q)" .Values.image.digest) }}
{{- end }}
{{- if not (has .Values.logFormat (list "json" "plain")) }}
{{- fail (printf "fleetpilot: logFormat must be json or plain (got %v)" .Values.logFormat) }}
{{- end }}
{{- range .Values.watchNamespaces }}
{{- if not (regexMatch "^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$" (toString .)) }}
{{- fail (printf "fleetpilot: watchNamespaces entry %q is not a valid namespace name" (toString .)) }}
{{- end }}
{{- end }}
{{- if ne (len .Values.watchNamespaces) (len (uniq .Values.watchNamespaces)) }}
{{- fail "fleetpilot: watchNamespaces lists a namespace twice" }}
{{- end }}
{{- if eq (int .Values.healthPort) (int .Values.metrics.port) }}
{{- fail (printf "fleetpilot: healthPort and metrics.port must differ (both %d)" (int .Values.healthPort)) }}
{{- end }}
{{- if and (not .Values.serviceAccount.create) (not .Values.serviceAccount.name) }}
{{- fail "fleetpilot: serviceAccount.name is required when serviceAccount.create is false" }}
{{- end }}
{{- $peering := include "fleetpilot.peeringName" . }}
{{- if not (regexMatch "^[a-z0-9]([-.a-z0-9]{0,251}[a-z0-9])?$" $peering) }}
{{- fail (printf "fleetpilot: peering.name %q is not a valid object name (lowercase DNS subdomain)" $peering) }}
{{- end }}
{{- end }}
