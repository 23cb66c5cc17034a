{{/* Chart name, overridable. */}}
{{- define "gpu-dra-driver.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Object name prefix: the release name if it already contains the chart name, else
"<release>-<chart>". At most 63 characters, without a trailing dash.
*/}}
{{- define "gpu-dra-driver.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := include "gpu-dra-driver.name" . }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "gpu-dra-driver.namespace" -}}
{{- default .Release.Namespace .Values.namespaceOverride }}
{{- end }}

{{- define "gpu-dra-driver.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "gpu-dra-driver.selectorLabels" -}}
app.kubernetes.io/name: {{ include "gpu-dra-driver.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "gpu-dra-driver.labels" -}}
helm.sh/chart: {{ include "gpu-dra-driver.chart" . }}
{{ include "gpu-dra-driver.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "gpu-dra-driver.driverName" -}}
{{- required "driverName must be set" .Values.driverName }}
{{- end }}

{{- define "gpu-dra-driver.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "gpu-dra-driver.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (printf "%s-kubeletplugin" (include "gpu-dra-driver.fullname" .)) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create=false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "gpu-dra-driver.webhookServiceAccountName" -}}
{{- if .Values.webhook.serviceAccount.create }}
{{- default (printf "%s-webhook" (include "gpu-dra-driver.fullname" .)) .Values.webhook.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.webhook.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "gpu-dra-driver.webhookServiceName" -}}
{{- printf "%s-webhook" (include "gpu-dra-driver.fullname" .) }}
{{- end }}

{{- define "gpu-dra-driver.webhookSecretName" -}}
{{- printf "%s-webhook-tls" (include "gpu-dra-driver.fullname" .) }}
{{- end }}

{{/* The plugin's data directory: sockets, checkpoint, locks. */}}
{{- define "gpu-dra-driver.pluginDataDir" -}}
{{- printf "%s/%s" (trimSuffix "/" .Values.kubeletPlugin.kubeletPluginsDirectoryPath) (include "gpu-dra-driver.driverName" .) }}
{{- end }}

{{/*
Security context of the plugin container. The plugin creates its sockets in
root-owned host directories, so it runs as root. Both backends get a read-only root
filesystem: the plugin writes only to its host paths (data dir, registrar dir, CDI
root) and /tmp (an emptyDir). Only the nvml backend is privileged: NVML opens the
host's GPU device nodes (/dev/nvidiactl, /dev/nvidia<N>, /dev/nvidia-caps/* for MIG),
and a pod can get host device nodes only by being privileged (allowPrivilegeEscalation
cannot be false then). An explicit value wins.
*/}}
{{- define "gpu-dra-driver.pluginSecurityContext" -}}
{{- if .Values.kubeletPlugin.containers.plugin.securityContext }}
{{- toYaml .Values.kubeletPlugin.containers.plugin.securityContext }}
{{- else if eq .Values.nvml.backend "nvml" }}
privileged: true
runAsUser: 0
runAsGroup: 0
readOnlyRootFilesystem: true
{{- else }}
privileged: false
runAsUser: 0
runAsGroup: 0
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: ["ALL"]
seccompProfile:
  type: RuntimeDefault
{{- end }}
{{- end }}

{{/*
Affinity of the plugin pods: kubeletPlugin.affinity with the gpuNodeLabel expression
added to every required nodeSelectorTerm (terms are ORed, so each must carry it), or
as the only term. Empty output: no affinity.
*/}}
{{- define "gpu-dra-driver.pluginAffinity" -}}
{{- $kp := .Values.kubeletPlugin }}
{{- $affinity := deepCopy (default (dict) $kp.affinity) }}
{{- if $kp.gpuNodeLabel.key }}
{{- $gpu := dict "key" $kp.gpuNodeLabel.key "operator" "In" "values" $kp.gpuNodeLabel.values }}
{{- $nodeAffinity := default (dict) (get $affinity "nodeAffinity") }}
{{- $required := default (dict) (get $nodeAffinity "requiredDuringSchedulingIgnoredDuringExecution") }}
{{- $terms := list }}
{{- range (default (list (dict)) (get $required "nodeSelectorTerms")) }}
{{- $term := deepCopy . }}
{{- $_ := set $term "matchExpressions" (append (default (list) (get $term "matchExpressions")) $gpu) }}
{{- $terms = append $terms $term }}
{{- end }}
{{- $_ := set $required "nodeSelectorTerms" $terms }}
{{- $_ := set $nodeAffinity "requiredDuringSchedulingIgnoredDuringExecution" $required }}
{{- $_ := set $affinity "nodeAffinity" $nodeAffinity }}
{{- end }}
{{- if $affinity }}
{{- toYaml $affinity }}
{{- end }}
{{- end }}

{{- /*
Values renamed to the names of NVIDIA's GPU charts and the reference driver's chart;
the old names (no defaults in values.yaml, so set only by a user) are still read for
one release. The old name wins over the new name's default; both set to different
values is an error. Arguments: (list . newName oldParent oldName newDefault).
*/}}
{{- define "gpu-dra-driver.renamedValue" -}}
{{- $root := index . 0 }}
{{- $new := index . 1 }}
{{- $oldParent := index . 2 }}
{{- $oldName := index . 3 }}
{{- $default := index . 4 }}
{{- $value := index $root.Values $new }}
{{- $old := index (index $root.Values $oldParent | default dict) $oldName }}
{{- if not (kindIs "invalid" $old) }}
{{- if and (ne (toString $value) (toString $default)) (ne (toString $value) (toString $old)) }}
{{- fail (printf "%s.%s (deprecated) and %s are both set, to different values: set only %s" $oldParent $oldName $new $new) }}
{{- end }}
{{- $value = $old }}
{{- end }}
{{- toString $value }}
{{- end }}

{{- define "gpu-dra-driver.nvidiaDriverRoot" -}}
{{- include "gpu-dra-driver.renamedValue" (list . "nvidiaDriverRoot" "nvml" "driverRoot" "/") }}
{{- end }}

{{- /*
The driver root's host path, cleaned ("/run/nvidia/driver/" -> "/run/nvidia/driver"): the driver-root
volume and NVIDIA_DRIVER_ROOT_HOST, the prefix of the host paths in CDI specs.
*/}}
{{- define "gpu-dra-driver.driverRootHost" -}}
{{- clean (include "gpu-dra-driver.nvidiaDriverRoot" .) }}
{{- end }}

{{- /*
The driver root's parent directory on the host ("/" for "/" and for "/<name>"), and
where the driver root appears under its mount at /driver-root-parent. A driver mounted
onto the driver root after the pod started (the GPU operator's driver container at
/run/nvidia/driver) shows up only under the parent's mount, not under a mount of the
driver root made before.
*/}}
{{- define "gpu-dra-driver.driverRootParentHost" -}}
{{- dir (include "gpu-dra-driver.driverRootHost" .) }}
{{- end }}

{{- define "gpu-dra-driver.driverRootInParent" -}}
{{- $root := include "gpu-dra-driver.driverRootHost" . }}
{{- if eq $root "/" }}/driver-root-parent{{ else }}{{ printf "/driver-root-parent/%s" (base $root) }}{{ end }}
{{- end }}

{{- define "gpu-dra-driver.logVerbosity" -}}
{{- include "gpu-dra-driver.renamedValue" (list . "logVerbosity" "logging" "verbosity" 2) }}
{{- end }}

{{- /*
An Xid list value as the plugin's --fatal-xids / --additional-xids-to-ignore take it
(comma-separated, or "all"): the value may be that string, one number (`--set x=79`
gives an integer, a values file a float) or a list of numbers.
*/}}
{{- define "gpu-dra-driver.xidList" -}}
{{- if kindIs "slice" . }}
{{- $xids := list }}
{{- range . }}{{ $xids = append $xids (int64 .) }}{{ end }}
{{- join "," $xids }}
{{- else if kindIs "string" . }}
{{- . }}
{{- else if not (kindIs "invalid" .) }}
{{- int64 . }}
{{- end }}
{{- end }}
