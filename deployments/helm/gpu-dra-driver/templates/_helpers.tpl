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
{{/*
"true" where the plugin mounts a tmpfs on each MPS daemon's shm directory that must
reach the node: MPS on, a size, and a privileged plugin container (Bidirectional
mount propagation is for privileged containers only; an unprivileged plugin may not
mount and keeps plain directories). Empty otherwise.
*/}}
{{- define "gpu-dra-driver.mpsShmPropagation" -}}
{{- $kp := .Values.kubeletPlugin }}
{{- $privileged := eq .Values.nvml.backend "nvml" }}
{{- with $kp.containers.plugin.securityContext }}
{{- $privileged = .privileged | default false }}
{{- end }}
{{- if and $kp.mps.enabled $privileged (ne (toString $kp.mps.shmSize) "0") }}true{{- end }}
{{- end }}

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
Node feature discovery's labels for a node with an NVIDIA (PCI vendor 10de) device:
vendor only (the GPU operator's NFD configuration), and class + vendor (NFD's default
labelling) for 3D (0302) and VGA (0300) controllers. NVIDIA's chart selects the same.
*/}}
{{- define "gpu-dra-driver.nfdNvidiaPciLabels" -}}
- feature.node.kubernetes.io/pci-10de.present
- feature.node.kubernetes.io/pci-0302_10de.present
- feature.node.kubernetes.io/pci-0300_10de.present
{{- end }}

{{/*
The node-selector requirements that each mark a GPU node (any one suffices):
gpuNodeLabel, then, with gpuNodeLabel.nfdPciLabels, NFD's NVIDIA PCI labels. A key
under node-restriction.kubernetes.io/ (one that the NodeRestriction admission plugin
keeps kubelets from setting on their own Node) is pointless next to labels a node can
set on itself, so that combination is refused.
*/}}
{{- define "gpu-dra-driver.gpuNodeRequirements" -}}
{{- $label := .Values.kubeletPlugin.gpuNodeLabel }}
{{- if $label.key }}
{{- if and (hasPrefix "node-restriction.kubernetes.io/" $label.key) $label.nfdPciLabels }}
{{- fail (printf "kubeletPlugin.gpuNodeLabel.key %s is a label only administrators can set, but kubeletPlugin.gpuNodeLabel.nfdPciLabels=true also selects nodes by node feature discovery's labels, which a node can set on itself: set kubeletPlugin.gpuNodeLabel.nfdPciLabels=false" $label.key) }}
{{- end }}
{{- $requirements := list (dict "key" $label.key "operator" "In" "values" $label.values) }}
{{- if $label.nfdPciLabels }}
{{- range include "gpu-dra-driver.nfdNvidiaPciLabels" . | fromYamlArray }}
{{- $requirements = append $requirements (dict "key" . "operator" "In" "values" (list "true")) }}
{{- end }}
{{- end }}
{{- toYaml $requirements }}
{{- end }}
{{- end }}

{{/*
Affinity of the plugin pods: kubeletPlugin.affinity, its required node selector ANDed
with "any GPU node requirement". Terms are ORed, so each user term (or an empty one)
is combined with each GPU node requirement: (A or B) and (g1 or g2) = A g1, A g2, B g1,
B g2. Empty output: no affinity.
*/}}
{{- define "gpu-dra-driver.pluginAffinity" -}}
{{- $kp := .Values.kubeletPlugin }}
{{- $affinity := deepCopy (default (dict) $kp.affinity) }}
{{- $gpuRequirements := include "gpu-dra-driver.gpuNodeRequirements" . | fromYamlArray }}
{{- if $gpuRequirements }}
{{- $nodeAffinity := default (dict) (get $affinity "nodeAffinity") }}
{{- $required := default (dict) (get $nodeAffinity "requiredDuringSchedulingIgnoredDuringExecution") }}
{{- $terms := list }}
{{- range $userTerm := default (list (dict)) (get $required "nodeSelectorTerms") }}
{{- range $gpuRequirements }}
{{- $term := deepCopy $userTerm }}
{{- $_ := set $term "matchExpressions" (append (default (list) (get $term "matchExpressions")) .) }}
{{- $terms = append $terms $term }}
{{- end }}
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

{{- /*
The driver root's volumes as a YAML list of {name, hostPath, mountPath}: the whole
driver root at /driver-root for a dedicated path; for "/" (a driver installed on the
host) only nvidiaDriverHostDirectories, each at /driver-root/<dir>, never the host's
whole root.
*/}}
{{- define "gpu-dra-driver.driverRootVolumes" -}}
{{- $root := include "gpu-dra-driver.driverRootHost" . }}
{{- if eq $root "/" }}
{{- range $i, $dir := .Values.nvidiaDriverHostDirectories }}
- name: driver-root-{{ $i }}
  hostPath: {{ clean $dir | quote }}
  mountPath: {{ printf "/driver-root%s" (clean $dir) | quote }}
{{- end }}
{{- else }}
- name: driver-root
  hostPath: {{ $root | quote }}
  mountPath: /driver-root
{{- end }}
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

{{/*
The mock uses a driver root only when one is named: a fake driver installation that
makes its CDI specs complete, as on a real node. Output "true" or nothing.
*/}}
{{- define "gpu-dra-driver.pluginUsesDriverRoot" -}}
{{- if or (eq .Values.nvml.backend "nvml") (ne (include "gpu-dra-driver.driverRootHost" .) "/") }}true{{ end }}
{{- end }}

{{/*
The plugin container's environment set by the chart: the plugin's flags (driver/plugin/
flags.py) from the values; POD_UID gives every pod's sockets its own name (rolling
updates); GPU_DRA_STATE_DIR lets `kubectl exec ... gpu-dra` find the data directory;
NVIDIA_DRIVER_ROOT_HOST is the driver root's host path, by which the CDI specs name
the driver's files. A YAML list; kubeletPlugin.containers.plugin.extraEnv follows it.
*/}}
{{- define "gpu-dra-driver.pluginEnv" -}}
{{- $kp := .Values.kubeletPlugin }}
- name: NODE_NAME
  valueFrom:
    fieldRef:
      fieldPath: spec.nodeName
- name: POD_UID
  valueFrom:
    fieldRef:
      fieldPath: metadata.uid
- name: DRIVER_NAME
  value: {{ include "gpu-dra-driver.driverName" . | quote }}
- name: CDI_ROOT
  value: {{ $kp.cdiRoot | quote }}
- name: KUBELET_REGISTRAR_DIRECTORY_PATH
  value: {{ $kp.kubeletRegistrarDirectoryPath | quote }}
- name: KUBELET_PLUGINS_DIRECTORY_PATH
  value: {{ $kp.kubeletPluginsDirectoryPath | quote }}
- name: NVML_BACKEND
  value: {{ .Values.nvml.backend | quote }}
- name: GPU_DRA_STATE_DIR
  value: {{ printf "%s/%s" $kp.kubeletPluginsDirectoryPath (include "gpu-dra-driver.driverName" .) | quote }}
{{- if .Values.nvml.mockFleet }}
- name: MOCK_FLEET
  value: /etc/gpu-dra-driver/mock-fleet.yaml
{{- end }}
{{- if include "gpu-dra-driver.pluginUsesDriverRoot" . }}
- name: NVIDIA_DRIVER_ROOT
  value: /driver-root
- name: NVIDIA_DRIVER_ROOT_HOST
  value: {{ include "gpu-dra-driver.driverRootHost" . | quote }}
{{- with .Values.nvidiaCDIHookPath }}
- name: NVIDIA_CDI_HOOK_PATH
  value: {{ . | quote }}
{{- end }}
{{- end }}
- name: GPU_PARTITIONS
  value: {{ $kp.gpuPartitions | quote }}
- name: MPS_DAEMONS
  value: {{ ternary "kubernetes" "off" $kp.mps.enabled | quote }}
- name: MPS_ESCAPE_TAINT
  value: {{ $kp.mps.escapeTaint | default false | quote }}
- name: MPS_STRICT_PARTITIONS
  value: {{ $kp.mps.strictPartitions | default false | quote }}
- name: GPU_MEMORY_LIMITS
  value: {{ $kp.gpuMemoryLimits | default false | quote }}
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
- name: MPS_DAEMON_IMAGE
  value: {{ include "gpu-dra-driver.image" . | quote }}
- name: MPS_SHM_SIZE
  value: {{ $kp.mps.shmSize | toString | quote }}
- name: MIG_STRATEGY
  value: {{ $kp.migStrategy | quote }}
- name: MIG_PROFILES
  value: {{ $kp.migProfiles | default "" | quote }}
{{- if $kp.allowMultipleAllocations }}
- name: GPU_ALLOW_MULTIPLE_ALLOCATIONS
  value: "true"
{{- end }}
- name: XID_TAINT_EFFECT
  value: {{ $kp.health.xidTaintEffect | quote }}
- name: ADDITIONAL_XIDS_TO_IGNORE
  value: {{ include "gpu-dra-driver.xidList" $kp.health.additionalXidsToIgnore | quote }}
- name: FATAL_XIDS
  value: {{ include "gpu-dra-driver.xidList" $kp.health.fatalXids | quote }}
- name: RECOVERY_ACTION_POLL_INTERVAL
  value: {{ $kp.health.recoveryActionPollInterval | quote }}
- name: PERMANENT_ERRORS
  value: {{ $kp.permanentErrors | quote }}
- name: DEVICE_STATUS
  value: {{ .Values.deviceStatus | quote }}
- name: HTTP_PORT
  value: {{ $kp.httpPort | quote }}
- name: LOG_FORMAT
  value: {{ .Values.logging.format | quote }}
- name: V
  value: {{ include "gpu-dra-driver.logVerbosity" . | quote }}
{{- end }}

{{/*
Where each variable of gpu-dra-driver.pluginEnv comes from, for the error that refuses
an extraEnv entry of the same name.
*/}}
{{- define "gpu-dra-driver.pluginEnvSources" -}}
NODE_NAME: the pod's spec.nodeName
POD_UID: the pod's metadata.uid
DRIVER_NAME: driverName
CDI_ROOT: kubeletPlugin.cdiRoot
KUBELET_REGISTRAR_DIRECTORY_PATH: kubeletPlugin.kubeletRegistrarDirectoryPath
KUBELET_PLUGINS_DIRECTORY_PATH: kubeletPlugin.kubeletPluginsDirectoryPath
NVML_BACKEND: nvml.backend
GPU_DRA_STATE_DIR: kubeletPlugin.kubeletPluginsDirectoryPath and driverName
MOCK_FLEET: nvml.mockFleet
NVIDIA_DRIVER_ROOT: nvidiaDriverRoot
NVIDIA_DRIVER_ROOT_HOST: nvidiaDriverRoot
NVIDIA_CDI_HOOK_PATH: nvidiaCDIHookPath
GPU_PARTITIONS: kubeletPlugin.gpuPartitions
MPS_DAEMONS: kubeletPlugin.mps.enabled
MPS_ESCAPE_TAINT: kubeletPlugin.mps.escapeTaint
MPS_STRICT_PARTITIONS: kubeletPlugin.mps.strictPartitions
GPU_MEMORY_LIMITS: kubeletPlugin.gpuMemoryLimits
POD_NAMESPACE: the pod's metadata.namespace
MPS_DAEMON_IMAGE: image
MPS_SHM_SIZE: kubeletPlugin.mps.shmSize
MIG_STRATEGY: kubeletPlugin.migStrategy
MIG_PROFILES: kubeletPlugin.migProfiles
GPU_ALLOW_MULTIPLE_ALLOCATIONS: kubeletPlugin.allowMultipleAllocations
XID_TAINT_EFFECT: kubeletPlugin.health.xidTaintEffect
ADDITIONAL_XIDS_TO_IGNORE: kubeletPlugin.health.additionalXidsToIgnore
FATAL_XIDS: kubeletPlugin.health.fatalXids
RECOVERY_ACTION_POLL_INTERVAL: kubeletPlugin.health.recoveryActionPollInterval
PERMANENT_ERRORS: kubeletPlugin.permanentErrors
DEVICE_STATUS: deviceStatus
HTTP_PORT: kubeletPlugin.httpPort
LOG_FORMAT: logging.format
V: logVerbosity
{{- end }}

{{/*
The plugin container's env: the chart's, then kubeletPlugin.containers.plugin.extraEnv,
whose names must differ from the chart's (a later duplicate would silently win over
the value the schema checked).
*/}}
{{- define "gpu-dra-driver.pluginEnvWithExtra" -}}
{{- $env := include "gpu-dra-driver.pluginEnv" . | fromYamlArray }}
{{- $sources := include "gpu-dra-driver.pluginEnvSources" . | fromYaml }}
{{- $chartNames := dict }}
{{- range $env }}{{ $_ := set $chartNames .name true }}{{ end }}
{{- range $i, $extra := .Values.kubeletPlugin.containers.plugin.extraEnv }}
{{- if hasKey $chartNames $extra.name }}
{{- fail (printf "kubeletPlugin.containers.plugin.extraEnv[%d]: %s is set by the chart from %s: set that value instead" $i $extra.name (get $sources $extra.name | default "its own values")) }}
{{- end }}
{{- end }}
{{- toYaml (concat $env .Values.kubeletPlugin.containers.plugin.extraEnv) }}
{{- end }}
