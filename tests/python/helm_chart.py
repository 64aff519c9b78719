"""The Helm chart as the chart tests see it: the chart's path, a render with the
Helm SDK (helm-python-sdk) into objects keyed by (kind, name), and the binary
the rendered command lines are checked against."""

import os
from pathlib import Path

import helm_python as helm
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "rngd-pd"


# Values that put the workers on the NPU backends.
NPU = {
    "prefill": {"backend": "rngd", "deviceResource": "furiosa.ai/rngd"},
    "decode": {"backend": "atom", "deviceResource": "rebellions.ai/ATOM"},
}


def render(values=None):
    chart = helm.Chart.load(str(CHART))
    out = chart.render(values or {}, name="demo", namespace="ai")
    objs = []
    for text in out.values():
        objs.extend(d for d in yaml.safe_load_all(text) if d)
    return {(o["kind"], o["metadata"]["name"]): o for o in objs}


def container(objs, name):
    return objs[("Deployment", name)]["spec"]["template"]["spec"]["containers"][0]


def pod_specs(objs):
    return {name: o["spec"]["template"]["spec"] for (kind, name), o in objs.items() if kind == "Deployment"}


def render_error(values):
    with pytest.raises(helm.errors.HelmRenderError) as err:
        render(values)
    return str(err.value)


def binary():
    path = os.environ.get("RNGD_PD_BIN")
    if not path:
        target = os.environ.get("CARGO_TARGET_DIR", str(ROOT / "target"))
        path = os.path.join(target, "release", "rngd-pd")
    assert os.path.exists(path), f"rngd-pd binary not found at {path}: run `cargo build --release`"
    return path
