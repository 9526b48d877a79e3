{{/* Names and labels shared by every template. */}}

{{- define "pdserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "pdserve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else if contains (include "pdserve.name" .) .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name (include "pdserve.name" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{- define "pdserve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
app.kubernetes.io/name: {{ include "pdserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: pdserve
{{- end }}

{{- define "pdserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pdserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "pdserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "pdserve.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "pdserve.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{- define "pdserve.engineImage" -}}
{{ .Values.engineImage.repository }}:{{ .Values.engineImage.tag | default .Chart.AppVersion }}
{{- end }}

{{- define "pdserve.vllmEngineImage" -}}
{{ .Values.vllmEngineImage.repository }}:{{ .Values.vllmEngineImage.tag | default .Chart.AppVersion }}
{{- end }}

{{/* Client URLs of etcd: the bundled StatefulSet's Service, or etcd.endpoints. */}}
{{- define "pdserve.etcdEndpoints" -}}
{{- if .Values.etcd.enabled }}
{{- printf "http://%s-etcd.%s.svc:2379" (include "pdserve.fullname" .) .Release.Namespace }}
{{- else }}
{{- join "," .Values.etcd.endpoints }}
{{- end }}
{{- end }}
