#!/usr/bin/env python3
"""Inside a two-node cluster (tools/bench-cluster runs it on node 1 of tools/softroce-vm -n 2):
perftest and rdma_bench across the link, servers on node 2 (tools/on-node), clients here.

    bench_cluster_inside.py RDMA_BENCH ROUNDS OUT_JSON

Each round alternates the pairs, perftest then ours:
  ib_send_lat -e -C (2 B, events)  vs  rdma_bench lat --mode events
  ib_send_lat -C    (2 B, busy)    vs  rdma_bench lat --mode busy
  ib_send_bw -e     (64 B, events) vs  rdma_bench rate --mode events
  ib_send_bw        (64 B, busy)   vs  rdma_bench rate --mode busy
Latency: perftest's t_typical (cycles, turned into us with the TSC rate rdma_bench measures
here) against our median of half round trips; rate: MsgRate against our messages/s at the
sender. Each side's best round makes the ratio; every round's ratio is kept."""
import json
import os
import re
import subprocess
import sys

BIN, ROUNDS, OUT = os.path.abspath(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
TOP = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ON_NODE = os.path.join(TOP, "tools", "on-node")
sys.path.insert(0, os.path.join(TOP, "tests", "support"))
import harness  # noqa: E402  (tests/support/harness.py)
PEER = os.environ["RINGVERBS_PEER_ADDR"]
GID = os.environ.get("RINGVERBS_GID_INDEX", "1")
LAT_ITERS, RATE_ITERS = 300, 4000
PORTS = harness.Ports(18700)


def start_server(cmd, ready, port):
    """cmd on node 2, with $RINGVERBS_GID_INDEX its own; returns once `ready` is in its output."""
    return harness.Server([ON_NODE, "2", "bash", "-c", 'exec "$@" 2>&1', "server", *cmd],
                          f"/tmp/bench-cluster-server.{port}.log", ready=re.escape(ready),
                          ready_timeout=60)


def perftest(kind, tool, *args):
    pt = PORTS.next()
    server = start_server(["timeout", "90", "stdbuf", "-oL", tool, "-d", "rxe0", "-x", PEER_GID, "-F", "-p", str(pt), *args],
                          "Waiting for client", pt)
    try:
        r = subprocess.run([tool, "-d", "rxe0", "-x", GID, "-F", "-p", str(pt), *args, PEER],
                           capture_output=True, text=True, timeout=90)
    finally:
        server.finish(60)
    lines = r.stdout.splitlines()
    row = next((lines[i + 1].split() for i, l in enumerate(lines[:-1]) if l.strip().startswith("#bytes")), None)
    if r.returncode != 0 or not row:
        raise RuntimeError(f"{tool} {' '.join(args)} failed ({r.returncode}):\n{r.stdout[-800:]}{r.stderr[-800:]}")
    if kind == "lat":
        return {"typical_us": float(row[4]) / TSC_MHZ, "report_cycles": " ".join(row)}
    return {"mpps": float(row[4]), "report": " ".join(row)}


def ours(kind, *args):
    pt = PORTS.next()
    server = start_server([BIN, kind, *args, "--listen", f"{PEER}:{pt}"], "listening on", pt)
    try:
        r = subprocess.run([BIN, kind, *args, "--connect", f"{PEER}:{pt}"], capture_output=True, text=True,
                           timeout=120)
    finally:
        server.finish(60)
    if r.returncode != 0:
        raise RuntimeError(f"rdma_bench {kind} {' '.join(args)} failed ({r.returncode}):\n{r.stderr[-800:]}")
    j = json.loads(r.stdout)
    if kind == "lat":
        return {"typical_us": j["typical_us"], "allocations": j.get("allocations_per_message")}
    return {"mpps": j["msg_per_s"] / 1e6 if "msg_per_s" in j else j.get("mpps"),
            "allocations": j.get("allocations_per_message")}


def attempt(fn, *args):
    for tries in (1, 2):
        try:
            return fn(*args)
        except (RuntimeError, harness.Failure, subprocess.TimeoutExpired, json.JSONDecodeError) as e:
            print(f"bench-cluster: {e}", file=sys.stderr)
    return None


PEER_GID = subprocess.run([ON_NODE, "2", "printenv", "RINGVERBS_GID_INDEX"], capture_output=True, text=True,
                          check=True).stdout.strip()
TSC_MHZ = float(subprocess.run([BIN, "tsc"], capture_output=True, text=True, check=True).stdout)
PAIRS = {
    "lat_events": (("lat", "ib_send_lat", "-e", "-C", "-s", "2", "-n", str(LAT_ITERS)),
                   ("lat", "--mode", "events", "--iters", str(LAT_ITERS), "--warmup", "50")),
    "lat_busy": (("lat", "ib_send_lat", "-C", "-s", "2", "-n", str(LAT_ITERS)),
                 ("lat", "--mode", "busy", "--iters", str(LAT_ITERS), "--warmup", "50")),
    "rate_events": (("bw", "ib_send_bw", "-e", "-s", "64", "-n", str(RATE_ITERS)),
                    ("rate", "--mode", "events", "--iters", str(RATE_ITERS), "--warmup", "512")),
    "rate_busy": (("bw", "ib_send_bw", "-s", "64", "-n", str(RATE_ITERS)),
                  ("rate", "--mode", "busy", "--iters", str(RATE_ITERS), "--warmup", "512")),
}
rounds = []
for n in range(ROUNDS):
    rnd = {}
    for name, (pt_args, our_args) in PAIRS.items():
        pt_kind, tool, *pt_rest = pt_args
        rnd[name] = {"perftest": attempt(perftest, pt_kind, tool, *pt_rest), "ours": attempt(ours, *our_args)}
        print(f"round {n + 1} {name}: {json.dumps(rnd[name])}", file=sys.stderr, flush=True)
    rounds.append(rnd)


def best(name, side, key, lower):
    vals = [r[name][side][key] for r in rounds if r[name][side] and r[name][side].get(key)]
    return (min(vals) if lower else max(vals)) if vals else None


ratios = {}
for name in PAIRS:
    key, lower = ("typical_us", True) if name.startswith("lat") else ("mpps", False)
    o, p = best(name, "ours", key, lower), best(name, "perftest", key, lower)
    ratios[name] = {"ours": o, "perftest": p, "ratio": round(o / p, 3) if o and p else None,
                    "per_round": [round(r[name]["ours"][key] / r[name]["perftest"][key], 3)
                                  if r[name]["ours"] and r[name]["perftest"] else None for r in rounds]}
result = {"note": "two Soft-RoCE guests on one virtual link (tools/softroce-vm -n 2), server on node 2, "
                  "client on node 1; latency: us per half round trip (lower is better), rate: Mpps at the "
                  "sender (higher is better); ratio = ours / perftest, each side at its best round",
          "rounds": ROUNDS, "tsc_mhz": TSC_MHZ, "host_load": os.environ.get("RINGVERBS_HOST_LOAD"),
          "ratios": ratios, "raw": rounds}
with open(OUT, "w") as f:
    json.dump(result, f, indent=2)
print(f"{'pair':<12} {'ours':>10} {'perftest':>10} {'ratio':>7}  per round")
for name, r in ratios.items():
    fmt = lambda v: f"{v:10.3f}" if v is not None else f"{'-':>10}"
    print(f"{name:<12} {fmt(r['ours'])} {fmt(r['perftest'])} {r['ratio'] if r['ratio'] else '-':>7}  {r['per_round']}")
