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

{{/* Cluster-scoped objects (ClusterRoles, ClusterRoleBindings) and the operator's and gateway's Roles and
RoleBindings in other namespaces: the name plus the release's namespace, so that releases of the same name in two
namespaces do not take each other's objects. */}}
{{- define "kvmesh.clusterScopedName" -}}
{{- printf "%s-%s" .name .context.Release.Namespace -}}
{{- end -}}

{{/* The operator's, the gateway's and the test pod's image, and the default of every pool's engines and routers
(KVMESH_IMAGE): repository@digest when image.digest is set (the tag is then ignored), else repository:tag. */}}
{{- define "kvmesh.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}
{{- end -}}

{{/* Values the schema cannot check against each other: refused with a message before anything is applied. */}}
{{- define "kvmesh.validate" -}}
{{- if not (regexMatch "^[a-z]([-a-z0-9]*[a-z0-9])?$" .Release.Name) -}}
{{- fail (printf "release name %q: the chart's Services are named after the release, and a Service name must start with a letter and hold only lowercase letters, digits and '-' (no dots); choose another release name" .Release.Name) -}}
{{- end -}}
{{- if eq (int .Values.operator.metricsPort) (int .Values.operator.healthPort) -}}
{{- fail (printf "operator.metricsPort and operator.healthPort are both %v: the operator cannot serve /metrics and /healthz on one port; give them different ports" .Values.operator.metricsPort) -}}
{{- end -}}
{{- with .Values.operator.watchNamespaces -}}
{{- if and $.Values.pool.enabled (not (has $.Release.Namespace .)) -}}
{{- fail (printf "pool.enabled creates the pool %s in the release's namespace %s, which operator.watchNamespaces (%s) leaves out: no operator would reconcile it. Add %s to operator.watchNamespaces, or create the pool in a watched namespace yourself (pool.enabled=false)" $.Values.pool.name $.Release.Namespace (join ", " .) $.Release.Namespace) -}}
{{- end -}}
{{- end -}}
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
