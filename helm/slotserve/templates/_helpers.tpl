{{/*
Names. Kubernetes names and label values stop at 63 characters; KubeRay also caps a
RayService name at 47 (it appends suffixes to build the RayCluster and Service names) and
wants it to start with a letter (DNS-1035).
*/}}
{{- define "slotserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "slotserve.fullname" -}}
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

{{- define "slotserve.rayServiceName" -}}
{{- $name := include "slotserve.fullname" . | trunc 47 | trimSuffix "-" }}
{{- if not (regexMatch "^[a-z]([-a-z0-9]*[a-z0-9])?$" $name) }}
{{- fail (printf "the RayService name %q must start with a letter (KubeRay wants a DNS-1035 label): set fullnameOverride" $name) }}
{{- end }}
{{- $name }}
{{- end }}

{{/* KubeRay's name for the serve Service of a RayService; kept so that docs and NOTES match. */}}
{{- define "slotserve.serveServiceName" -}}
{{- printf "%s-serve-svc" (include "slotserve.rayServiceName" .) }}
{{- end }}

{{/* A name for an object of this release with a suffix, within 63 characters. */}}
{{- define "slotserve.suffixedName" -}}
{{- $suffix := .suffix }}
{{- printf "%s-%s" (include "slotserve.fullname" .root | trunc (int (sub 62 (len $suffix))) | trimSuffix "-") $suffix }}
{{- end }}

{{- define "slotserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "slotserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "slotserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "slotserve.labels" -}}
helm.sh/chart: {{ include "slotserve.chart" . }}
{{ include "slotserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | trunc 63 | trimSuffix "-" | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: slotserve
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Pod labels of one component (head | worker): what PDBs, monitors and policies select. */}}
{{- define "slotserve.podLabels" -}}
{{ include "slotserve.selectorLabels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- with .root.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* image by tag, or by digest when one is given (the tag then only documents it). */}}
{{- define "slotserve.image" -}}
{{- $tag := default (printf "%s-%s" .Chart.AppVersion .Values.image.variant) .Values.image.tag }}
{{- if .Values.image.digest }}
{{- printf "%s:%s@%s" .Values.image.repository $tag .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository $tag }}
{{- end }}
{{- end }}

{{/*
Drain timing, all derived from drainTimeoutSeconds (D). Serve gives an engine replica D + 5 s
to stop (the app's graceful_shutdown_timeout_s) and the Router D + 10 s. A terminating worker
tells Ray its node drains with a deadline of D + 30 s: Serve starts replacement replicas
elsewhere and stops the ones on this pod no later than the deadline minus their shutdown
time, so streams get their full D. The pod's grace period adds 15 s for Ray to exit.
*/}}
{{- define "slotserve.drainDeadlineSeconds" -}}
{{- add (int .Values.drainTimeoutSeconds) 30 }}
{{- end }}

{{- define "slotserve.terminationGracePeriodSeconds" -}}
{{- add (int .Values.drainTimeoutSeconds) 45 }}
{{- end }}

{{/* The id clients use: servedName, or what the app derives (the directory's name). */}}
{{- define "slotserve.servedModelName" -}}
{{- default (base (trimSuffix "/" .Values.model.name)) .Values.model.servedName }}
{{- end }}

{{/* Kubernetes CPU quantity ("2", "500m", 1.5) as a float, to check that a replica fits a pod. */}}
{{- define "slotserve.cpuCores" -}}
{{- $q := toString . }}
{{- if hasSuffix "m" $q }}
{{- divf (float64 (trimSuffix "m" $q)) 1000 }}
{{- else }}
{{- float64 $q }}
{{- end }}
{{- end }}

{{/* Worker groups with workerDefaults merged under each group's own settings. */}}
{{- define "slotserve.workerGroups" -}}
{{- $groups := list }}
{{- range .Values.workerGroups }}
{{- $groups = append $groups (mustMergeOverwrite (deepCopy $.Values.workerDefaults) (deepCopy .)) }}
{{- end }}
{{- toJson $groups }}
{{- end }}

{{/*
Tenants with their defaults, and where each one's Secret is mounted: the volume tenant-<index>
(a tenant's name need not be a DNS label) at tenantsMountPath/<name>, holding the file <key>.
*/}}
{{- define "slotserve.tenants" -}}
{{- $tenants := list }}
{{- range $i, $t := .Values.tenants }}
{{- $key := default "keys" (index $t "key") }}
{{- $dir := printf "%s/%s" (trimSuffix "/" $.Values.tenantsMountPath) $t.name }}
{{- $tenants = append $tenants (dict
      "name" $t.name
      "existingSecret" $t.existingSecret
      "key" $key
      "allowedPriority" (default (list 0 0) (index $t "allowedPriority"))
      "shareCache" (default false (index $t "shareCache"))
      "maxConcurrentRequests" (index $t "maxConcurrentRequests")
      "maxTokensPerMinute" (index $t "maxTokensPerMinute")
      "maxWaiting" (index $t "maxWaiting")
      "weight" (default 1 (index $t "weight"))
      "volume" (printf "tenant-%d" $i)
      "mountPath" $dir
      "keysFile" (printf "%s/%s" $dir $key)) }}
{{- end }}
{{- toJson $tenants }}
{{- end }}

{{/*
The Kubernetes node a pod runs on, for the replicas' GPU info metric (its `node` label matches
DCGM's Hostname; deployments/nvml.py).
*/}}
{{- define "slotserve.nodeEnv" -}}
- name: NODE_NAME
  valueFrom:
    fieldRef:
      fieldPath: spec.nodeName
{{- end }}

{{/*
Environment of every Ray container: deployments.app.SERVE_ENV (Serve runs the replicas' methods on
its own event loop: they never block, and the hand-off to a second loop costs CPU per streamed
message; proxy and handles reach replicas over Serve's gRPC data plane, cheaper per message than
Ray actor calls; tracebacks without column markers, whose drawing in Python 3.11 races between
threads). tests/test_helm.py checks the two agree.
*/}}
{{- define "slotserve.serveEnv" -}}
- name: RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD
  value: "0"
- name: RAY_SERVE_USE_GRPC_BY_DEFAULT
  value: "1"
- name: PYTHONNODEBUGRANGES
  value: "1"
- name: RAY_SERVE_GRPC_MAX_MESSAGE_SIZE
  value: "8388608"
{{- if eq .Values.serve.ingress "haproxy" }}
{{- /* deployments.ingress_env.haproxy_env */}}
- name: RAY_SERVE_ENABLE_HA_PROXY
  value: "1"
- name: RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S
  value: {{ .Values.serve.ingressDrainingSeconds | toString | quote }}
{{- /* the Router replicas' own ports, below Linux's ephemeral range (ingress_env.INGRESS_REPLICA_PORTS) */}}
- name: RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT
  value: "31000"
- name: RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT
  value: "31999"
- name: RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT
  value: "30000"
- name: RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT
  value: "30999"
{{- end }}
{{- end }}
