{{/* Names and labels. */}}
{{- define "flotilla.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "flotilla.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "flotilla.labels" -}}
{{ include "flotilla.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "flotilla.secretName" -}}
{{- .Values.secrets.existingSecret | default (printf "%s-secrets" (include "flotilla.fullname" .)) -}}
{{- end -}}

{{/* Values of one pod role: "head" (kuberay head) or "worker" (kuberay workers, lws leaders and workers). */}}
{{- define "flotilla.role" -}}
{{- toYaml (get .root.Values .role) -}}
{{- end -}}

{{/* Pod-template metadata of every pod that mounts the serve config: the role's podLabels and
     podAnnotations (the chart's own keys win), the selector labels, the component, and a checksum of
     the ConfigMap so that a changed `config` (or wait_for_slots.py) changes the pod template and
     rolls the pods (each mode's roll-out: deploy/helm/README.md). Args: root, role, component. */}}
{{- define "flotilla.podMetadata" -}}
{{- $root := .root -}}
{{- $role := fromYaml (include "flotilla.role" .) -}}
{{- $labels := fromYaml (include "flotilla.selectorLabels" $root) -}}
{{- $_ := set $labels "app.kubernetes.io/component" .component -}}
{{- $checksum := include (print $root.Template.BasePath "/configmap.yaml") $root | sha256sum -}}
{{- $annotations := dict "checksum/config" $checksum -}}
labels:
  {{- toYaml (merge $labels ($role.podLabels | default dict)) | nindent 2 }}
annotations:
  {{- toYaml (merge $annotations ($role.podAnnotations | default dict)) | nindent 2 }}
{{- end -}}

{{/* Pod-spec fields every pod template shares, from the role's values (escape hatches included).
     Args: root, role, component. */}}
{{- define "flotilla.podSpec" -}}
{{- $root := .root -}}
{{- $role := fromYaml (include "flotilla.role" .) -}}
terminationGracePeriodSeconds: {{ $root.Values.terminationGracePeriodSeconds }}
{{- with $root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $role.serviceAccountName }}
serviceAccountName: {{ . }}
{{- end }}
{{- with $role.runtimeClassName }}
runtimeClassName: {{ . }}
{{- end }}
{{- with $role.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with $role.podSecurityContext }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $role.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $role.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
tolerations:
  {{- include "flotilla.nodeLossTolerations" $root | nindent 2 }}
  {{- with $role.tolerations }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- with $role.topologySpreadConstraints }}
{{- $selector := fromYaml (include "flotilla.selectorLabels" $root) }}
{{- $_ := set $selector "app.kubernetes.io/component" $.component }}
topologySpreadConstraints:
{{- range . }}
{{- $constraint := deepCopy . }}
{{- if not (hasKey $constraint "labelSelector") }}
{{- $_ := set $constraint "labelSelector" (dict "matchLabels" $selector) }}
{{- end }}
  - {{- toYaml $constraint | nindent 4 }}
{{- end }}
{{- end }}
{{- end -}}

{{/* Container fields from the role's values: securityContext (e.g. IPC_LOCK for RDMA). */}}
{{- define "flotilla.containerSecurity" -}}
{{- $role := fromYaml (include "flotilla.role" .) -}}
{{- with $role.securityContext }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* The role's extra environment (NCCL and GLOO interfaces, NCCL_DEBUG, …), after the chart's own. */}}
{{- define "flotilla.extraEnv" -}}
{{- $role := fromYaml (include "flotilla.role" .) -}}
{{- with $role.env }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "flotilla.extraEnvFrom" -}}
{{- $role := fromYaml (include "flotilla.role" .) -}}
{{- with $role.envFrom }}
envFrom:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{- define "flotilla.extraVolumeMounts" -}}
{{- $role := fromYaml (include "flotilla.role" .) -}}
{{- with $role.extraVolumeMounts }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "flotilla.extraVolumes" -}}
{{- $role := fromYaml (include "flotilla.role" .) -}}
{{- with $role.extraVolumes }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "flotilla.image" -}}
{{- printf "%s:%s" .Values.image.repository .Values.image.tag -}}
{{- end -}}

{{/* Layout: TP stays inside a node, so accelerator.perNode must be a multiple of TP; a group
     spans ceil(TP × PP / perNode) nodes. Broken layouts fail here with the rule they break. */}}
{{/* Accelerators of one replica group: TP × PP, times the DP ranks of a wide-EP group. */}}
{{- define "flotilla.groupSlots" -}}
{{- $tp := int .Values.config.tensor_parallel_size -}}
{{- $pp := int .Values.config.pipeline_parallel_size -}}
{{- mul (mul $tp $pp) (int (.Values.config.data_parallel_size | default 1)) -}}
{{- end -}}

{{- define "flotilla.nodesPerGroup" -}}
{{- $tp := int .Values.config.tensor_parallel_size -}}
{{- $per := int .Values.accelerator.perNode -}}
{{- if ne (mod $per $tp) 0 -}}
{{- fail (printf "accelerator.perNode (%d) must be a multiple of config.tensor_parallel_size (%d): tensor-parallel ranks stay on one node" $per $tp) -}}
{{- end -}}
{{- $slots := int (include "flotilla.groupSlots" .) -}}
{{- if and (gt $slots $per) (ne (mod $slots $per) 0) -}}
{{- fail (printf "config.tensor_parallel_size × pipeline_parallel_size × data_parallel_size (%d) must fill whole nodes of accelerator.perNode (%d) when a group spans nodes" $slots $per) -}}
{{- end -}}
{{- div (add $slots (sub $per 1)) $per -}}
{{- end -}}

{{/* Accelerators each Ray node of a group declares: a group smaller than a node uses only its slots. */}}
{{- define "flotilla.slotsPerNode" -}}
{{- $slots := int (include "flotilla.groupSlots" .) -}}
{{- min $slots (int .Values.accelerator.perNode) -}}
{{- end -}}

{{/* flotilla.yaml: the user's ServeConfig fields plus what the chart owns. */}}
{{- define "flotilla.serveConfig" -}}
{{- $config := deepCopy .Values.config -}}
{{- $_ := set $config "model" .Values.model.path -}}
{{- $_ := set $config "host" "0.0.0.0" -}}
{{- $_ := set $config "cluster" (dict "address" "auto") -}}
{{- if eq .Values.mode "lws" -}}
{{- $_ := set $config "groups" 1 -}}
{{- $_ := unset $config "min_ready_groups" -}}
{{- end -}}
{{- toYaml $config -}}
{{- end -}}

{{/* Environment every Ray process needs (IngressConfig.ray_env() in router/settings.py). */}}
{{- define "flotilla.rayEnv" -}}
{{- $ingress := .Values.config.ingress | default dict -}}
{{- if ne ($ingress.proxy | default "haproxy") "serve" }}
- name: RAY_SERVE_ENABLE_DIRECT_INGRESS
  value: "1"
- name: RAY_SERVE_ENABLE_HA_PROXY
  value: "1"
- name: RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S
  value: {{ (hasKey $ingress "drain_period_s") | ternary $ingress.drain_period_s 2.0 | float64 | toString | quote }}
{{- end }}
{{- end -}}

{{- define "flotilla.secretEnv" -}}
- name: {{ .Values.config.admin_token_env | default "FLOTILLA_ADMIN_TOKEN" }}
  valueFrom:
    secretKeyRef: {name: {{ include "flotilla.secretName" . }}, key: admin-token, optional: true}
- name: HF_TOKEN
  valueFrom:
    secretKeyRef: {name: {{ include "flotilla.secretName" . }}, key: hf-token, optional: true}
{{- with (.Values.config.serving | default dict).api_keys_env }}
- name: {{ . }}
  valueFrom:
    secretKeyRef: {name: {{ include "flotilla.secretName" $ }}, key: api-keys}
{{- end }}
{{- end -}}

{{- define "flotilla.acceleratorResources" -}}
{{- $res := deepCopy .Values.worker.resources -}}
{{- if eq .Values.accelerator.type "nvidia" -}}
{{- $n := include "flotilla.slotsPerNode" . -}}
{{- $limits := $res.limits | default dict -}}
{{- $_ := set $limits .Values.accelerator.resourceName (int $n) -}}
{{- $_ := set $res "limits" $limits -}}
{{- end -}}
{{- toYaml $res -}}
{{- end -}}

{{- define "flotilla.nodeLossTolerations" -}}
- key: node.kubernetes.io/not-ready
  operator: Exists
  effect: NoExecute
  tolerationSeconds: {{ .Values.nodeLossTolerationSeconds }}
- key: node.kubernetes.io/unreachable
  operator: Exists
  effect: NoExecute
  tolerationSeconds: {{ .Values.nodeLossTolerationSeconds }}
{{- end -}}

{{- define "flotilla.volumes" -}}
{{- $volume := .Values.model.volume -}}
{{- if and (hasKey $volume "emptyDir") (not ($volume.emptyDir | default dict).sizeLimit) -}}
{{- fail "model.volume.emptyDir needs a sizeLimit (the model's size plus headroom): without one a download can fill the node's disk" -}}
{{- end -}}
- name: config
  configMap:
    name: {{ include "flotilla.fullname" . }}-config
{{- if include "flotilla.apiKeysMounted" . }}
# The Secret's api-keys as a file: the kubelet updates it in place, and the ingress follows it.
- name: api-keys
  secret:
    secretName: {{ include "flotilla.secretName" . }}
    items: [{key: api-keys, path: api-keys}]
{{- end }}
- name: model
{{- if $volume }}
{{ toYaml $volume | indent 2 }}
{{- else }}
  persistentVolumeClaim:
    claimName: {{ required "model.existingClaim or model.volume must say where the model is" .Values.model.existingClaim }}
    readOnly: {{ not .Values.model.download.repo }}
{{- end }}
{{- end -}}

{{- define "flotilla.volumeMounts" -}}
- name: config
  mountPath: /etc/flotilla
  readOnly: true
{{- if include "flotilla.apiKeysMounted" . }}
- name: api-keys
  mountPath: /etc/flotilla-secrets
  readOnly: true
{{- end }}
- name: model
  mountPath: {{ .Values.model.mountPath }}
{{- end -}}

{{- define "flotilla.downloadInit" -}}
{{- with .Values.model.download }}
{{- if .repo }}
{{- if not (regexMatch "^[0-9a-f]{40}$" (.revision | default "")) }}
{{- fail (printf "model.download.revision must be the 40-character commit of %s to download (got %q): every pod, now and after any restart, must load the same weights" .repo (.revision | default "")) }}
{{- end }}
- name: download-model
  image: {{ include "flotilla.image" $ }}
  imagePullPolicy: {{ $.Values.image.pullPolicy }}
  command: [python, -c]
  args:
    - |
      import fcntl, pathlib
      from huggingface_hub import snapshot_download
      repo, revision, path = {{ .repo | quote }}, {{ .revision | quote }}, pathlib.Path({{ $.Values.model.path | quote }})
      path.mkdir(parents=True, exist_ok=True)
      done = path / f".flotilla-downloaded-{revision}"
      with open(path.parent / ".flotilla-download.lock", "w") as lock:
          fcntl.flock(lock, fcntl.LOCK_EX)  # pods sharing the volume on one node download once
          if done.exists():
              print(f"{repo}@{revision} already in {path}")
          else:
              snapshot_download(repo, revision=revision, local_dir=path)
              done.touch()  # last: a download cut short is resumed by the next pod
  env:
{{ include "flotilla.secretEnv" $ | indent 4 }}
  volumeMounts:
    - name: model
      mountPath: {{ $.Values.model.mountPath }}
{{- end }}
{{- end }}
{{- end -}}

{{/* Probes of the container that serves HTTP. Port names are KubeRay's (serve, gcs-server, …). */}}
{{- define "flotilla.httpProbes" -}}
{{- $startup := .Values.probes.startup -}}
{{- $budget := mul (int $startup.periodSeconds) (int $startup.failureThreshold) -}}
{{- $need := add (int .Values.waitForWorkersSeconds) (int (.Values.config.startup_timeout_s | default 900)) 60 -}}
{{- if lt $budget $need -}}
{{- fail (printf "probes.startup allows %d s (periodSeconds × failureThreshold) but the pod may need %d s: waitForWorkersSeconds (%d) + config.startup_timeout_s (%d) + 60 s for Ray; raise probes.startup.failureThreshold" $budget $need (int .Values.waitForWorkersSeconds) (int (.Values.config.startup_timeout_s | default 900))) -}}
{{- end -}}
startupProbe:
  httpGet: {path: /health, port: serve}
  periodSeconds: {{ .Values.probes.startup.periodSeconds }}
  failureThreshold: {{ .Values.probes.startup.failureThreshold }}
  timeoutSeconds: {{ .Values.probes.startup.timeoutSeconds }}
livenessProbe:
  httpGet: {path: /api/gcs_healthz, port: dashboard}
  periodSeconds: {{ .Values.probes.liveness.periodSeconds }}
  failureThreshold: {{ .Values.probes.liveness.failureThreshold }}
  timeoutSeconds: {{ .Values.probes.liveness.timeoutSeconds }}
readinessProbe:
  httpGet: {path: /health, port: serve}
  periodSeconds: {{ .Values.probes.readiness.periodSeconds }}
  failureThreshold: {{ .Values.probes.readiness.failureThreshold }}
  timeoutSeconds: {{ .Values.probes.readiness.timeoutSeconds }}
{{- end -}}

{{/* Probes of accelerator pods that serve no HTTP: the local raylet, through the dashboard agent.
     Args: root, liveness. kuberay workers get all three (KubeRay would inject its own liveness and
     readiness otherwise; the startup probe keeps liveness off until the raylet first answers). lws
     workers get readiness only: their container is `ray start --block`, so a dead raylet already
     restarts it, and a liveness failure while a worker still waits for its leader would recreate
     the whole LWS group. */}}
{{- define "flotilla.workerProbes" -}}
{{- $p := .root.Values.probes.worker -}}
{{- $get := dict "path" "/api/local_raylet_healthz" "port" 52365 -}}
{{- if .liveness }}
startupProbe:
  httpGet: {{ toJson $get }}
  periodSeconds: 10
  failureThreshold: {{ add 6 (div (int .root.Values.waitForWorkersSeconds) 10) }}
  timeoutSeconds: {{ $p.timeoutSeconds }}
livenessProbe:
  httpGet: {{ toJson $get }}
  periodSeconds: {{ $p.periodSeconds }}
  failureThreshold: {{ $p.failureThreshold }}
  timeoutSeconds: {{ $p.timeoutSeconds }}
{{- end }}
readinessProbe:
  httpGet: {{ toJson $get }}
  periodSeconds: {{ $p.periodSeconds }}
  failureThreshold: {{ $p.failureThreshold }}
  timeoutSeconds: {{ $p.timeoutSeconds }}
{{- end -}}

{{/* The head's ray start flags for GCS fault tolerance: KubeRay sets RAY_REDIS_ADDRESS and
     REDIS_PASSWORD in the head container, but only adds --redis-password to commands it writes. */}}
{{- define "flotilla.redisPasswordFlag" -}}
{{- $ft := .Values.kuberay.gcsFaultTolerance -}}
{{- if and $ft.enabled $ft.redisPassword }} --redis-password="${REDIS_PASSWORD}"{{ end -}}
{{- end -}}

{{- define "flotilla.ports" -}}
- {name: serve, containerPort: {{ .Values.config.port | default 8000 }}}
- {name: gcs-server, containerPort: 6379}
- {name: dashboard, containerPort: 8265}
- {name: client, containerPort: 10001}
- {name: metrics, containerPort: 8080}
{{- range $rank := until (include "flotilla.replicaMetricsPorts" . | int) }}
- {name: {{ printf "rep-metrics-%d" $rank }}, containerPort: {{ add (int $.Values.config.ingress.metrics_port) $rank }}}
{{- end }}
{{- end -}}

{{/* How many ingress replicas serve their own metrics port on the serving pod (0: off). */}}
{{- define "flotilla.replicaMetricsPorts" -}}
{{- $ingress := .Values.config.ingress | default dict -}}
{{- if $ingress.metrics_port -}}
{{- $ingress.replicas | default 1 | int -}}
{{- else -}}
0
{{- end -}}
{{- end -}}

{{/* Interval, timeout and (lws) the group relabelling of every ServiceMonitor endpoint. */}}
{{- define "flotilla.scrapeSettings" -}}
interval: {{ .Values.metrics.serviceMonitor.interval }}
scrapeTimeout: {{ .Values.metrics.serviceMonitor.scrapeTimeout }}
{{- if eq .Values.mode "lws" }}
# Every LWS group is its own Ray cluster whose only group is "group-0": name it after
# the LWS group index instead, so dashboards and alerts see distinct groups.
relabelings:
  - sourceLabels: [__meta_kubernetes_pod_label_leaderworkerset_sigs_k8s_io_group_index]
    targetLabel: lws_group
metricRelabelings:
  - sourceLabels: [lws_group, group]
    regex: "(.+);group-.*"
    targetLabel: group
    replacement: group-$1
{{- end }}
{{- end -}}

{{/* "true" when config.serving.api_keys_file is the chart's mount of the Secret's api-keys. */}}
{{- define "flotilla.apiKeysMounted" -}}
{{- $file := (.Values.config.serving | default dict).api_keys_file | default "" -}}
{{- if eq $file "/etc/flotilla-secrets/api-keys" -}}true{{- end -}}
{{- end -}}
