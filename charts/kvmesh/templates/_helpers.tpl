{{/* The release's base name, shortened to fit a DNS label. */}}
{{- define "kvmesh.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "kvmesh.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* The operator's pods: the Deployment's selector, the NetworkPolicies' peer and its ServiceMonitor's target. */}}
{{- define "kvmesh.operatorSelector" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "kvmesh.operatorName" -}}
{{- printf "%s-operator" (include "kvmesh.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvmesh.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{/* Where the operator-managed Prometheus objects go: only where the Prometheus Operator's API exists. */}}
{{- define "kvmesh.hasPrometheusOperator" -}}
{{- if .Capabilities.APIVersions.Has "monitoring.coreos.com/v1" -}}true{{- end -}}
{{- end -}}

{{/* The names of imagePullSecrets, comma-separated: the operator gives them to the pools that run its image. */}}
{{- define "kvmesh.pullSecretNames" -}}
{{- $names := list -}}
{{- range .Values.imagePullSecrets -}}
{{- $names = append $names .name -}}
{{- end -}}
{{- join "," $names -}}
{{- end -}}
