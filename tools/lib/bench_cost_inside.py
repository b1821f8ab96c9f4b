#!/usr/bin/env python3
"""The inside part of tools/bench-cost: cost per message you can count, on a device.

    bench_cost_inside.py --bin RDMA_BENCH --out COST_JSON [--budget BUDGET_JSON]
                         [--short N] [--long N]

For each series of the 2-byte ping-pong (tests/bench/rdma_bench.cpp lat: two processes, one
round trip = one message each way, so one message sent and one received per side), it runs a
short and a long run and keeps the difference divided by the extra round trips and by the two
sides: what one more message costs one side, with the set-up cancelled out.

- instructions: user-space instructions (valgrind --tool=callgrind, both processes), the same
  total for the same binary and inputs whatever the host does. In events mode a side that
  waits sleeps in the kernel: the short and the long run's difference is the messages' cost.
  In busy mode a side that waits polls its CQ, as often as the host's timing lets it: each run
  reports its empty polls (rdma_bench's run_empty_polls, both sides), and a least-squares fit
  over four runs of different lengths, total = set-up + per message x messages + per empty poll
  x empty polls, separates what a message costs from what the spinning cost (busy_fit; the
  fit's residuals, a few hundred instructions of about ten million, are in cost.json). Hybrid
  also reads clocks while it spins and sleeps in between: not counted.
- syscalls: system calls by name (strace -f -c, both processes).

Series: events (ours, reading the CQ events through the ring, the default; ours_syscall, with
a poll of the channel's fd and ibv_get_cq_event; raw verbs with a blocking ibv_get_cq_event;
raw verbs waiting in a bare liburing poll first; perftest's ib_send_lat -e, system calls only),
busy (ours, co_await cq.next(); ours_poll, cq::try_next with io_context::yield between tries;
raw verbs; ib_send_lat), hybrid (ours; ours_syscall). Writes COST_JSON:
  {"mode": {"series": {"instructions": N|null, "syscalls": N, "by_name": {...}}}, "meta": {...},
   "budget": {...}, "over_budget": [...]}
and exits 1 when a run failed, 4 when ours exceeds a budget of BUDGET_JSON
({"mode": {"ours": {"instructions": N, "syscalls": N}}}), 77 without a device or valgrind/strace.
"""
import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "tests", "support"))
import harness  # noqa: E402  (tests/support/harness.py)

DEV = os.environ.get("RINGVERBS_DEVICE", "rxe0")
GID = os.environ.get("RINGVERBS_GID_INDEX", "1")
ADDR = os.environ.get("RINGVERBS_ADDR", "")
WORK = tempfile.mkdtemp(prefix="bench-cost.")


def say(text):
    print(f"bench-cost: {text}", file=sys.stderr, flush=True)


# mode -> series -> (program kind, extra arguments, whether instructions are counted)
def series(bin_path):
    ours = lambda *a: ("ours", [bin_path, "lat", "--timeout", "900", "--stats", "0", *a])
    return {
        "events": {
            "ours": (*ours("--mode", "events", "--event-read", "ring"), True),
            "ours_syscall": (*ours("--mode", "events", "--event-read", "syscall"), True),
            "raw_read": (*ours("--mode", "events", "--raw", "1"), True),
            "raw_uring": (*ours("--mode", "events", "--raw", "1", "--raw-wait", "uring"), True),
            "ib_send_lat_e": ("perftest", ["ib_send_lat", "-e", "-s", "2"], False),
        },
        "busy": {
            "ours": (*ours("--mode", "busy"), "fit"),
            "ours_poll": (*ours("--mode", "busy", "--recv", "poll"), "fit"),
            "raw": (*ours("--mode", "busy", "--raw", "1"), "fit"),
            "ib_send_lat": ("perftest", ["ib_send_lat", "-s", "2"], False),
        },
        "hybrid": {
            "ours": (*ours("--mode", "hybrid", "--event-read", "ring"), False),
            "ours_syscall": (*ours("--mode", "hybrid", "--event-read", "syscall"), False),
        },
    }


def run_ours(cmd, iters, wrapper, timeout):
    """Runs rdma_bench; returns its JSON report."""
    full = [*wrapper, *cmd, "--iters", str(iters), "--warmup", "100"]
    r = subprocess.run(full, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(full)}: exit {r.returncode}\n{r.stderr[-2000:]}")
    try:
        return json.loads(r.stdout)
    except ValueError as e:
        raise RuntimeError(f"{' '.join(full)}: no JSON report ({e})\n{r.stdout[-1000:]}") from e


PORTS = harness.Ports(18900)


def run_perftest(cmd, iters, wrapper_for, timeout):
    """perftest's server and client, each under its own wrapper (wrapper_for("server"|"client"))."""
    port = PORTS.next()
    args = [*cmd, "-d", DEV, "-x", GID, "-F", "-p", str(port), "-n", str(iters)]
    server = subprocess.Popen([*wrapper_for("server"), *args], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    # Its "Waiting for client" line may sit in a pipe buffer (under valgrind): ask the kernel.
    try:
        harness.wait_until(lambda: harness.listening(port), 20, f"{cmd[0]}'s server listening on {port}")
    except harness.Failure as e:
        server.kill()
        raise RuntimeError(str(e)) from e
    client = subprocess.run([*wrapper_for("client"), *args, ADDR], capture_output=True, text=True,
                            timeout=timeout)
    out, _ = server.communicate(timeout=timeout)
    if client.returncode != 0 or server.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: client exit {client.returncode}, server exit "
                           f"{server.returncode}\n{client.stdout[-1500:]}{out[-1500:]}")


def callgrind_total(kind, cmd, iters, report=None):
    """User-space instructions of both processes; rdma_bench's report into `report` (a dict)."""
    d = tempfile.mkdtemp(dir=WORK)
    wrap = lambda tag: ["valgrind", "--tool=callgrind", f"--callgrind-out-file={d}/{tag}.%p",
                        "--dump-instr=no", "--compress-strings=no"]
    if kind == "perftest":
        run_perftest(cmd, iters, wrap, 1800)
    else:
        out = run_ours(cmd, iters, wrap("run"), 1800)
        if report is not None:
            report.update(out)
    total = 0
    files = glob.glob(f"{d}/*")
    if len(files) < 2:
        raise RuntimeError(f"callgrind wrote {len(files)} profile(s), not one per process")
    for f in files:
        with open(f) as fh:
            counts = [int(m.group(1)) for m in (re.match(r"(?:summary|totals):\s+(\d+)", l) for l in fh) if m]
        if not counts or counts[0] <= 0:
            raise RuntimeError(f"{f}: no instruction total in the callgrind profile")
        total += counts[0]
    return total


def solve3(a, v):
    """x with a x = v (3x3, Cramer's rule)."""
    def det(m):
        return (m[0][0] * (m[1][1] * m[2][2] - m[1][2] * m[2][1])
                - m[0][1] * (m[1][0] * m[2][2] - m[1][2] * m[2][0])
                + m[0][2] * (m[1][0] * m[2][1] - m[1][1] * m[2][0]))
    d = det(a)
    if d == 0:
        raise RuntimeError("busy fit: the runs' lengths and empty polls are not independent")
    out = []
    for i in range(3):
        m = [row[:] for row in a]
        for r in range(3):
            m[r][i] = v[r]
        out.append(det(m) / d)
    return out


def busy_fit(cmd, lengths):
    """Busy mode: per message and side, and per empty poll, by least squares over the runs.

    When the runs cannot tell the two apart well (the per-message term's standard error over 2%
    of it: empty polls that grew almost in step with the round trips), four more runs of other
    lengths join the fit, once; still not, the count is None (and a budget check fails, saying
    so)."""
    rows = busy_runs(cmd, lengths)
    fit = fit_rows(rows)
    if fit["per_message_se"] > 0.02 * abs(fit["instructions"]):
        say(f"busy fit: standard error {fit['per_message_se']} of {fit['instructions']}: four more runs")
        rows += busy_runs(cmd, [n + (lengths[1] - lengths[0]) // 2 for n in lengths])
        fit = fit_rows(rows)
        if fit["per_message_se"] > 0.02 * abs(fit["instructions"]):
            say(f"busy fit: standard error {fit['per_message_se']} of {fit['instructions']}: not counted")
            fit["instructions"] = None
    return fit


def busy_runs(cmd, lengths):
    rows = []
    for iters in lengths:
        report = {}
        total = callgrind_total("ours", cmd, iters, report)
        try:
            empty = report["client"]["run_empty_polls"] + report["server"]["run_empty_polls"]
        except KeyError as e:
            raise RuntimeError(f"busy fit: rdma_bench reported no run_empty_polls ({e})") from e
        rows.append((1.0, float(iters), float(empty), float(total)))
    return rows


def fit_rows(rows):
    """total = set-up + per round trip x round trips + per empty poll x empty polls."""
    a = [[sum(r[i] * r[j] for r in rows) for j in range(3)] for i in range(3)]
    v = [sum(r[i] * r[3] for r in rows) for i in range(3)]
    setup, per_round_trip, per_empty = solve3(a, v)
    residuals = [r[3] - (setup + per_round_trip * r[1] + per_empty * r[2]) for r in rows]
    # The per-round-trip term's standard error: residual variance x (A^-1)[1][1].
    dof = len(rows) - 3
    variance = sum(x * x for x in residuals) / dof if dof > 0 else float("inf")
    inv11 = solve3(a, [0.0, 1.0, 0.0])[1]  # <= 0 only from rounding in a near-singular fit
    se = (variance * inv11) ** 0.5 / 2 if variance != float("inf") and inv11 > 0 else float("inf")
    return {"instructions": round(per_round_trip / 2),  # a round trip: one message per side
            "per_empty_poll": round(per_empty, 1),
            "per_message_se": round(se, 2),
            "fit": {"runs": [{"iters": int(r[1]), "empty_polls": int(r[2]), "instructions": int(r[3])}
                             for r in rows],
                    "residuals": [round(x) for x in residuals]}}


def strace_counts(kind, cmd, iters):
    d = tempfile.mkdtemp(dir=WORK)
    wrap = lambda tag: ["strace", "-f", "-c", "-U", "name,calls", "-o", f"{d}/{tag}"]
    if kind == "perftest":
        run_perftest(cmd, iters, wrap, 600)
    else:
        run_ours(cmd, iters, wrap("run"), 600)
    by_name = {}
    for f in glob.glob(f"{d}/*"):
        with open(f) as fh:
            for line in fh:
                m = re.match(r"\s*([a-z_0-9]+)\s+(\d+)\s*$", line)
                if m and m.group(1) not in ("syscall", "total"):
                    by_name[m.group(1)] = by_name.get(m.group(1), 0) + int(m.group(2))
    return by_name


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget")
    ap.add_argument("--short", type=int, default=100)
    ap.add_argument("--long", type=int, default=600)
    ap.add_argument("--modes", default="events,busy,hybrid")
    a = ap.parse_args()
    if not 0 < a.short < a.long:
        ap.error("--short and --long: 0 < short < long")
    if not (os.path.isdir("/sys/class/infiniband") and os.listdir("/sys/class/infiniband")):
        say("no RDMA device: SKIP")
        return 77
    for tool in ("valgrind", "strace"):
        if shutil.which(tool) is None:
            say(f"{tool} is missing: SKIP")
            return 77
    have_perftest = shutil.which("ib_send_lat") is not None and ADDR != ""
    extra = 2 * (a.long - a.short)  # messages sent, both sides together
    result = {"meta": {"device": DEV, "kernel": os.uname().release, "short": a.short, "long": a.long,
                       "unit": "per message and side (events: marginal between the short and the long run; "
                               "busy: the per-message term of a fit over runs of four lengths)"}}
    failed = False
    for mode, table in series(os.path.abspath(a.bin)).items():
        if mode not in a.modes.split(","):
            continue
        result[mode] = {}
        for name, (kind, cmd, count_instructions) in table.items():
            if kind == "perftest" and not have_perftest:
                say(f"{mode}/{name}: perftest or RINGVERBS_ADDR missing: not measured")
                continue
            t0 = time.monotonic()
            try:
                s0, s1 = strace_counts(kind, cmd, a.short), strace_counts(kind, cmd, a.long)
                by_name = {k: round((s1.get(k, 0) - s0.get(k, 0)) / extra, 3) for k in sorted(set(s0) | set(s1))}
                by_name = {k: v for k, v in by_name.items() if abs(v) >= 0.005}
                entry = {"syscalls": round(sum(by_name.values()), 3), "by_name": by_name,
                         "instructions": None}
                if count_instructions == "fit":
                    step = (a.long - a.short) / 3
                    entry.update(busy_fit(cmd, [round(a.short + k * step) for k in range(4)]))
                elif count_instructions:
                    i0, i1 = callgrind_total(kind, cmd, a.short), callgrind_total(kind, cmd, a.long)
                    entry["instructions"] = round((i1 - i0) / extra)
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                say(f"{mode}/{name}: FAILED: {e}")
                failed = True
                continue
            entry["seconds"] = round(time.monotonic() - t0, 1)
            result[mode][name] = entry
            say(f"{mode}/{name}: {entry['instructions']} instructions, {entry['syscalls']} system calls "
                f"{entry['by_name']} ({entry['seconds']} s)")
    over = []
    if a.budget:
        with open(a.budget) as f:
            budget = json.load(f)
        result["budget"] = budget
        for mode, per in budget.items():
            if mode.startswith("_") or mode not in a.modes.split(","):
                continue  # a comment, or a mode not measured in this run (--modes)
            for name, limits in per.items():
                got = result.get(mode, {}).get(name)
                for what, limit in limits.items():
                    if what.startswith("_"):
                        continue
                    value = got.get(what) if got else None
                    if value is None or value <= 0 or value > limit:  # missing or implausible: fail
                        over.append(f"{mode}/{name} {what}: {value} (budget {limit})")
        result["over_budget"] = over
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    for line in over:
        say(f"over budget: {line}")
    if failed:
        return 1
    return 4 if over else 0


if __name__ == "__main__":
    sys.exit(main())
