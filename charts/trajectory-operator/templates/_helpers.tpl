{{/* Name of the chart, overridable by nameOverride-free convention: the chart name. */}}
{{- define "trajectory-operator.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Full name: the release name, prefixed with the chart name unless it already contains it. */}}
{{- define "trajectory-operator.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "trajectory-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "trajectory-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "trajectory-operator.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "trajectory-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: trajectory-operator
{{- end -}}

{{- define "trajectory-operator.serviceAccountName" -}}
{{- default (include "trajectory-operator.fullname" .) .Values.serviceAccount.name -}}
{{- end -}}

{{- define "trajectory-operator.workerServiceAccountName" -}}
{{- default (printf "%s-worker" (include "trajectory-operator.fullname" . | trunc 56 | trimSuffix "-")) .Values.worker.serviceAccount.name -}}
{{- end -}}

{{- define "trajectory-operator.leaseName" -}}
{{- default (include "trajectory-operator.fullname" .) .Values.leaderElection.leaseName -}}
{{- end -}}

{{/* An image reference from {repository, tag, digest}; the tag defaults to the chart's appVersion. */}}
{{- define "trajectory-operator.image" -}}
{{- $image := index . 0 -}}
{{- $root := index . 1 -}}
{{- $ref := printf "%s:%s" $image.repository (default $root.Chart.AppVersion $image.tag) -}}
{{- if $image.digest -}}
{{- $ref = printf "%s@%s" $ref $image.digest -}}
{{- end -}}
{{- $ref -}}
{{- end -}}

{{/* Settings that JSON schema cannot relate to each other. */}}
{{- define "trajectory-operator.validate" -}}
{{- if and (gt (int .Values.replicaCount) 1) (not .Values.leaderElection.enabled) -}}
{{- fail "replicaCount: 2 replicas need leaderElection.enabled=true (two reconcilers without a Lease would race)" -}}
{{- end -}}
{{- if ge (int .Values.leaderElection.leaseGraceSeconds) (int .Values.leaderElection.leaseDurationSeconds) -}}
{{- fail (printf "leaderElection.leaseGraceSeconds (%v) must be less than leaderElection.leaseDurationSeconds (%v)" .Values.leaderElection.leaseGraceSeconds .Values.leaderElection.leaseDurationSeconds) -}}
{{- end -}}
{{- if and (not .Values.serviceAccount.create) (not .Values.serviceAccount.name) -}}
{{- fail "serviceAccount.name: name the existing ServiceAccount to use when serviceAccount.create=false" -}}
{{- end -}}
{{- end -}}

{{/* The network of the IPv4 address of a CIDR (a.b.c.d/n) at a prefix length, as a number:
     (list "10.1.2.3/32" 8) gives 167772160 (10.0.0.0). Templates have no bit operations, so
     the host bits are cleared by an integer division and a multiplication. */}}
{{- define "trajectory-operator.ipv4Network" -}}
{{- $octets := splitList "." (first (splitList "/" (index . 0))) -}}
{{- $address := 0 -}}
{{- range $octets -}}
{{- $address = add (mul $address 256) (int .) -}}
{{- end -}}
{{- $block := 1 -}}
{{- range until (sub 32 (int (index . 1)) | int) -}}
{{- $block = mul $block 2 -}}
{{- end -}}
{{- mul (div $address $block) $block -}}
{{- end -}}
