#!/usr/bin/env python3
"""Render deploy/envoy/envoy.yaml with other ports/hosts.

Every line tagged `# @NAME` has its value (the text after the last `:` and
before the comment) replaced when `--NAME VALUE` is given, e.g.

    python3 deploy/envoy/render.py --LISTEN_PORT 18081 --EPP_PORT 19002 > envoy.yaml

Names: LISTEN_HOST, LISTEN_PORT, ADMIN_PORT, EPP_HOST, EPP_PORT, FAILURE_MODE_ALLOW.
"""

import argparse
import pathlib
import re
import sys

TEMPLATE = pathlib.Path(__file__).with_name("envoy.yaml")
NAMES = ["LISTEN_HOST", "LISTEN_PORT", "ADMIN_PORT", "EPP_HOST", "EPP_PORT", "FAILURE_MODE_ALLOW"]
TAGGED = re.compile(r"^(?P<head>\s*[A-Za-z_]+:\s*)(?P<value>\S+)(?P<tail>\s*#\s*@(?P<name>[A-Z_]+)\s*)$")


def render(values: dict, template: str | None = None) -> str:
    """The config text with every tagged value in `values` replaced."""
    text = TEMPLATE.read_text() if template is None else template
    out = []
    for line in text.splitlines():
        m = TAGGED.match(line)
        if m and m.group("name") in values:
            line = f"{m.group('head')}{values[m.group('name')]}{m.group('tail')}"
        out.append(line)
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for n in NAMES:
        ap.add_argument(f"--{n}")
    args = ap.parse_args()
    values = {n: getattr(args, n) for n in NAMES if getattr(args, n) is not None}
    sys.stdout.write(render(values))
    return 0


if __name__ == "__main__":
    sys.exit(main())
