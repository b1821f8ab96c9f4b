#!/usr/bin/env python3
"""Inside the Soft-RoCE VM (tools/bench-echo runs it): the echo server and client as processes,
each configuration in turn, sampling the server's RSS and registered bytes while a client runs.

    bench_echo_inside.py BUILD_DIR OUT_LINES COUNT

Rows: events and hybrid modes at 1 and 16 connections (COUNT messages per connection; /5 with
16), then 1024 connections x 100 messages at 64 B, 1 and 4 in flight, with the shared receive
queue (1 and 2 threads) and with per-connection receives, next to 16 connections of the same.
One JSON object per run is appended to OUT_LINES."""
import json
import os
import re
import subprocess
import sys
import time

TOP = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(TOP, "tests", "support"))
import harness  # noqa: E402  (tests/support/harness.py)

BUILD, OUT, COUNT = sys.argv[1], sys.argv[2], int(sys.argv[3])
ADDR = os.environ["RINGVERBS_ADDR"]
SERVER = os.path.join(BUILD, "examples", "echo_server")
CLIENT = os.path.join(BUILD, "examples", "echo_client")
PORT = 18600


def rss_bytes(pid):
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+) kB", f.read()).group(1)) * 1024


def run_client(server, args):
    """Runs a client while sampling the server; returns the client's JSON with the peaks."""
    client = subprocess.Popen([CLIENT, "--address", ADDR, "--port", str(PORT), "--json", *args],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak_rss = peak_reg = 0
    while client.poll() is None:
        try:
            peak_rss = max(peak_rss, rss_bytes(server.pid))
            peak_reg = max(peak_reg, harness.registered_bytes(server.pid) or 0)
        except (OSError, ValueError, json.JSONDecodeError, harness.Failure):
            pass
        time.sleep(0.2)
    out, err = client.communicate()
    sys.stderr.write(err + "".join(l + "\n" for l in out.splitlines() if not l.startswith("echo_client: connection")))
    line = next((l for l in out.splitlines() if l.startswith("{")), None)
    if client.returncode != 0 or line is None:
        return {"error": f"client exit {client.returncode}: {err.strip()[-300:]}"}
    r = json.loads(line)
    r.update(server_rss_peak_bytes=peak_rss, server_registered_peak_bytes=peak_reg)
    return r


def write_row(label, name, server_args, r):
    r["run"] = f"{label}_{name}"
    r["server"] = " ".join(server_args)
    with open(OUT, "a") as out:
        out.write(json.dumps(r) + "\n")


def with_server(server_args, label, runs):
    try:
        server = harness.Server([SERVER, "--address", ADDR, "--port", str(PORT), "--max-connections", "2048",
                                 *server_args], f"/tmp/bench-echo-server.{label}.log", ready="listening",
                                interval=0.1)
    except harness.Failure as e:  # its rows say so; the other configurations still run
        for name, _ in runs:
            write_row(label, name, server_args, {"error": f"server never ready: {str(e)[-300:]}"})
        return
    try:
        for name, args in runs:
            write_row(label, name, server_args, run_client(server.proc, args))
    finally:
        try:
            server.stop(timeout=120)
        except harness.Failure as e:
            print(f"bench-echo: {e}", file=sys.stderr)


for mode in ("events", "hybrid"):
    with_server(["--mode", mode], mode, [
        ("1_clients", ["--mode", mode, "--clients", "1", "--count", str(COUNT), "--size", "64"]),
        ("16_clients", ["--mode", mode, "--clients", "16", "--count", str(COUNT // 5), "--size", "64"]),
    ])

scale = []
for inflight in ("1", "4"):
    for clients in ("16", "1024"):
        scale.append((f"{clients}_clients_inflight_{inflight}",
                      ["--clients", clients, "--count", "100", "--size", "64", "--inflight", inflight]))
with_server([], "srq_1_thread", scale)
with_server(["--threads", "2"], "srq_2_threads", scale)
with_server(["--no-srq"], "per_connection_1_thread", scale)
