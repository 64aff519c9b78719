#!/usr/bin/env python3
"""Render deploy/envoy/envoy.yaml with other ports/hosts.

Every line tagged `# @NAME` has its value (the text after the last `:` and
before the comment) replaced when `--NAME VALUE` is given, e.g.

    python3 deploy/envoy/render.py --LISTEN_PORT 18081 --EPP_PORT 19002 > envoy.yaml

Names: LISTEN_HOST, LISTEN_PORT, ADMIN_PORT, EPP_HOST, EPP_PORT, FAILURE_MODE_ALLOW,
BODY_MODE (FULL_DUPLEX_STREAMED or BUFFERED, request and response).

`--EPP_TLS false` renders the plaintext variant (for `rngd-pd ext-proc
--secure-serving=false`): the lines from `# @EPP_TLS begin` to `# @EPP_TLS end`
(the epp cluster's TLS transport socket) are left out. The default is TLS.
"""

import argparse
import pathlib
import re
import sys

TEMPLATE = pathlib.Path(__file__).with_name("envoy.yaml")
NAMES = ["LISTEN_HOST", "LISTEN_PORT", "ADMIN_PORT", "EPP_HOST", "EPP_PORT", "FAILURE_MODE_ALLOW", "BODY_MODE", "EPP_TLS"]
BODY_MODES = ("FULL_DUPLEX_STREAMED", "BUFFERED")
BLOCK = re.compile(r"^\s*#\s*@(?P<name>[A-Z_]+)\s+(?P<edge>begin|end)\b")
TAGGED = re.compile(r"^(?P<head>\s*[A-Za-z_]+:\s*)(?P<value>\S+)(?P<tail>\s*#\s*@(?P<name>[A-Z_]+)\s*)$")


def render(values: dict, template: str | None = None) -> str:
    """The config text with every tagged value in `values` replaced; with
    `EPP_TLS` false (`False`, "false", "0", "no") the TLS block is left out."""
    text = TEMPLATE.read_text() if template is None else template
    mode = values.get("BODY_MODE")
    if mode is not None and str(mode) not in BODY_MODES:
        raise ValueError(f"BODY_MODE {mode!r}: one of {BODY_MODES}")
    tls = str(values.get("EPP_TLS", "true")).lower() not in ("false", "0", "no")
    out = []
    skipping = False
    for line in text.splitlines():
        b = BLOCK.match(line)
        if b and b.group("name") == "EPP_TLS":
            skipping = not tls and b.group("edge") == "begin"
            if not tls:
                continue
        if skipping:
            continue
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
