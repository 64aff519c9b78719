"""Renders the Helm chart with the Helm SDK (helm-python-sdk) and checks what a
cluster would receive: the objects, the device wiring, the InferencePool and
the discovery RBAC, the model init container, that every flag a container is
started with is one the binary accepts, and that the image deploy/Containerfile
declares provides what the chart relies on (parsed only: no container engine
runs here)."""

import base64
import json
import os
import re
import subprocess

import helm_python as helm
import pytest
import yaml

from helm_chart import CHART, NPU, ROOT, binary, container, pod_specs, render, render_error


def test_lint_is_clean():
    report = helm.lint(str(CHART), strict=True)
    assert report["errors"] == []
    assert all(m["severity"] < 3 for m in report["messages"]), report["messages"]


def test_default_render_has_every_component():
    objs = render()
    for key in [
        ("Deployment", "demo-prefill"),
        ("Deployment", "demo-decode"),
        ("Deployment", "demo-relay"),
        ("Deployment", "demo-epp"),
        ("Deployment", "demo-gateway"),
        ("Service", "demo-epp"),
        ("Service", "demo-relay"),
        ("ConfigMap", "demo-policy"),
        ("InferencePool", "demo"),
    ]:
        assert key in objs, f"missing {key}"
    pool = objs[("InferencePool", "demo")]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert pool["spec"]["endpointPickerRef"]["name"] == "demo-epp"
    assert pool["spec"]["endpointPickerRef"]["port"]["number"] == 9002
    assert pool["spec"]["selector"]["matchLabels"] == {"rngd-pd.io/pool": "demo"}
    for role in ("prefill", "decode"):
        labels = objs[("Deployment", f"demo-{role}")]["spec"]["template"]["metadata"]["labels"]
        assert labels["rngd-pd.io/pool"] == "demo"


def test_npu_backends_request_their_device_and_read_the_checkpoint():
    objs = render(
        {
            "prefill": {"backend": "rngd", "deviceResource": "furiosa.ai/rngd"},
            "decode": {"backend": "atom", "deviceResource": "rebellions.ai/ATOM"},
        }
    )
    pre = container(objs, "demo-prefill")
    dec = container(objs, "demo-decode")
    assert pre["resources"]["limits"]["furiosa.ai/rngd"] == 1
    assert dec["resources"]["limits"]["rebellions.ai/ATOM"] == 1
    assert "--backend=rngd" in pre["args"] and "--chip=-1" in pre["args"]
    env = {e["name"]: e for e in pre["env"]}
    assert env["POD_UID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.uid"
    mounts = {m["mountPath"] for m in pre["volumeMounts"]}
    assert "/var/lib/kubelet/device-plugins" in mounts


def test_custom_policy_module_is_shipped_and_mounted():
    wasm = base64.b64encode(b"\0asm\x01\0\0\0").decode()
    objs = render({"policy": {"moduleBase64": wasm}})
    cm = objs[("ConfigMap", "demo-policy")]
    assert cm["binaryData"]["policy.wasm"] == wasm
    # The picker and the gateway both run it, from the same mount (the
    # gateway used to be given the path without the volume: a crashloop).
    for name in ("demo-epp", "demo-gateway"):
        c = container(objs, name)
        assert "--policy=/etc/rngd-pd/policy-module/policy.wasm" in c["args"], name
        mount = [m for m in c["volumeMounts"] if m["mountPath"] == "/etc/rngd-pd/policy-module"]
        assert len(mount) == 1, (name, c["volumeMounts"])
        vol = [v for v in pod_specs(objs)[name]["volumes"] if v["name"] == mount[0]["name"]]
        assert vol[0]["configMap"]["items"] == [{"key": "policy.wasm", "path": "policy.wasm"}], (name, vol)




@pytest.mark.parametrize("deployment", ["demo-prefill", "demo-decode", "demo-relay", "demo-epp", "demo-gateway"])
def test_container_flags_exist_in_the_binary(deployment):
    args = container(render(), deployment)["args"]
    sub = args[0]
    help_text = subprocess.run([binary(), sub, "--help"], capture_output=True, text=True, check=True).stdout
    for arg in args[1:]:
        flag = re.match(r"(--[a-z0-9-]+)", arg)
        assert flag, f"unexpected argument {arg!r}"
        assert flag.group(1) in help_text, f"`rngd-pd {sub}` has no flag {flag.group(1)}"


def policy_module():
    target = os.environ.get("CARGO_TARGET_DIR", str(ROOT / "target"))
    path = os.path.join(target, "wasm32-unknown-unknown", "release", "pd_default.wasm")
    assert os.path.exists(path), f"pd_default.wasm not found at {path}: run policies/build.sh"
    return path


@pytest.mark.parametrize(
    "values",
    [
        {},
        {
            "prefill": {"backend": "rngd", "deviceResource": "furiosa.ai/rngd"},
            "decode": {"backend": "atom", "deviceResource": "rebellions.ai/ATOM"},
        },
    ],
    ids=["default", "npu"],
)
def test_shipped_policy_configuration_is_accepted_by_the_binary(values, tmp_path):
    """The policy configuration the chart renders is loaded by the real binary
    (`rngd-pd policy check`, which refuses unknown fields), so the gateway and
    the picker the chart starts do not fail at start on their configuration."""
    objs = render(values)
    cfg = objs[("ConfigMap", "demo-policy")]["data"]["policy-config.json"]
    path = tmp_path / "policy-config.json"
    path.write_text(cfg)
    r = subprocess.run(
        [binary(), "policy", "check", policy_module(), "--config", str(path)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, f"the chart's policy configuration is refused:\n{r.stdout}\n{r.stderr}"
    # The check really reads the configuration: an unknown field is refused.
    path.write_text(cfg[:-1] + ', "max_queue": 64}')
    r = subprocess.run(
        [binary(), "policy", "check", policy_module(), "--config", str(path)],
        capture_output=True,
        text=True,
    )
    assert r.returncode != 0, "an unknown policy field was accepted"


def local_command(objs, deployment, tmp_path):
    """The container's command line and environment as this machine can run
    them: the chart's ConfigMap and Secret files written under `tmp_path` at
    their mount paths, the model volume mapped to the model cache (`rngd-pd
    model fetch`), the image's policy module path to the wasm build, in the
    args and the env values. Nothing else changes."""
    spec = objs[("Deployment", deployment)]["spec"]["template"]["spec"]
    c = spec["containers"][0]
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    cache = os.environ.get("RNGD_PD_CACHE", os.path.expanduser("~/.cache/rngd-pd"))
    mapping = {"/opt/rngd-pd/policies/pd_default.wasm": policy_module()}
    for m in c.get("volumeMounts", []):
        v = volumes[m["name"]]
        if "configMap" in v:
            cm = objs[("ConfigMap", v["configMap"]["name"])]
            local = tmp_path / deployment / m["name"]
            local.mkdir(parents=True)
            items = v["configMap"].get("items") or [{"key": k, "path": k} for k in cm.get("data", {})]
            for it in items:
                data = cm.get("data", {}).get(it["key"])
                if data is None:
                    data = base64.b64decode(cm["binaryData"][it["key"]])
                    (local / it["path"]).write_bytes(data)
                else:
                    (local / it["path"]).write_text(data)
            mapping[m["mountPath"]] = str(local)
        elif "secret" in v:
            secret = objs[("Secret", v["secret"]["secretName"])]
            local = tmp_path / deployment / m["name"]
            local.mkdir(parents=True)
            for it in v["secret"].get("items") or [{"key": k, "path": k} for k in secret["data"]]:
                (local / it["path"]).write_bytes(base64.b64decode(secret["data"][it["key"]]))
            mapping[m["mountPath"]] = str(local)
        elif m["name"] == "model":
            # The volume is the model cache (`model fetch --cache <mount>`).
            mapping[m["mountPath"]] = cache
    args = []
    for a in c["args"]:
        for image_path, local in sorted(mapping.items(), key=lambda kv: -len(kv[0])):
            a = a.replace("=" + image_path, "=" + local)
        args.append(a)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRM_", "RNGD_PD_", "PD_"))}
    for e in c.get("env", []):
        if "value" in e:
            value = e["value"]
            for image_path, local in sorted(mapping.items(), key=lambda kv: -len(kv[0])):
                if value == image_path or value.startswith(image_path + "/"):
                    value = local + value[len(image_path):]
                    break
            env[e["name"]] = value
    env["RUST_BACKTRACE"] = "0"
    return args, env


@pytest.mark.parametrize("deployment", ["demo-prefill", "demo-decode", "demo-relay", "demo-epp", "demo-gateway"])
def test_every_container_command_passes_check(deployment, tmp_path):
    """Each container's command line, as the default chart renders it, is
    loaded by the real binary with `--check` (flags, files, policy module and
    configuration, model): exit 0 and `ok`."""
    args, env = local_command(render(), deployment, tmp_path)
    r = subprocess.run([binary(), *args, "--check"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), f"{args}\n{r.stdout}\n{r.stderr}"


def test_npu_workers_refuse_clearly_on_this_build(tmp_path):
    """With NPU values the worker commands are valid but name a backend this
    build does not have: `--check` refuses, naming the vendor runtime."""
    objs = render(
        {
            "prefill": {"backend": "rngd", "deviceResource": "furiosa.ai/rngd"},
            "decode": {"backend": "atom", "deviceResource": "rebellions.ai/ATOM"},
        }
    )
    for deployment, vendor in [("demo-prefill", "FuriosaAI"), ("demo-decode", "Rebellions")]:
        args, env = local_command(objs, deployment, tmp_path)
        r = subprocess.run([binary(), *args, "--check"], capture_output=True, text=True, env=env, timeout=120)
        assert r.returncode != 0, f"{deployment}: --check accepted an NPU backend this build lacks"
        assert vendor in r.stderr, r.stderr
    for deployment in ["demo-relay", "demo-epp", "demo-gateway"]:
        args, env = local_command(objs, deployment, tmp_path)
        r = subprocess.run([binary(), *args, "--check"], capture_output=True, text=True, env=env, timeout=120)
        assert r.returncode == 0, f"{args}\n{r.stderr}"


def test_relay_memory_cap_and_picker_tls_come_from_values():
    objs = render({"relay": {"maxBytes": 1 << 28}, "epp": {"secureServing": False}})
    assert f"--max-bytes={1 << 28}" in container(objs, "demo-relay")["args"]
    assert "--secure-serving=false" in container(objs, "demo-epp")["args"]
    assert "--secure-serving=true" in container(render(), "demo-epp")["args"]




def test_pods_run_non_root_with_read_only_root_filesystems():
    for name, spec in pod_specs(render()).items():
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        for c in spec["containers"]:
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False, (name, sc)
            assert sc["capabilities"]["drop"] == ["ALL"], (name, sc)
    # The one exception, rendered only with the shm transport on, and what
    # it does: the release's own shm root, made writable once.
    for role in ("prefill", "decode"):
        assert [i["name"] for i in pod_specs(render())[f"demo-{role}"]["initContainers"]] == ["model"]
        init = pod_specs(render({"kvTransport": {"sameNodeShm": True}}))[f"demo-{role}"]["initContainers"]
        assert [i["name"] for i in init] == ["shm-root", "model"]
        assert init[0]["args"] == ["kv", "shm-root", "/dev/shm/rngd_kv_ai_demo"]
    # Every other init container (the model fetch) runs like the main ones.
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    for name, spec in pod_specs(render()).items():
        for c in spec.get("initContainers", []):
            if c["name"] != "shm-root":
                assert c["securityContext"] == values["containerSecurityContext"], (name, c["name"])
                assert "runAsUser" not in c["securityContext"], (name, c["name"])


def test_shm_root_subcommand_makes_the_node_directory_writable_and_refuses_symlinks(tmp_path):
    d = tmp_path / "shm"
    r = subprocess.run([binary(), "kv", "shm-root", str(d)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert d.is_dir() and (d.stat().st_mode & 0o7777) == 0o1777
    link = tmp_path / "link"
    link.symlink_to(tmp_path)
    r = subprocess.run([binary(), "kv", "shm-root", str(link)], capture_output=True, text=True, env={**os.environ, "RUST_BACKTRACE": "0"})
    assert r.returncode != 0 and "symlink" in r.stderr, r.stderr


def test_admin_token_lives_in_a_secret():
    objs = render({"policy": {"adminToken": "s3cret"}})
    secret = objs[("Secret", "demo-admin")]
    assert secret["stringData"]["token"] == "s3cret"
    for name in ("demo-gateway", "demo-epp"):
        c = container(objs, name)
        env = {e["name"]: e for e in c["env"]}
        assert env["RNGD_PD_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "demo-admin", "key": "token"}
        assert "s3cret" not in yaml.safe_dump(objs[("Deployment", name)])
    objs = render({"policy": {"adminTokenSecret": "mine"}})
    assert ("Secret", "demo-admin") not in objs
    env = {e["name"]: e for e in container(objs, "demo-gateway")["env"]}
    assert env["RNGD_PD_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "mine"
    assert "RNGD_PD_ADMIN_TOKEN" not in {e["name"] for e in container(render(), "demo-gateway").get("env", [])}


def test_network_policies_admit_only_who_must_talk():
    objs = render()
    workers = objs[("NetworkPolicy", "demo-workers")]["spec"]
    assert workers["podSelector"]["matchLabels"] == {"rngd-pd.io/pool": "demo"}
    peers = workers["ingress"][0]["from"]
    assert {"podSelector": {"matchLabels": {"app.kubernetes.io/instance": "demo"}}} in peers
    assert [p["port"] for p in workers["ingress"][0]["ports"]] == [8000]
    # The metrics peers, on the API port (the workers' /metrics).
    assert workers["ingress"][1] == {"from": [{"podSelector": {}}], "ports": [{"port": 8000}]}
    # The KV-event ports: the release's own pods only (not the gateway peers).
    assert workers["ingress"][2] == {
        "from": [{"podSelector": {"matchLabels": {"app.kubernetes.io/instance": "demo"}}}],
        "ports": [{"port": 5557}, {"port": 5558}],
    }
    workers = render({"kvEvents": {"enabled": False}})[("NetworkPolicy", "demo-workers")]["spec"]
    assert len(workers["ingress"]) == 2
    relay = objs[("NetworkPolicy", "demo-relay")]["spec"]
    assert relay["ingress"] == [{"from": [{"podSelector": {"matchLabels": {"rngd-pd.io/pool": "demo"}}}], "ports": [{"port": 7070}]},
                                {"from": [{"podSelector": {}}], "ports": [{"port": 9091}]}]
    epp = objs[("NetworkPolicy", "demo-epp")]["spec"]
    assert [p["port"] for p in epp["ingress"][0]["ports"]] == [9002, 9003]
    assert [p["port"] for p in epp["ingress"][1]["ports"]] == [9090]
    assert not any(k == "NetworkPolicy" for k, _ in render({"networkPolicy": {"enabled": False}}))


def test_kpi_listener_is_reachable_in_the_pod():
    args = container(render({"gateway": {"airmMetricsPort": 9100}}), "demo-gateway")["args"]
    assert "--metrics-host=0.0.0.0" in args


def test_gateway_tls_from_a_secret():
    """`gateway.tlsSecretName`: the Secret mounted read-only (0400), the
    gateway given `--ssl-certfile`/`--ssl-keyfile` at its files (flags the
    binary has), HTTPS probes and an `https` appProtocol; without it, none."""
    objs = render({"gateway": {"tlsSecretName": "demo-tls"}})
    c = container(objs, "demo-gateway")
    assert "--ssl-certfile=/etc/rngd-pd/tls/tls.crt" in c["args"]
    assert "--ssl-keyfile=/etc/rngd-pd/tls/tls.key" in c["args"]
    help_text = subprocess.run([binary(), "gateway", "--help"], capture_output=True, text=True, check=True).stdout
    assert "--ssl-certfile" in help_text and "--ssl-keyfile" in help_text
    assert {"name": "tls", "mountPath": "/etc/rngd-pd/tls", "readOnly": True} in c["volumeMounts"]
    spec = objs[("Deployment", "demo-gateway")]["spec"]["template"]["spec"]
    assert {"name": "tls", "secret": {"secretName": "demo-tls", "defaultMode": 0o400}} in spec["volumes"]
    for probe in ("readinessProbe", "startupProbe", "livenessProbe"):
        assert c[probe]["httpGet"]["scheme"] == "HTTPS", probe
    assert objs[("Service", "demo-gateway")]["spec"]["ports"][0]["appProtocol"] == "https"
    plain = container(render(), "demo-gateway")
    assert not any(a.startswith("--ssl-") for a in plain["args"])
    assert "scheme" not in plain["readinessProbe"]["httpGet"]


def test_decode_workers_only_call_allowed_prefill_workers():
    """The default allowlists name the release's own pods, through headless
    Services that select exactly those pods (not all private ranges)."""
    objs = render()
    ns = "ai"  # the namespace helm_chart.render installs into
    args = container(objs, "demo-decode")["args"]
    assert f"--prefill-allow=dns:demo-prefill-peers.{ns}.svc:8000" in args
    assert not any(a.startswith("--prefill-allow") for a in container(objs, "demo-prefill")["args"])
    assert f"--front-door-allow=dns:demo-decode-peers.{ns}.svc,dns:demo-gateway-peers.{ns}.svc" \
        in container(objs, "demo-prefill")["args"]
    for role in ("prefill", "decode", "gateway"):
        svc = objs[("Service", f"demo-{role}-peers")]["spec"]
        pod = objs[("Deployment", f"demo-{role}")]["spec"]["template"]["metadata"]["labels"]
        assert svc["clusterIP"] == "None" and svc["publishNotReadyAddresses"] is True
        assert svc["selector"].items() <= pod.items(), role
        # Only this role's pods: the selector names the component.
        assert svc["selector"]["app.kubernetes.io/component"] == role
        assert svc["selector"]["app.kubernetes.io/instance"] == "demo"
    args = container(render({"decode": {"prefillAllow": ["10.244.0.0/16:8000"]}}), "demo-decode")["args"]
    assert "--prefill-allow=10.244.0.0/16:8000" in args
    args = container(render({"prefill": {"frontDoorAllow": ["10.1.0.0/16"]}, "gateway": {"enabled": False}}),
                     "demo-prefill")["args"]
    assert f"--front-door-allow=dns:demo-decode-peers.{ns}.svc,10.1.0.0/16" in args


# --- Pool discovery: the picker and the gateway watch the InferencePool ------

WATCH_RULES = [
    {"apiGroups": ["inference.networking.k8s.io"], "resources": ["inferencepools"], "verbs": ["get", "list", "watch"]},
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
]




def test_picker_and_gateway_discover_the_release_pool():
    objs = render()
    pool = objs[("InferencePool", "demo")]
    for name in ("demo-epp", "demo-gateway"):
        args = container(objs, name)["args"]
        assert f"--pool-name={pool['metadata']['name']}" in args, args
        assert "--pool-namespace=ai" in args, args
        assert not any(a.startswith("--endpoints") for a in args), args
        assert not any(a.startswith("--kubeconfig") for a in args), "in-cluster config is the default"


def test_prefix_routing_flags_come_from_values():
    """Both doors route on the workers' cached prefixes by default (no flag:
    discovery names the streams); the values turn on approximate mode or
    turn it all off."""
    for name in ("demo-epp", "demo-gateway"):
        args = container(render(), name)["args"]
        assert not any("prefix" in a for a in args), args
        approx = container(render({"prefixRouting": {"approximate": True, "approximateTtlMs": 5000}}), name)["args"]
        assert "--approximate-prefix" in approx and "--approximate-prefix-ttl-ms=5000" in approx, approx
        off = container(render({"prefixRouting": {"enabled": False}}), name)["args"]
        assert "--no-prefix-routing" in off and "--approximate-prefix" not in off, off


def test_discovery_role_allows_exactly_the_watch():
    objs = render()
    roles = [o for (kind, _), o in objs.items() if kind in ("Role", "ClusterRole")]
    assert [r["metadata"]["name"] for r in roles] == ["demo-pool-reader"]
    assert roles[0]["kind"] == "Role", "namespaced, not cluster-wide"
    assert roles[0]["rules"] == WATCH_RULES
    assert not any(kind == "ClusterRoleBinding" for kind, _ in objs)
    bindings = {name: o for (kind, name), o in objs.items() if kind == "RoleBinding"}
    assert sorted(bindings) == ["demo-epp-pool-reader", "demo-gateway-pool-reader"]
    for component in ("epp", "gateway"):
        b = bindings[f"demo-{component}-pool-reader"]
        assert b["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "demo-pool-reader"}
        assert b["subjects"] == [{"kind": "ServiceAccount", "name": f"demo-{component}", "namespace": "ai"}]
    # No gateway, no binding for it.
    objs = render({"gateway": {"enabled": False}})
    assert [n for k, n in objs if k == "RoleBinding"] == ["demo-epp-pool-reader"]
    assert ("ServiceAccount", "demo-gateway") not in objs


def test_service_accounts_mount_a_token_only_where_discovery_needs_it():
    objs = render()
    specs = pod_specs(objs)
    for component in ("epp", "gateway"):
        sa = objs[("ServiceAccount", f"demo-{component}")]
        assert sa["automountServiceAccountToken"] is False
        assert specs[f"demo-{component}"]["serviceAccountName"] == f"demo-{component}"
        assert specs[f"demo-{component}"]["automountServiceAccountToken"] is True
    for name in ("demo-prefill", "demo-decode", "demo-relay"):
        assert specs[name]["automountServiceAccountToken"] is False, name
        assert "serviceAccountName" not in specs[name], name
    # Without the InferencePool nothing talks to the API server.
    objs = render({"inferencePool": {"enabled": False}})
    assert not any(kind in ("Role", "RoleBinding", "InferencePool") for kind, _ in objs)
    for name, spec in pod_specs(objs).items():
        assert spec["automountServiceAccountToken"] is False, name


def test_static_endpoints_are_the_alternative_without_the_pool(tmp_path):
    eps = [{"address": "10.0.0.5:8000", "role": "decode", "vendor": "cpu", "node": "n1", "seq_len": 512}]
    objs = render({"inferencePool": {"enabled": False}, "endpoints": eps})
    assert yaml.safe_load(objs[("ConfigMap", "demo-policy")]["data"]["endpoints.json"]) == eps
    for name in ("demo-epp", "demo-gateway"):
        args = container(objs, name)["args"]
        assert "--endpoints=/etc/rngd-pd/policy/endpoints.json" in args
        assert not any(a.startswith("--pool-") for a in args), args
        local, env = local_command(objs, name, tmp_path)
        r = subprocess.run([binary(), *local, "--check"], capture_output=True, text=True, env=env, timeout=120)
        assert r.returncode == 0 and r.stdout.strip().endswith("ok"), f"{local}\n{r.stdout}\n{r.stderr}"
    # With the pool, endpoints would be silently ignored: refused instead.
    assert "endpoints is used only with inferencePool.enabled=false" in render_error({"endpoints": eps})


def test_discovery_needs_one_worker_port():
    msg = render_error({"prefill": {"port": 8001}})
    assert "prefill.port (8001) and decode.port (8000) differ" in msg
    render({"prefill": {"port": 8001}, "inferencePool": {"enabled": False}})


def test_worker_pods_carry_what_discovery_reads():
    objs = render({"seqLen": 1024})
    pool = objs[("InferencePool", "demo")]["spec"]
    selected = []
    for (kind, name), o in objs.items():
        if kind == "Deployment":
            labels = o["spec"]["template"]["metadata"]["labels"]
            if pool["selector"]["matchLabels"].items() <= labels.items():
                selected.append(name)
    assert sorted(selected) == ["demo-decode", "demo-prefill"]
    for role in ("prefill", "decode"):
        meta = objs[("Deployment", f"demo-{role}")]["spec"]["template"]["metadata"]
        assert meta["labels"]["llm-d.ai/role"] == role
        assert meta["labels"]["ai-rm.io/accelerator"] == "cpu"
        assert meta["annotations"] == {
            "rngd-pd.io/seq-len": "1024",
            "rngd-pd.io/transports": "tcp",
            "rngd-pd.io/kv-events-port": "5557",
            "rngd-pd.io/kv-events-replay-port": "5558",
        }
        assert "--seq-len=1024" in container(objs, f"demo-{role}")["args"]
        assert f"--port={pool['targetPorts'][0]['number']}" in container(objs, f"demo-{role}")["args"]
    objs = render(NPU)
    for role, vendor in (("prefill", "furiosa"), ("decode", "rebellions")):
        labels = objs[("Deployment", f"demo-{role}")]["spec"]["template"]["metadata"]["labels"]
        assert labels["ai-rm.io/accelerator"] == vendor
    for kv, transports in (({"crossNode": "nixl-ucx"}, "nixl-ucx"), ({}, "tcp"),
                           ({"sameNodeShm": True}, "shm,tcp"),
                           ({"crossNode": "shm", "sameNodeShm": True}, "shm")):
        objs = render({"kvTransport": kv})
        ann = objs[("Deployment", "demo-decode")]["spec"]["template"]["metadata"]["annotations"]
        assert ann["rngd-pd.io/transports"] == transports
    assert "decode.backend must be cpu, rngd or atom" in render_error({"decode": {"backend": "gpu"}})
    assert "needs kvTransport.sameNodeShm" in render_error({"kvTransport": {"crossNode": "shm"}})


# --- The deployment's KV secret -----------------------------------------------


def test_relay_and_workers_share_the_kv_secret_as_a_file():
    objs = render()
    secret = objs[("Secret", "demo-kv")]
    assert len(base64.b64decode(secret["data"]["secret"]).strip()) >= 16
    specs = pod_specs(objs)
    for name in ("demo-relay", "demo-prefill", "demo-decode"):
        c = specs[name]["containers"][0]
        env = {e["name"]: e for e in c["env"]}
        assert env["AIRM_KV_TCP_SECRET_FILE"]["value"] == "/etc/rngd-pd/kv/secret", name
        assert "AIRM_KV_TCP_INSECURE_NO_AUTH" not in env and "AIRM_KV_TCP_SECRET" not in env, name
        assert {"name": "kv-secret", "mountPath": "/etc/rngd-pd/kv", "readOnly": True} in c["volumeMounts"]
        volumes = {v["name"]: v for v in specs[name]["volumes"]}
        # Owner-read only (0400); the pods' fsGroup makes it theirs.
        assert volumes["kv-secret"]["secret"] == {"secretName": "demo-kv", "defaultMode": 0o400,
                                                  "items": [{"key": "secret", "path": "secret"}]}
        assert specs[name]["securityContext"]["fsGroup"] == 65532
        assert secret["data"]["secret"] not in yaml.safe_dump(objs[("Deployment", name)])
    for name in ("demo-epp", "demo-gateway"):
        assert "kv-secret" not in {v["name"] for v in specs[name]["volumes"]}, name
    # An existing Secret instead: none created, that one mounted.
    objs = render({"kvTransport": {"secretName": "kv-mine"}})
    assert ("Secret", "demo-kv") not in objs
    volumes = {v["name"]: v for v in pod_specs(objs)["demo-decode"]["volumes"]}
    assert volumes["kv-secret"]["secret"]["secretName"] == "kv-mine"
    # No relay: the workers still sign and verify KV handles with it.
    objs = render({"relay": {"enabled": False}})
    assert ("Secret", "demo-kv") in objs
    env = {e["name"] for e in container(objs, "demo-decode")["env"]}
    assert "AIRM_KV_TCP_SECRET_FILE" in env and "AIRM_KV_TCP_ADDR" not in env


def test_relay_connections_use_tls_keyed_by_the_kv_secret_or_a_mounted_certificate():
    """`relay.tls` reaches the relay and every worker alike (both ends must
    agree); `relay.tlsSecretName` mounts the certificate and key in the relay
    and only `ca.crt` in the workers, read-only and 0400."""
    def envs(objs):
        specs = pod_specs(objs)
        return {n: {e["name"]: e.get("value") for e in specs[n]["containers"][0]["env"]}
                for n in ("demo-relay", "demo-prefill", "demo-decode")}

    for name, env in envs(render()).items():
        assert env["AIRM_KV_TCP_TLS"] == "auto", name
        assert not any(k.startswith(("AIRM_KV_RELAY_TLS", "AIRM_KV_TCP_TLS_CA")) for k in env), name
    for name, env in envs(render({"relay": {"tls": "off"}})).items():
        assert env["AIRM_KV_TCP_TLS"] == "off", name
    objs = render({"relay": {"tlsSecretName": "relay-cert"}})
    env = envs(objs)
    assert env["demo-relay"]["AIRM_KV_RELAY_TLS_CERT_FILE"] == "/etc/rngd-pd/relay-tls/tls.crt"
    assert env["demo-relay"]["AIRM_KV_RELAY_TLS_KEY_FILE"] == "/etc/rngd-pd/relay-tls/tls.key"
    specs = pod_specs(objs)
    relay_vol = {v["name"]: v for v in specs["demo-relay"]["volumes"]}["relay-tls"]["secret"]
    assert relay_vol == {"secretName": "relay-cert", "defaultMode": 0o400}
    for name in ("demo-prefill", "demo-decode"):
        assert env[name]["AIRM_KV_TCP_TLS_CA_FILE"] == "/etc/rngd-pd/relay-tls/ca.crt", name
        assert "AIRM_KV_RELAY_TLS_KEY_FILE" not in env[name], name
        vol = {v["name"]: v for v in specs[name]["volumes"]}["relay-tls"]["secret"]
        assert vol["items"] == [{"key": "ca.crt", "path": "ca.crt"}], "the key stays in the relay"
        mount = {m["name"]: m for m in specs[name]["containers"][0]["volumeMounts"]}["relay-tls"]
        assert mount["readOnly"] is True
    for name in ("demo-epp", "demo-gateway"):
        assert "relay-tls" not in {v["name"] for v in specs[name]["volumes"]}, name
    assert "pick one" in render_error({"relay": {"tls": "off", "tlsSecretName": "relay-cert"}})
    assert "auto or off" in render_error({"relay": {"tls": "yes"}})


def test_prefill_workers_take_prefill_only_requests_from_the_release_only():
    """The release's decode and gateway pods by name (no private ranges),
    plus what `prefill.frontDoorAllow` adds; decode workers take none."""
    pre = container(render(), "demo-prefill")
    assert "--front-door-allow=dns:demo-decode-peers.ai.svc,dns:demo-gateway-peers.ai.svc" in pre["args"]
    assert not any("10.0.0.0/8" in a or "192.168.0.0/16" in a for a in pre["args"])
    assert not any(a.startswith("--front-door-allow") for a in container(render(), "demo-decode")["args"])
    pre = container(render({"prefill": {"frontDoorAllow": ["10.244.0.0/16"]}}), "demo-prefill")
    assert "--front-door-allow=dns:demo-decode-peers.ai.svc,dns:demo-gateway-peers.ai.svc,10.244.0.0/16" \
        in pre["args"]


def test_same_node_shm_passes_the_arena_slots_to_every_worker():
    """`kvTransport.shmSlots` reaches the workers as AIRM_KV_SHM_SLOTS (the
    slot arena of `docs/kv-wire.md`) only where the shm transport is on, and
    the binary accepts the rendered value."""
    def env_of(objs, name):
        return {e["name"]: e.get("value") for e in container(objs, name)["env"]}

    for role in ("prefill", "decode"):
        assert "AIRM_KV_SHM_SLOTS" not in env_of(render(), f"demo-{role}")
        on = env_of(render({"kvTransport": {"sameNodeShm": True}}), f"demo-{role}")
        assert on["AIRM_KV_SHM_SLOTS"] == "8", on
        more = env_of(render({"kvTransport": {"sameNodeShm": True, "shmSlots": 32}}), f"demo-{role}")
        assert more["AIRM_KV_SHM_SLOTS"] == "32", more
    # What the chart renders is what a worker's configuration check takes;
    # a value past the transport's bound is refused by name.
    for value, ok in (("32", True), ("0", True), ("257", False)):
        r = subprocess.run([binary(), "worker", "--check", "--kv-transport", "shm"],
                           capture_output=True, text=True,
                           env={**os.environ, "AIRM_KV_SHM_SLOTS": value, "RUST_BACKTRACE": "0"})
        assert (r.returncode == 0) == ok, (value, r.returncode, r.stdout, r.stderr)
        if not ok:
            assert "AIRM_KV_SHM_SLOTS" in r.stderr + r.stdout, r.stderr


def test_cross_node_nixl_ucx_renders_the_transport_env_and_arena():
    def env_of(objs, name):
        return {e["name"]: e.get("value") for e in container(objs, name)["env"]}

    default = env_of(render(), "demo-decode")
    assert default["AIRM_KV_TRANSPORT"] == "tcp"
    assert "AIRM_KV_UCX_POOL_MB" not in default and "UCX_TLS" not in default
    objs = render(
        {
            "kvTransport": {
                "crossNode": "nixl-ucx",
                "nixl": {
                    "poolMb": 2048,
                    "ucxTls": "rc,ud,sm,self",
                    "ucxNetDevices": "mlx5_0:1",
                    "libDir": "/opt/nixl/lib/x86_64-linux-gnu",
                },
            }
        }
    )
    for name in ("demo-prefill", "demo-decode"):
        env = env_of(objs, name)
        assert env["AIRM_KV_TRANSPORT"] == "nixl-ucx"
        assert env["AIRM_KV_UCX_POOL_MB"] == "2048"
        assert env["UCX_TLS"] == "rc,ud,sm,self"
        assert env["UCX_NET_DEVICES"] == "mlx5_0:1"
        assert env["AIRM_KV_NIXL_LIB_DIR"] == "/opt/nixl/lib/x86_64-linux-gnu"
        assert env["AIRM_KV_UCX_LOG"] == "0"
        assert env["AIRM_KV_TCP_ADDR"] == "demo-relay:7070", "descriptors go through the relay"
        assert "AIRM_KV_NIXL_PLUGIN_DIR" not in env
        pod = objs[("Deployment", name)]["spec"]["template"]["metadata"]
        assert "nixl-ucx" in pod["annotations"]["rngd-pd.io/transports"]
    err = render_error({"kvTransport": {"crossNode": "nixl-ucx"}, "relay": {"enabled": False}})
    assert "relay.enabled" in err


def test_workers_cache_prefixes_and_publish_kv_events_as_vllm():
    """The prefix-cache flags and vLLM's --kv-events-config, with the pod's
    name in the topic (expanded by the kubelet from POD_NAME), both ports
    declared and annotated; and nothing of it when turned off."""
    objs = render({"prefixCache": {"blockSize": 32, "bytes": 1 << 30}})
    for role in ("prefill", "decode"):
        c = container(objs, f"demo-{role}")
        args = c["args"]
        assert "--block-size=32" in args and "--prefix-cache-bytes=1073741824" in args
        ev = [a for a in args if a.startswith("--kv-events-config=")]
        assert len(ev) == 1, args
        cfg = json.loads(ev[0].split("=", 1)[1])
        assert cfg == {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": "tcp://*:5557",
            "replay_endpoint": "tcp://*:5558",
            "topic": "kv@$(POD_NAME)@SmolLM2-135M-Instruct",
            "buffer_steps": 10000,
        }
        names = {e["name"] for e in c["env"]}
        assert "POD_NAME" in names
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports == {"http": 8000, "kv-events": 5557, "kv-replay": 5558}
    off = render({"prefixCache": {"enabled": False}})
    for role in ("prefill", "decode"):
        args = container(off, f"demo-{role}")["args"]
        assert "--no-enable-prefix-caching" in args
        assert not any(a.startswith(("--kv-events-config", "--block-size")) for a in args)
        meta = off[("Deployment", f"demo-{role}")]["spec"]["template"]["metadata"]
        assert "rngd-pd.io/kv-events-port" not in meta["annotations"]



def test_workers_chunk_prefills_under_the_budget_from_values():
    """Every worker gets the chunked-prefill budget and, when turned on,
    `--enable-chunked-prefill` (vLLM's flag names, which
    `test_container_flags_exist_in_the_binary` checks against the binary);
    off by default, and `roles` narrows it to the decode workers."""
    default = render()
    on = render({"chunkedPrefill": {"enabled": True, "maxNumBatchedTokens": 256}})
    for role in ("prefill", "decode"):
        args = container(default, f"demo-{role}")["args"]
        assert "--enable-chunked-prefill" not in args, args
        assert "--max-num-batched-tokens=128" in args, args
        args = container(on, f"demo-{role}")["args"]
        assert "--enable-chunked-prefill" in args, args
        assert "--max-num-batched-tokens=256" in args, args
    # Only the decode workers' local prefills chunked.
    decode_only = render({"chunkedPrefill": {"enabled": True, "roles": ["decode"]}})
    assert "--enable-chunked-prefill" in container(decode_only, "demo-decode")["args"]
    assert "--enable-chunked-prefill" not in container(decode_only, "demo-prefill")["args"]
    msg = render_error({"chunkedPrefill": {"enabled": True, "roles": ["decoder"]}})
    assert "chunkedPrefill.roles may hold prefill and decode only (got decoder)" in msg, msg


def test_every_worker_prefills_on_the_kernel_from_values():
    """One `--prefill-projections` for every worker (a PD pair must prefill
    alike), `auto` by default; the binary accepts the rendered args
    (`test_container_flags_exist_in_the_binary`)."""
    default = render()
    f32 = render({"prefillProjections": "f32"})
    for role in ("prefill", "decode"):
        assert "--prefill-projections=auto" in container(default, f"demo-{role}")["args"]
        assert "--prefill-projections=f32" in container(f32, f"demo-{role}")["args"]


# === every value is read ===

# Values that only matter once another value turns their part on: the test
# changes them on top of these (the path prefix, then the enabling values).
CONTEXT = [
    (("kvTransport", "nixl"), {"kvTransport": {"crossNode": "nixl-ucx"}}),
    (("kvTransport", "shmHostPath"), {"kvTransport": {"sameNodeShm": True}}),
    (("kvTransport", "shmSlots"), {"kvTransport": {"sameNodeShm": True}}),
    (("httpRoute", "parentGateway"), {"httpRoute": {"enabled": True}}),
    (("httpRoute", "timeouts"), {"httpRoute": {"enabled": True}}),
    (("podMonitor", "interval"), {"podMonitor": {"enabled": True}}),
    (("podMonitor", "labels"), {"podMonitor": {"enabled": True}}),
    (("prefixRouting", "approximateTtlMs"), {"prefixRouting": {"approximate": True}}),
    (("decode", "deviceResource"), {"decode": {"backend": "atom"}}),
    (("prefill", "deviceResource"), {"prefill": {"backend": "rngd"}}),
    (("model", "fetchResources"), {"model": {"fetch": True}}),
    (("chunkedPrefill", "roles"), {"chunkedPrefill": {"enabled": True}}),
]

# What a value becomes when changing it needs a value of its own kind.
CHANGED = {
    ("image", "pullPolicy"): "Always",
    ("kvTransport", "crossNode"): "nixl-ucx",
    ("kvTransport", "shmHostPath"): "/dev/shm/elsewhere",
    ("kvTransport", "nixl", "ucxTls"): "rc",
    ("prefill", "backend"): "rngd",
    ("decode", "backend"): "atom",
    ("inferencePool", "failureMode"): "FailOpen",
    ("gateway", "serviceType"): "NodePort",
    ("prefill", "frontDoorAllow"): ["10.1.0.0/16"],
    ("decode", "prefillAllow"): ["10.1.0.0/16"],
    ("endpoints",): [{"url": "http://10.1.2.3:8000", "role": "decode"}],
    ("networkPolicy", "gatewayPeers"): [{"namespaceSelector": {"matchLabels": {"probe": "x"}}}],
    ("networkPolicy", "metricsPeers"): [{"namespaceSelector": {"matchLabels": {"probe": "x"}}}],
    ("model", "volume"): {"emptyDir": None, "persistentVolumeClaim": {"claimName": "probe"}},
    ("chunkedPrefill", "roles"): ["decode"],
}


def leaves(values, prefix=()):
    """Every settable value of `values` as (path, value); an empty map or list
    is a value of its own."""
    for k, v in values.items():
        if isinstance(v, dict) and v and prefix + (k,) not in CHANGED:
            yield from leaves(v, prefix + (k,))
        else:
            yield prefix + (k,), v


def changed(path, v):
    if path in CHANGED:
        return CHANGED[path]
    if isinstance(v, bool):
        return not v
    if isinstance(v, int):
        return v + 1
    if isinstance(v, str):
        return v + "-probe" if v else "probe"
    if isinstance(v, list):
        return [{"key": "probe", "operator": "Exists"}]
    if isinstance(v, dict):
        return {"probe": "1"} if path[-1] == "nodeSelector" else {"limits": {"cpu": "3"}}
    raise AssertionError(f"no change for {path}: {v!r}")


def nest(path, v):
    out = v
    for k in reversed(path):
        out = {k: out}
    return out


def merged(a, b):
    out = dict(a)
    for k, v in b.items():
        out[k] = merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def test_every_value_changes_some_rendered_object():
    """A value in values.yaml that nothing reads is a setting that silently
    does nothing: each one, changed, must change the rendered objects (or be
    refused by the chart's own checks, which read it too)."""
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    # An object that differs between two renders of the same values (the
    # generated KV secret) says nothing about a value: left out.
    random = {k for k, o in render().items() if render().get(k) != o}
    assert random <= {("Secret", "demo-kv")}, random

    def stable(values):
        return {k: o for k, o in render(values).items() if k not in random}

    unused = []
    for path, v in leaves(defaults):
        base = {}
        for prefix, ctx in CONTEXT:
            if path[: len(prefix)] == prefix:
                base = merged(base, ctx)
        before = stable(base)
        try:
            after = stable(merged(base, nest(path, changed(path, v))))
        except helm.errors.HelmRenderError:
            continue
        if after == before:
            unused.append(".".join(path))
    assert unused == [], f"values that change nothing: {unused}"


def test_the_served_name_reaches_every_door():
    """`model.name` is what the workers, the gateway and the picker serve
    (each refuses any other model with 404); empty leaves the GGUF's name."""
    for name, want in [("my-model", ["--served-model-name=my-model"]), ("", [])]:
        objs = render({"model": {"name": name}})
        for d in ["demo-prefill", "demo-decode", "demo-gateway", "demo-epp"]:
            args = container(objs, d)["args"]
            assert [a for a in args if a.startswith("--served-model-name")] == want, (d, args)


def test_gateway_and_workers_drain_within_their_grace_period():
    """The gateway, the workers and the picker wait `shutdown.preStopSeconds` in a
    preStop hook (Kubernetes' sleep action), then drain for at most
    `--shutdown-timeout`; the pod's grace period covers both plus 10 s, so
    the kubelet's SIGKILL never lands inside a drain."""
    for values, pre, timeout in [({}, 5, 30), ({"shutdown": {"preStopSeconds": 0, "timeoutSeconds": 120}}, 0, 120)]:
        objs = render(values)
        specs = pod_specs(objs)
        for d in ["demo-prefill", "demo-decode", "demo-gateway", "demo-epp"]:
            spec, c = specs[d], container(objs, d)
            assert f"--shutdown-timeout={timeout}" in c["args"], (d, c["args"])
            assert spec["terminationGracePeriodSeconds"] == pre + timeout + 10, (d, spec)
            if pre:
                assert c["lifecycle"] == {"preStop": {"sleep": {"seconds": pre}}}, (d, c)
            else:
                assert "lifecycle" not in c, (d, c)
        # The gateway's readiness is the route that turns 503 on SIGTERM.
        probe = container(objs, "demo-gateway")["readinessProbe"]["httpGet"]
        assert probe["path"] == "/ready", probe


# === Pod Security "restricted" ===

RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                      "projected", "secret"}


def restricted_violations(spec):
    """The rules of Kubernetes' Pod Security "restricted" profile (which
    includes "baseline") a pod spec breaks, as readable strings."""
    bad = []
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(key):
            bad.append(key)
    pod_sc = spec.get("securityContext", {})
    for v in spec.get("volumes", []):
        kinds = set(v) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            bad.append(f"volume {v['name']}: {sorted(kinds - RESTRICTED_VOLUMES)}")
    if pod_sc.get("runAsUser") == 0:
        bad.append("pod runAsUser 0")
    if pod_sc.get("seccompProfile", {}).get("type") == "Unconfined":
        bad.append("pod seccomp Unconfined")
    for c in spec.get("initContainers", []) + spec["containers"]:
        sc, name = c.get("securityContext", {}), c["name"]
        if sc.get("privileged"):
            bad.append(f"{name}: privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            bad.append(f"{name}: allowPrivilegeEscalation not false")
        if not sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")):
            bad.append(f"{name}: runAsNonRoot not true")
        if sc.get("runAsUser", pod_sc.get("runAsUser")) == 0:
            bad.append(f"{name}: runAsUser 0")
        seccomp = sc.get("seccompProfile", pod_sc.get("seccompProfile", {})).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            bad.append(f"{name}: seccompProfile {seccomp}")
        caps = sc.get("capabilities", {})
        if "ALL" not in caps.get("drop", []):
            bad.append(f"{name}: capabilities not dropped")
        if set(caps.get("add", [])) - {"NET_BIND_SERVICE"}:
            bad.append(f"{name}: capabilities added {caps['add']}")
        if any(p.get("hostPort") for p in c.get("ports", [])):
            bad.append(f"{name}: hostPort")
    return bad


def test_the_default_chart_meets_pod_security_restricted():
    """Every pod the CPU default renders passes the "restricted" rules; the
    options that cannot are named: the shm transport (a hostPath and a root
    init container) and the NPU backends (the kubelet's device-plugin
    directory)."""
    for name, spec in pod_specs(render()).items():
        assert restricted_violations(spec) == [], name
    shm = pod_specs(render({"kvTransport": {"sameNodeShm": True}}))
    assert restricted_violations(shm["demo-relay"]) == []
    assert sorted(restricted_violations(shm["demo-decode"])) == [
        "shm-root: capabilities added ['CHOWN', 'FOWNER', 'DAC_OVERRIDE']",
        "shm-root: runAsNonRoot not true",
        "shm-root: runAsUser 0",
        "volume kv-shm: ['hostPath']",
    ]
    npu = pod_specs(render(NPU))
    for role in ("prefill", "decode"):
        assert restricted_violations(npu[f"demo-{role}"]) == ["volume device-plugins: ['hostPath']"], role


def test_probes_budgets_route_timeouts_and_scrapes_are_rendered():
    """Every long-running container has a liveness probe (the gateway a
    startup probe too, on a route that answers whatever the workers do);
    each component has a PodDisruptionBudget; the HTTPRoute bounds long
    streams by its own timeouts instead of the proxy's 15 s default; the
    relay exports its figures on a metrics port that the metrics peers and
    the PodMonitor reach; the relay's memory limit is above its cap."""
    objs = render({"httpRoute": {"enabled": True}, "podMonitor": {"enabled": True, "labels": {"team": "ml"}}})
    for name in ("demo-prefill", "demo-decode", "demo-gateway", "demo-relay", "demo-epp"):
        c = container(objs, name)
        assert "livenessProbe" in c and "readinessProbe" in c, name
        # Measured requests and limits on every component (values.yaml
        # says what was measured).
        assert c["resources"]["requests"]["memory"] and c["resources"]["limits"]["memory"], name
    gw = container(objs, "demo-gateway")
    assert gw["startupProbe"]["httpGet"]["path"] == gw["livenessProbe"]["httpGet"]["path"] == "/version"
    for c in ("prefill", "decode", "gateway", "epp"):
        pdb = objs[("PodDisruptionBudget", f"demo-{c}")]
        assert pdb["spec"]["maxUnavailable"] == 1
        assert pdb["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == c
    assert not any(k[0] == "PodDisruptionBudget" for k in render({"podDisruptionBudget": {"enabled": False}}))
    route = objs[("HTTPRoute", "demo-route")]["spec"]["rules"][0]
    assert route["timeouts"] == {"request": "600s", "backendRequest": "600s"}
    relay = container(objs, "demo-relay")
    assert "--metrics-listen=0.0.0.0:9091" in relay["args"]
    assert {"name": "metrics", "containerPort": 9091} in relay["ports"]
    assert relay["resources"]["limits"]["memory"] == "4608Mi" and 4608 << 20 > 4294967296
    policy = objs[("NetworkPolicy", "demo-relay")]["spec"]["ingress"]
    assert {"port": 9091} in policy[1]["ports"] and policy[1]["from"] == [{"podSelector": {}}]
    mon = objs[("PodMonitor", "demo-metrics")]
    assert mon["metadata"]["labels"]["team"] == "ml"
    assert {e["port"] for e in mon["spec"]["podMetricsEndpoints"]} == {"http", "metrics"}
    assert mon["spec"]["selector"]["matchLabels"]["app.kubernetes.io/instance"] == "demo"
    # A Prometheus in another namespace, as the metrics peers, reaches the
    # workers' /metrics too.
    peers = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
    workers = render({"networkPolicy": {"metricsPeers": peers}})[("NetworkPolicy", "demo-workers")]["spec"]["ingress"]
    assert any(r["from"] == peers and {"port": 8000} in r["ports"] for r in workers), workers


def test_nixl_ucx_workers_admit_each_other_on_every_port():
    rules = render({"kvTransport": {"crossNode": "nixl-ucx"}})[("NetworkPolicy", "demo-workers")]["spec"]["ingress"]
    everything = [r for r in rules if "ports" not in r]
    assert everything == [{"from": [{"podSelector": {"matchLabels": {"rngd-pd.io/pool": "demo"}}}]}], rules
    assert all("ports" in r for r in render()[("NetworkPolicy", "demo-workers")]["spec"]["ingress"])
