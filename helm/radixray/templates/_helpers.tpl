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
`radixray serve` on the head: starts the replicas in Ray.
--device cuda: the head pod has no GPU and the GPU worker pods may join after serve starts, so
"auto" could see no GPU yet. Each replica's head runs on the worker pod of its rank 0 and, with
one replica per pod, --replica-port-policy per-node puts every replica on serve.replicaPort:
the port the worker pods, the -replicas Service and the ServiceMonitor name.
*/}}
{{- define "radixray.serveCommand" -}}
{{- $args := list "radixray" "serve" "--host" "0.0.0.0" "--port" (toString .Values.serve.port) "--ray-address" "auto" -}}
{{- if .Values.model.path -}}
{{- $args = concat $args (list "--model" .Values.model.path) -}}
{{- end -}}
{{- $args = concat $args (list "--tp-size" (toString .Values.tpSize) "--replicas" (toString .Values.replicas)) -}}
{{- $args = concat $args (list "--device" "cuda" "--replica-base-port" (toString .Values.serve.replicaPort) "--replica-port-policy" "per-node") -}}
{{- $args = concat $args .Values.serve.extraArgs -}}
{{- range $i, $a := $args }}{{ if $i }} {{ end }}{{ $a | toString | squote }}{{ end -}}
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
    claimName: {{ .Values.model.persistentVolumeClaim }}
    readOnly: true
{{- end }}
{{- end -}}

{{- define "radixray.httpProbes" -}}
startupProbe:
  httpGet: {path: /health, port: {{ .port }}}
  {{- toYaml .probes.startup | nindent 2 }}
readinessProbe:
  httpGet: {path: /health, port: {{ .port }}}
  {{- toYaml .probes.readiness | nindent 2 }}
livenessProbe:
  httpGet: {path: /health, port: {{ .port }}}
  {{- toYaml .probes.liveness | nindent 2 }}
{{- end -}}
