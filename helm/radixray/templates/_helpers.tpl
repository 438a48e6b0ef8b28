{{/* Chart name, overridable. */}}
{{- define "radixray.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
Full name of this release's objects. Kept to 40 characters: KubeRay derives longer names
(e.g. <name>-head-svc, <name>-gpu-worker-xxxxx) that must stay under 63.
*/}}
{{- define "radixray.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "radixray.selectorLabels" -}}
app.kubernetes.io/name: {{ include "radixray.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "radixray.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "radixray.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "radixray.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* The service KubeRay creates for the head pod. */}}
{{- define "radixray.headService" -}}
{{- printf "%s-head-svc" (include "radixray.fullname" .) -}}
{{- end -}}

{{/*
Quotes one word for bash: '...' with every ' inside written '\'' (close the quotes, an escaped
quote, reopen), so any string (spaces, $, `, ", \, ') reaches the program as it is. The result
goes into a YAML block scalar, so values must not hold line breaks (values.schema.json rejects
them in model.path and serve.extraArgs). Kubernetes still expands $(VAR) in container args.
*/}}
{{- define "radixray.shellQuote" -}}
{{- printf "'%s'" (toString . | replace "'" "'\\''") -}}
{{- end -}}

{{/*
`radixray serve` on the head: starts the replicas in Ray.
--device cuda: the head pod has no GPU and the GPU worker pods may join after serve starts, so
"auto" could see no GPU yet. --placement-timeout 0: serve waits for each replica's GPUs without
a limit (logging progress), since the GPU pods may need a node autoscaler, a multi-GB image pull
and a model download first; serve's default limit would end the head's main process, and with
it the Ray cluster. Each replica's head runs on the worker pod of its rank 0 and, with one
replica per pod, --replica-port-policy per-node puts every replica on serve.replicaPort: the
port the worker pods, the -replicas Service and the ServiceMonitor name. serve.extraArgs come
last, so they can override any of these (argparse keeps the last value).
*/}}
{{- define "radixray.serveCommand" -}}
{{- $args := list "radixray" "serve" "--host" "0.0.0.0" "--port" (toString .Values.serve.port) "--ray-address" "auto" -}}
{{- if .Values.model.path -}}
{{- $args = concat $args (list "--model" .Values.model.path) -}}
{{- end -}}
{{- $args = concat $args (list "--tp-size" (toString .Values.tpSize) "--replicas" (toString .Values.replicas)) -}}
{{- $args = concat $args (list "--device" "cuda" "--replica-base-port" (toString .Values.serve.replicaPort) "--replica-port-policy" "per-node") -}}
{{- $args = concat $args (list "--placement-timeout" "0") -}}
{{- $args = concat $args .Values.serve.extraArgs -}}
{{- range $i, $a := $args }}{{ if $i }} {{ end }}{{ include "radixray.shellQuote" $a }}{{ end -}}
{{- end -}}

{{- define "radixray.modelVolumeMount" -}}
{{- if .Values.model.persistentVolumeClaim }}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
{{- end }}
{{- end -}}

{{- define "radixray.modelVolume" -}}
{{- if .Values.model.persistentVolumeClaim }}
- name: model
  persistentVolumeClaim:
    claimName: {{ .Values.model.persistentVolumeClaim | quote }}
    readOnly: true
{{- end }}
{{- end -}}

{{/*
Probes of a radixray router: the router Deployment's, and the router that `radixray serve` runs
on serve.port in the head pod (router.enabled only adds the Deployment; serve always runs its
own router). GET /liveness is 200 while the router process runs; GET /readiness is 200 while a
replica can take a request. Liveness never depends on the replicas: a replica reloading its
model (minutes on GPUs) must not get the router, or the head and with it the whole Ray
cluster, restarted. /health (503 while no replica is healthy) is for clients, not probes.
*/}}

{{/*
The router Deployment: its process answers /liveness seconds after it starts (it imports no
torch and finds the replicas in the background), so the startup probe needs no replica.
*/}}
{{- define "radixray.routerProbes" -}}
startupProbe:
  httpGet: {path: /liveness, port: {{ .port }}}
  {{- toYaml .probes.startup | nindent 2 }}
readinessProbe:
  httpGet: {path: /readiness, port: {{ .port }}}
  {{- toYaml .probes.readiness | nindent 2 }}
livenessProbe:
  httpGet: {path: /liveness, port: {{ .port }}}
  {{- toYaml .probes.liveness | nindent 2 }}
{{- end -}}

{{/*
The head. `radixray serve` starts its router on serve.port only after every replica has been
placed and has loaded its model, one after another, and with --placement-timeout 0 it waits for
GPU pods without a limit. Any probe of serve.port would therefore need every replica up, for an
unbounded time, so the head has no startup probe and its liveness probe is an exec:
  - the router answers GET /liveness: alive;
  - no router process yet (`python -m radixray.router`, found in /proc): serve is still bringing
    the replicas up: alive. serve is the container's main process, and it exits (restarting
    the container) when it fails;
  - a router process that does not answer: dead.
Readiness is /readiness on serve.port: not ready until the router runs and a replica is
available. That gates no Ray traffic: KubeRay's head Service is headless and publishes
not-ready addresses (unless the operator runs with ENABLE_RAY_HEAD_CLUSTER_IP_SERVICE=true).
*/}}
{{- define "radixray.headProbes" -}}
readinessProbe:
  httpGet: {path: /readiness, port: http}
  {{- toYaml .Values.probes.readiness | nindent 2 }}
livenessProbe:
  exec:
    command:
      - /bin/sh
      - -c
      - {{ printf "wget -q -T 5 -O /dev/null http://127.0.0.1:%v/liveness || ! grep -qs 'radixray[.]router' /proc/[0-9]*/cmdline" .Values.serve.port | quote }}
  {{- toYaml .Values.probes.liveness | nindent 2 }}
{{- end -}}

{{/*
The API key from .Values.apiKey's Secret as the environment variable named by "var" (a list
item of a container's env), or nothing without a Secret. Call with (dict "root" . "var" NAME).
*/}}
{{- define "radixray.apiKeyEnv" -}}
{{- with .root.Values.apiKey }}{{ if .existingSecret }}
- name: {{ $.var }}
  valueFrom:
    secretKeyRef:
      name: {{ .existingSecret | quote }}
      key: {{ .secretKey | quote }}
{{- end }}{{ end }}
{{- end }}
