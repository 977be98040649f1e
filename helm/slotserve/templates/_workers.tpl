{{/*
Ray node health from its dashboard agent (Ray >= 2.53: raylet, and GCS on the head). It never
asks the app, so a replica busy in a long prefill cannot fail it.
*/}}
{{- define "slotserve.nodeHealthProbe" -}}
httpGet:
  path: /api/healthz
  port: 52365
initialDelaySeconds: 10
periodSeconds: {{ .periodSeconds }}
timeoutSeconds: 5
failureThreshold: {{ .failureThreshold }}
{{- end }}

{{/*
Worker readiness decides which pods the serve Service sends clients to. grpc: the app's
health service through this pod's Serve proxy; for slotserve.v1.SlotServe it answers SERVING
once an engine replica is ready. With minReplicas 0 no engine may be running, so the probe
asks for "" (proxy and Router up) or the pods would never take the request that scales up.
*/}}
{{- define "slotserve.workerReadinessProbe" -}}
{{- $v := .Values -}}
{{- if eq $v.probes.readiness "grpc" -}}
grpc:
  port: {{ $v.serve.grpcPort }}
  service: {{ ternary "" "slotserve.v1.SlotServe" (eq (int $v.autoscaling.minReplicas) 0) | quote }}
{{- else -}}
httpGet:
  path: /-/healthz
  port: {{ $v.serve.httpPort }}
  scheme: {{ ternary "HTTPS" "HTTP" (not (empty $v.tls.existingSecret)) }}
{{- end }}
initialDelaySeconds: 10
periodSeconds: {{ $v.probes.readinessPeriodSeconds }}
timeoutSeconds: 5
successThreshold: 1
failureThreshold: 2
{{- end }}

{{/*
preStop: ask Ray to drain this node (Serve then moves its replicas elsewhere and stops the local
ones gracefully, streams finishing), and wait until no Serve replica runs here or the deadline
passes. The [S] keeps grep from matching its own command line.
*/}}
{{- define "slotserve.preStop" -}}
{{- $deadline := include "slotserve.drainDeadlineSeconds" . -}}
exec:
  command:
    - /bin/bash
    - -c
    - |
      ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION --reason-message "pod $HOSTNAME terminating" \
        --deadline-remaining-seconds {{ $deadline }} || echo "ray drain-node failed; waiting for replicas anyway" >&2
      end=$((SECONDS + {{ $deadline }}))
      while [ "$SECONDS" -lt "$end" ] && grep -qs '[S]erveReplica' /proc/[0-9]*/cmdline; do sleep 1; done
{{- end }}

{{- define "slotserve.workerGroup" -}}
{{- $root := .root }}
{{- $v := $root.Values }}
{{- $g := .group }}
{{- $gpus := int $g.gpus }}
{{- $resources := deepCopy $g.resources }}
{{- if gt $gpus 0 }}
{{- $_ := set $resources "limits" (merge (dict "nvidia.com/gpu" $gpus) (default dict $resources.limits)) }}
{{- $_ := set $resources "requests" (merge (dict "nvidia.com/gpu" $gpus) (default dict $resources.requests)) }}
{{- end }}
{{- $nodeSelector := $g.nodeSelector }}
{{- $tolerations := $g.tolerations }}
{{- if gt $gpus 0 }}
{{- $nodeSelector = merge (deepCopy $g.nodeSelector) $v.gpuNodes.nodeSelector }}
{{- $tolerations = concat $v.gpuNodes.tolerations $g.tolerations }}
{{- end }}
- groupName: {{ $g.name }}
  replicas: {{ $g.minReplicas }}
  minReplicas: {{ $g.minReplicas }}
  maxReplicas: {{ $g.maxReplicas }}
  rayStartParams:
    metrics-export-port: "8080"
    {{- range $key, $value := $g.rayStartParams }}
    {{ $key }}: {{ $value | toString | quote }}
    {{- end }}
  template:
    metadata:
      labels:
        {{- include "slotserve.podLabels" (dict "root" $root "component" "worker") | nindent 8 }}
        slotserve.io/worker-group: {{ $g.name }}
      {{- with $v.podAnnotations }}
      annotations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
    spec:
      # Covers the preStop drain (deadline {{ include "slotserve.drainDeadlineSeconds" $root }} s) plus Ray's exit.
      terminationGracePeriodSeconds: {{ include "slotserve.terminationGracePeriodSeconds" $root }}
      {{- with $v.serviceAccount.name }}
      serviceAccountName: {{ . }}
      {{- end }}
      # Workers never call the Kubernetes API (the autoscaler runs in the head pod).
      automountServiceAccountToken: false
      {{- with $v.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      securityContext:
        {{- toYaml $v.podSecurityContext | nindent 8 }}
      {{- with $nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $g.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      containers:
        - name: ray-worker
          image: {{ .image }}
          imagePullPolicy: {{ $v.image.pullPolicy }}
          ports:
            - name: serve
              containerPort: {{ $v.serve.httpPort }}
            - name: serve-grpc
              containerPort: {{ $v.serve.grpcPort }}
            - name: metrics
              containerPort: 8080
          env:
            - name: SLOTSERVE_CACHE
              value: {{ printf "%s/models" $v.modelCache.mountPath | quote }}
            # Compiled kernels and graphs are code this pod runs: never from a volume other pods write.
            - name: SLOTSERVE_CODE_CACHE
              value: {{ $v.codeCache.mountPath | quote }}
            {{- include "slotserve.serveEnv" $root | nindent 12 }}
            {{- include "slotserve.nodeEnv" $root | nindent 12 }}
            {{- with $v.extraEnv }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          resources:
            {{- toYaml $resources | nindent 12 }}
          securityContext:
            {{- toYaml $v.containerSecurityContext | nindent 12 }}
          lifecycle:
            preStop:
              {{- include "slotserve.preStop" $root | nindent 14 }}
          readinessProbe:
            {{- include "slotserve.workerReadinessProbe" $root | nindent 12 }}
          livenessProbe:
            {{- include "slotserve.nodeHealthProbe" (dict "periodSeconds" 10 "failureThreshold" $v.probes.livenessFailureThreshold) | nindent 12 }}
          volumeMounts:
            - name: shared-mem
              mountPath: /dev/shm
            - name: model-cache
              mountPath: {{ $v.modelCache.mountPath }}
            - name: code-cache
              mountPath: {{ $v.codeCache.mountPath }}
            {{- if $v.modelStore.enabled }}
            - name: model-store
              mountPath: {{ $v.modelStore.mountPath }}
              readOnly: true
            {{- end }}
            {{- if $v.loraStore.enabled }}
            - name: lora-store
              mountPath: {{ $v.loraStore.mountPath }}
              readOnly: true
            {{- end }}
            {{- if $v.apiKeys.existingSecret }}
            - name: api-keys
              mountPath: {{ $v.apiKeys.mountPath }}
              readOnly: true
            {{- end }}
            {{- range $t := include "slotserve.tenants" $root | fromJsonArray }}
            - name: {{ $t.volume }}
              mountPath: {{ $t.mountPath | quote }}
              readOnly: true
            {{- end }}
            {{- if $v.tls.existingSecret }}
            - name: tls
              mountPath: {{ $v.tls.mountPath }}
              readOnly: true
            {{- end }}
            {{- if $v.engineLinkTls.existingSecret }}
            - name: link-tls
              mountPath: {{ $v.engineLinkTls.mountPath }}
              readOnly: true
            {{- end }}
      volumes:
        - name: shared-mem
          emptyDir:
            medium: Memory
            sizeLimit: {{ $g.shmSize }}
        - name: code-cache
          emptyDir:
            sizeLimit: {{ $v.codeCache.sizeLimit }}
        - name: model-cache
          {{- if eq $v.modelCache.type "pvc" }}
          persistentVolumeClaim:
            claimName: {{ default (include "slotserve.suffixedName" (dict "root" $root "suffix" "model-cache")) $v.modelCache.pvc.existingClaim }}
          {{- else }}
          emptyDir:
            sizeLimit: {{ $v.modelCache.sizeLimit }}
          {{- end }}
        {{- if $v.modelStore.enabled }}
        - name: model-store
          persistentVolumeClaim:
            claimName: {{ $v.modelStore.existingClaim }}
            readOnly: true
        {{- end }}
        {{- if $v.loraStore.enabled }}
        - name: lora-store
          persistentVolumeClaim:
            claimName: {{ required "loraStore.existingClaim: name the claim holding the adapters" $v.loraStore.existingClaim }}
            readOnly: true
        {{- end }}
        {{- if $v.apiKeys.existingSecret }}
        - name: api-keys
          secret:
            secretName: {{ $v.apiKeys.existingSecret }}
            items:
              - key: {{ $v.apiKeys.key }}
                path: keys
        {{- end }}
        {{- range $t := include "slotserve.tenants" $root | fromJsonArray }}
        - name: {{ $t.volume }}
          secret:
            secretName: {{ $t.existingSecret }}
            items:
              - key: {{ $t.key | quote }}
                path: {{ $t.key | quote }}
        {{- end }}
        {{- if $v.tls.existingSecret }}
        - name: tls
          secret:
            secretName: {{ $v.tls.existingSecret }}
        {{- end }}
        {{- if $v.engineLinkTls.existingSecret }}
        - name: link-tls
          secret:
            secretName: {{ $v.engineLinkTls.existingSecret }}
        {{- end }}
{{- end }}
