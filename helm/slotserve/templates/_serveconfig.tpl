{{/*
The Serve config (RayService spec.serveConfigV2), in the shape of configs/*.yaml. Only
fields that deployments/app.py accepts go into the app's args; tests/test_helm.py
builds every ci/ rendering through AppConfig.from_args and Ray's ServeDeploySchema.
*/}}
{{- define "slotserve.appArgs" -}}
{{- $v := .Values }}
{{- $a := $v.autoscaling }}
{{- $autoscaling := dict
      "min_replicas" $a.minReplicas
      "max_replicas" $a.maxReplicas
      "target_occupancy" $a.targetOccupancy
      "upscale_delay_s" $a.upscaleDelaySeconds
      "downscale_delay_s" $a.downscaleDelaySeconds
      "metrics_interval_s" $a.metricsIntervalSeconds
      "look_back_period_s" $a.lookBackPeriodSeconds }}
{{- if not (kindIs "invalid" $a.initialReplicas) }}
{{- $_ := set $autoscaling "initial_replicas" $a.initialReplicas }}
{{- end }}
{{- $args := dict
      "model" $v.model.name
      "engine" $v.engine
      "autoscaling" $autoscaling
      "replica_resources" (dict "num_cpus" $v.replica.numCpus "num_gpus" $v.replica.numGpus)
      "ingress" (dict "num_replicas" $v.ingress.numReplicas "num_cpus" $v.ingress.numCpus
                      "max_ongoing_requests" $v.ingress.maxOngoingRequests)
      "drain_timeout_s" $v.drainTimeoutSeconds
      "health_check_period_s" $v.healthCheck.periodSeconds
      "health_check_timeout_s" $v.healthCheck.timeoutSeconds
      "default_max_tokens" $v.limits.defaultMaxTokens
      "allowed_priority" $v.limits.allowedPriority }}
{{- with $v.model.servedName }}
{{- $_ := set $args "served_model_name" . }}
{{- end }}
{{- if not (kindIs "invalid" $v.limits.maxPromptTokens) }}
{{- $_ := set $args "max_prompt_tokens" $v.limits.maxPromptTokens }}
{{- end }}
{{- if not (kindIs "invalid" $v.limits.requestTimeoutSeconds) }}
{{- $_ := set $args "request_timeout_s" $v.limits.requestTimeoutSeconds }}
{{- end }}
{{- if $v.loraStore.enabled }}
{{- if not $v.engine.lora }}
{{- fail "loraStore.enabled: the engine serves no LoRA adapters; set engine.lora (e.g. {max_loras: 8, max_lora_rank: 16})" }}
{{- end }}
{{- $_ := set $args "lora_load_dir" $v.loraStore.mountPath }}
{{- end }}
{{- if $v.apiKeys.existingSecret }}
{{- $_ := set $args "api_keys_file" (printf "%s/keys" $v.apiKeys.mountPath) }}
{{- else if not (or $v.tenants $v.insecure) }}
{{- fail "apiKeys.existingSecret is empty: anyone who reaches the service would run inference; name a Secret of API keys (or give tenants, each with its Secret), or set insecure: true to serve without authentication" }}
{{- end }}
{{- /* Each tenant's keys file is its Secret, mounted on every Ray pod (slotserve.tenants). */}}
{{- $tenants := list }}
{{- range $t := include "slotserve.tenants" . | fromJsonArray }}
{{- $tenant := dict
      "name" $t.name
      "api_keys_file" $t.keysFile
      "allowed_priority" $t.allowedPriority
      "share_cache" $t.shareCache
      "weight" $t.weight }}
{{- if not (kindIs "invalid" $t.maxConcurrentRequests) }}
{{- $_ := set $tenant "max_concurrent_requests" $t.maxConcurrentRequests }}
{{- end }}
{{- if not (kindIs "invalid" $t.maxTokensPerMinute) }}
{{- $_ := set $tenant "max_tokens_per_minute" $t.maxTokensPerMinute }}
{{- end }}
{{- if not (kindIs "invalid" $t.maxWaiting) }}
{{- $_ := set $tenant "max_waiting" $t.maxWaiting }}
{{- end }}
{{- $tenants = append $tenants $tenant }}
{{- end }}
{{- with $tenants }}
{{- $_ := set $args "tenants" . }}
{{- end }}
{{- with $v.engineLinkTls.existingSecret }}
{{- $dir := $v.engineLinkTls.mountPath }}
{{- $_ := set $args "engine_link_tls" (dict "certfile" (printf "%s/tls.crt" $dir) "keyfile" (printf "%s/tls.key" $dir)
                                           "cafile" (printf "%s/ca.crt" $dir)) }}
{{- end }}
{{- /* tenants only from the values above, even when there are none: keys never come inline */}}
{{- range $key, $value := $v.extraAppArgs }}
{{- if or (hasKey $args $key) (eq $key "tenants") }}
{{- fail (printf "extraAppArgs.%s: the chart sets %s from its own values; set that value instead" $key $key) }}
{{- end }}
{{- $_ := set $args $key $value }}
{{- end }}
{{- toJson $args }}
{{- end }}

{{- define "slotserve.serveConfig" -}}
{{- $v := .Values }}
{{- $http := dict "host" "0.0.0.0" "port" $v.serve.httpPort }}
{{- if $v.tls.existingSecret }}
{{- $_ := set $http "ssl_certfile" (printf "%s/tls.crt" $v.tls.mountPath) }}
{{- $_ := set $http "ssl_keyfile" (printf "%s/tls.key" $v.tls.mountPath) }}
{{- end }}
{{- $grpc := dict
      "port" $v.serve.grpcPort
      "grpc_servicer_functions" (list
        "deployments.grpc_registration.add_slotserve_servicer"
        "grpc_health.v1.health_pb2_grpc.add_HealthServicer_to_server") }}
{{- $app := dict
      "name" "slotserve"
      "route_prefix" "/"
      "import_path" "deployments.app:build_app"
      "args" (include "slotserve.appArgs" . | fromJson) }}
{{- /* A proxy on every pod: the workers' readiness probes and the serve Service rely on it. */}}
{{- $config := dict
      "proxy_location" "EveryNode"
      "http_options" $http
      "grpc_options" $grpc
      "applications" (list $app) }}
{{- toYaml $config }}
{{- end }}

{{/*
Checks the schema cannot express: they compare values with each other.
*/}}
{{- define "slotserve.validate" -}}
{{- $v := .Values }}
{{- if and $v.tls.existingSecret (eq $v.serve.ingress "haproxy") }}
{{- fail "tls.existingSecret: HAProxy mode (serve.ingress: haproxy) serves plain HTTP; set serve.ingress: proxy for HTTPS, or terminate TLS in front of the Service" }}
{{- end }}
{{- $tenantNames := list }}
{{- range $t := include "slotserve.tenants" . | fromJsonArray }}
{{- if has $t.name $tenantNames }}
{{- fail (printf "tenants: %q is named twice (each tenant has its own keys and mount)" $t.name) }}
{{- end }}
{{- $tenantNames = append $tenantNames $t.name }}
{{- if gt (index $t.allowedPriority 0 | int64) (index $t.allowedPriority 1 | int64) }}
{{- fail (printf "tenants: %q has allowedPriority %s; it is [lowest, highest]" $t.name (toJson $t.allowedPriority)) }}
{{- end }}
{{- end }}
{{- if gt (int $v.autoscaling.minReplicas) (int $v.autoscaling.maxReplicas) }}
{{- fail (printf "autoscaling.minReplicas (%v) must not exceed autoscaling.maxReplicas (%v)" $v.autoscaling.minReplicas $v.autoscaling.maxReplicas) }}
{{- end }}
{{- if le (float64 $v.autoscaling.lookBackPeriodSeconds) (float64 $v.autoscaling.metricsIntervalSeconds) }}
{{- fail (printf "autoscaling.lookBackPeriodSeconds (%v) must exceed autoscaling.metricsIntervalSeconds (%v)" $v.autoscaling.lookBackPeriodSeconds $v.autoscaling.metricsIntervalSeconds) }}
{{- end }}
{{- $tp := int (default 1 (index $v.engine "tensor_parallel_size")) }}
{{- if and (gt $tp 1) (gt (float64 $v.replica.numGpus) 1.0) }}
{{- fail (printf "replica.numGpus must be 0 or 1 with engine.tensor_parallel_size %d (it is one rank's share), got %v" $tp $v.replica.numGpus) }}
{{- end }}
{{- /* A replica (all its ranks) must fit one pod: Ray packs a tensor-parallel replica on one node. */}}
{{- $gpus := mulf $tp $v.replica.numGpus }}
{{- $cpus := mulf $tp $v.replica.numCpus }}
{{- $fits := false }}
{{- range $g := include "slotserve.workerGroups" . | fromJsonArray }}
{{- if and (le $gpus (float64 $g.gpus)) (le $cpus (include "slotserve.cpuCores" $g.resources.limits.cpu | float64)) }}
{{- $fits = true }}
{{- end }}
{{- end }}
{{- if not $fits }}
{{- fail (printf "no worker group can hold one engine replica (%v GPUs, %v CPUs with tensor_parallel_size %d): raise a group's gpus or resources.limits.cpu" $gpus $cpus $tp) }}
{{- end }}
{{- end }}
