{{/* Full name of a component: <release>-<component>. */}}
{{- define "rngd-pd.name" -}}
{{- printf "%s-%s" .root.Release.Name .component | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels shared by every object. */}}
{{- define "rngd-pd.labels" -}}
app.kubernetes.io/name: rngd-pd
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
{{- end -}}

{{/* Selector labels of a component. */}}
{{- define "rngd-pd.selector" -}}
app.kubernetes.io/name: rngd-pd
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* The image reference. */}}
{{- define "rngd-pd.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* Path of the policy module the pods load. */}}
{{- define "rngd-pd.policyModule" -}}
{{- if .Values.policy.moduleBase64 -}}/etc/rngd-pd/policy-module/policy.wasm{{- else -}}{{ .Values.policy.module }}{{- end -}}
{{- end -}}

{{/* The pods' security context (values `podSecurityContext`). */}}
{{- define "rngd-pd.podSecurity" -}}
{{- with .Values.podSecurityContext }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* A container's security context (values `containerSecurityContext`). */}}
{{- define "rngd-pd.containerSecurity" -}}
{{- with .Values.containerSecurityContext }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* The admin token as an env var from its Secret (nothing when the admin API is off). */}}
{{- define "rngd-pd.adminTokenEnv" -}}
{{- if or .Values.policy.adminToken .Values.policy.adminTokenSecret }}
- name: RNGD_PD_ADMIN_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ default (printf "%s-admin" .Release.Name) .Values.policy.adminTokenSecret }}
      key: token
{{- end }}
{{- end -}}
