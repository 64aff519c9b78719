"""What an operator's log pipeline sees: `--log-format json` (or
RNGD_PD_LOG_FORMAT=json) gives one JSON object per stderr line; text logs
carry no colour escape codes when stderr is not a terminal; and `rngd-pd up
2>&1 | tee log` survives the pipe closing at Ctrl-C (no panic, exit 0,
children stopped)."""

import json
import os
import signal
import subprocess
import time

from conftest import rngd_bin

SECRET = "0123456789abcdef0123456789abcdef"


def relay_stderr(*extra, env=None):
    """`rngd-pd relay` started, stopped with SIGINT once it listens; its stderr."""
    p = subprocess.Popen([rngd_bin(), "relay", "--listen", "127.0.0.1:0", *extra],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=dict(os.environ, AIRM_KV_TCP_SECRET=SECRET, RUST_LOG="info", **(env or {})))
    try:
        line = p.stdout.readline()
        assert line.startswith("relay listening on"), line
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=30)
    finally:
        p.kill()
    assert p.returncode == 0, err
    return err


def test_json_logs_are_one_object_per_line_by_flag_or_env():
    for err in (relay_stderr("--log-format", "json"), relay_stderr(env={"RNGD_PD_LOG_FORMAT": "json"})):
        lines = [l for l in err.splitlines() if l.strip()]
        assert lines, "no log line"
        for line in lines:
            o = json.loads(line)
            assert {"timestamp", "level", "fields", "target"} <= o.keys(), o
        assert any(json.loads(l)["fields"].get("message") == "KV relay listening" for l in lines), lines


def test_text_logs_to_a_pipe_have_no_escape_codes():
    err = relay_stderr()
    assert "KV relay listening" in err
    assert "\x1b[" not in err, repr(err[:200])


def test_up_survives_its_output_pipe_closing_at_ctrl_c():
    p = subprocess.Popen([rngd_bin(), "up", "--gateway-port", "0", "--no-ext-proc"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=dict(os.environ, RUST_LOG="warn"), start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            line = p.stdout.readline()
            assert line, f"up exited early with {p.poll()}"
            if line.startswith("rngd-pd up: ready"):
                break
        # The reader goes away (as `tee` does on Ctrl-C), then the signal.
        p.stdout.close()
        p.send_signal(signal.SIGINT)
        code = p.wait(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert code == 0, f"up exited with {code} (101 is a panic)"
    # No child of that `up` is left.
    left = subprocess.run(["pgrep", "-s", str(p.pid)], capture_output=True, text=True).stdout.split()
    assert left == [], left


def test_up_reports_a_busy_port_at_once_naming_the_flag():
    import socket

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    try:
        start = time.monotonic()
        r = subprocess.run([rngd_bin(), "up", "--port", str(port), "--no-ext-proc"],
                           capture_output=True, text=True, timeout=120)
        took = time.monotonic() - start
    finally:
        busy.close()
    assert r.returncode != 0
    assert f"127.0.0.1:{port} (--port/--gateway-port) cannot be bound" in r.stderr, r.stderr
    # Refused before any worker started (none printed its address).
    assert "worker listening" not in r.stdout + r.stderr, r.stdout + r.stderr
    print(f"busy port refused in {took:.2f} s")
