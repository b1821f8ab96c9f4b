#!/usr/bin/env python3
"""The benchmark results as one HTML page with SVG plots (tools/bench-report runs it).

    bench_report.py RESULTS_DIR OUT_HTML

Reads RESULTS_DIR/rdma.json (tools/bench-rdma; required) and, when present, cost.json
(tools/bench-cost), echo.json (tools/bench-echo), cluster.json (tools/bench-cluster) and
scale.json; a missing one is skipped with a line saying so. Writes the plots as SVG files into plots/ next to OUT_HTML and the page,
which references them (relative paths: the directory can be copied as a whole).

Plots: the latency distributions (CDF of the half round trips, each series at its best round,
from rdma.json's latency_samples) of ours next to perftest for events, busy and hybrid; the
instructions and system calls per message and side of cost.json, with the budgets; the
per-round ratios ours / perftest with the goals; messages/s (and CPU per message when a file has
it) against the connection count; scale.json's message rate per QP count as grouped bars and its
CPU per message against connections. Tables: the headline numbers of each file.
"""
import html
import json
import os
import re
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

plt.rcParams.update(
    {
        "svg.fonttype": "none",  # text stays text: small files
        "svg.hashsalt": "ringverbs",  # the same data gives the same file
        "figure.figsize": (6.4, 4.0),
        "axes.grid": True,
        "grid.alpha": 0.3,
        "font.size": 9,
    }
)

RESULTS, OUT = sys.argv[1], sys.argv[2]
PLOTS = os.path.join(os.path.dirname(os.path.abspath(OUT)), "plots")
os.makedirs(PLOTS, exist_ok=True)

OURS_COLOR, PERFTEST_COLOR, RAW_COLOR = "tab:blue", "tab:orange", "tab:gray"


def say(msg):
    print(f"bench-report: {msg}", file=sys.stderr)


def load(name, required=False):
    path = os.path.join(RESULTS, name)
    if not os.path.exists(path):
        if not required:
            say(f"{name} not found in {RESULTS}: skipped")
        return None
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        say(f"{name} unreadable ({e}): skipped")
        return None


def num(x, digits=3):
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, (int, float)):
        if isinstance(x, int) or abs(x) >= 1000:
            return f"{x:,.0f}"
        return f"{x:.{digits + 1}g}" if abs(x) < 1 else f"{x:.{digits}f}".rstrip("0").rstrip(".")
    return str(x)


def table(headers, rows, cls=""):
    out = [f'<table class="{cls}"><tr>' + "".join(f"<th>{html.escape(h)}</th>" for h in headers) + "</tr>"]
    for r in rows:
        out.append("<tr>" + "".join(f"<td>{c if isinstance(c, Markup) else html.escape(num(c))}</td>" for c in r) + "</tr>")
    out.append("</table>")
    return "\n".join(out)


class Markup(str):
    """A table cell that is HTML already."""


def save(fig, name):
    path = os.path.join(PLOTS, name)
    fig.tight_layout()
    fig.savefig(path, format="svg", metadata={"Date": None})
    plt.close(fig)
    return f"plots/{name}"


def img(src, alt):
    return f'<figure><img src="{html.escape(src)}" alt="{html.escape(alt)}"><figcaption>{html.escape(alt)}</figcaption></figure>'


def g(d, *keys):
    """d[k0][k1]... or None."""
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


sections = []  # (title, html)
plots = []

# ------------------------------------------------------------------------------------------------
# rdma.json
# ------------------------------------------------------------------------------------------------
rdma = load("rdma.json", required=True)
if rdma is None:
    say(f"{os.path.join(RESULTS, 'rdma.json')} is missing or unreadable: run tools/bench-rdma first")
    sys.exit(77)

setup = rdma.get("setup", {})
parts = []
parts.append(
    "<p>"
    + html.escape(
        f"ringverbs vs perftest on {setup.get('device', '?')} ({setup.get('vm_accel') or 'host'}, "
        f"kernel {setup.get('kernel', '?')}, {setup.get('cpus', '?')} CPUs, clocksource "
        f"{setup.get('clocksource', '?')}), {setup.get('rounds', '?')} round(s), {setup.get('date', '?')}; "
        f"host load {setup.get('host_load_at_boot', '?')} at boot on {setup.get('host_cpus', '?')} CPUs "
        f"({rdma.get('host_load_start', '?')} to {rdma.get('host_load_end', '?')} over the run). "
        f"Each side at its best round (lowest latency, highest rate); ratio = ours / perftest."
    )
    + "</p>"
)

med = rdma.get("medians", {})
ratios = rdma.get("ratios", {})
goals = rdma.get("goals", {})


def goal_cell(key):
    gl = goals.get(key)
    if not gl:
        return ""
    bound = f"<= {gl['max']:.2f}" if "max" in gl else f">= {gl['min']:.2f}"
    ok = gl.get("met")
    return Markup(f'{html.escape(bound)} <span class="{"ok" if ok else "miss"}">{"ok" if ok else "missed"}</span>')


spin = rdma.get("hybrid_spin_us", "?")
spin_max = rdma.get("hybrid_spin_max_us", "?")
rows = [
    ("latency, events (us)", g(med, "ours", "lat_events_us", "best"), "ib_send_lat -e", g(med, "perftest", "ib_send_lat_e_us", "best"), "events_vs_ib_send_lat_e"),
    ("latency, events, syscall path (us)", g(med, "ours", "lat_events_syscall_us", "best"), "ib_send_lat -e", g(med, "perftest", "ib_send_lat_e_us", "best"), "events_syscall_vs_ib_send_lat_e"),
    ("latency, busy (us)", g(med, "ours", "lat_busy_us", "best"), "ib_send_lat", g(med, "perftest", "ib_send_lat_us", "best"), "busy_vs_ib_send_lat"),
    (f"latency, hybrid {spin} us (us)", g(med, "ours", "lat_hybrid_us", "best"), "ib_send_lat", g(med, "perftest", "ib_send_lat_us", "best"), "hybrid_vs_ib_send_lat"),
    ("latency, hybrid 50 us default (us)", g(med, "ours", "lat_hybrid_default_spin_us", "best"), "ib_send_lat", g(med, "perftest", "ib_send_lat_us", "best"), "hybrid_default_spin_vs_ib_send_lat"),
    (f"latency, hybrid 50..{spin_max} us adaptive (us)", g(med, "ours", "lat_hybrid_adaptive_us", "best"), "ib_send_lat", g(med, "perftest", "ib_send_lat_us", "best"), "hybrid_adaptive_vs_ib_send_lat"),
    ("raw verbs, events (us)", g(med, "raw_verbs", "lat_events_us", "best"), "ib_send_lat -e", g(med, "perftest", "ib_send_lat_e_us", "best"), "raw_events_vs_ib_send_lat_e"),
    ("raw verbs, events, waiting in a bare liburing loop (us)", g(med, "raw_verbs", "lat_events_uring_us", "best"), "ib_send_lat -e", g(med, "perftest", "ib_send_lat_e_us", "best"), None),
    ("raw verbs, busy (us)", g(med, "raw_verbs", "lat_busy_us", "best"), "ib_send_lat", g(med, "perftest", "ib_send_lat_us", "best"), "raw_busy_vs_ib_send_lat"),
    ("rate, busy (Mpps, 64 B)", g(med, "ours", "rate_busy_mpps", "best"), "ib_send_bw", g(med, "perftest", "ib_send_bw_mpps", "best"), "rate_vs_ib_send_bw"),
    ("rate, events (Mpps, 64 B)", g(med, "ours", "rate_events_mpps", "best"), "ib_send_bw -e", g(med, "perftest", "ib_send_bw_e_mpps", "best"), "rate_events_vs_ib_send_bw_e"),
]
parts.append("<h3>Headline</h3>")
parts.append(
    table(
        ["", "ours", "perftest", "", "ratio", "goal", "median-of-rounds ratio"],
        [(name, o, tool, p, g(ratios, key, "best"), goal_cell(key), g(ratios, key, "median_of_rounds")) for name, o, tool, p, key in rows],
    )
)
parts.append(
    "<p>"
    + html.escape(
        f"ours / raw verbs (the runtime's own cost): events {num(g(ratios, 'events_vs_raw_events', 'best'))}, "
        f"busy {num(g(ratios, 'busy_vs_raw_busy', 'best'))}; events split into the io_uring wait (raw liburing / "
        f"raw blocking read) {num(g(ratios, 'raw_uring_vs_raw_events', 'best'))} and the runtime over it "
        f"(ours / raw liburing) {num(g(ratios, 'events_vs_raw_uring_events', 'best'))}. Allocations in the timed parts: "
        f"{num(rdma.get('allocations'))} ({num(rdma.get('allocations_per_message'))} per message at most)."
    )
    + "</p>"
)

# Latency CDFs.
samples = g(rdma, "latency_samples", "series") or {}
cdf_modes = [
    ("events", [("lat_events", "ours (events)", OURS_COLOR, "-"), ("lat_events_syscall", "ours (events, syscall path)", OURS_COLOR, "--"), ("pt_lat_e", "ib_send_lat -e", PERFTEST_COLOR, "-"), ("raw_events", "raw verbs (events)", RAW_COLOR, "--"), ("raw_uring_events", "raw verbs, liburing wait", RAW_COLOR, ":")]),
    ("busy", [("lat_busy", "ours (busy)", OURS_COLOR, "-"), ("pt_lat", "ib_send_lat", PERFTEST_COLOR, "-"), ("raw_busy", "raw verbs (busy)", RAW_COLOR, "--")]),
    ("hybrid", [("lat_hybrid", f"ours (hybrid, {spin} us spin)", OURS_COLOR, "-"), ("pt_lat", "ib_send_lat (busy)", PERFTEST_COLOR, "-")]),
]
cdf_figs = []
if not samples:
    parts.append("<p>No latency samples in rdma.json (an older tools/bench-rdma): no distributions.</p>")
    say("rdma.json has no latency_samples: no latency distributions")
else:
    for mode, series in cdf_modes:
        present = [s for s in series if s[0] in samples and samples[s[0]].get("quantiles")]
        if not present:
            say(f"no latency samples for {mode}: no distribution plotted")
            continue
        fig, ax = plt.subplots()
        for key, label, color, style in present:
            q = samples[key]["quantiles"]
            k = len(q)
            y = [i / (k - 1) if k > 1 else 1.0 for i in range(k)]
            median = q[min(k - 1, int(0.5 * (k - 1) + 0.5))]  # rdma_bench's percentile()
            ax.step(q, y, where="post", color=color, linestyle=style,
                    label=f"{label}: median {median:g} us, n={samples[key].get('count', k)}, round {samples[key].get('round', '?')}")
        ax.set_xscale("log")
        ax.set_ylim(0, 1.0)
        ax.axhline(0.5, color="black", linewidth=0.5, alpha=0.5)
        ax.set_xlabel("half round trip (us, log scale)")
        ax.set_ylabel("fraction of samples <= x")
        ax.set_title(f"latency distribution, {mode} (each at its best round)")
        ax.legend(loc="lower right", fontsize=7)
        cdf_figs.append(img(save(fig, f"lat_cdf_{mode}.svg"), f"Latency CDF, {mode}: ours vs perftest"))
    if cdf_figs:
        parts.append("<h3>Latency distributions</h3>")
        parts.append('<div class="row">' + "".join(cdf_figs) + "</div>")
        qrows = []
        for key in ("lat_events", "lat_events_syscall", "pt_lat_e", "raw_events", "raw_uring_events", "lat_busy", "pt_lat", "raw_busy", "lat_hybrid"):
            s = samples.get(key)
            if not s or not s.get("quantiles"):
                continue
            q = s["quantiles"]
            at = lambda p: q[min(len(q) - 1, int(p * (len(q) - 1) + 0.5))]  # noqa: E731
            qrows.append((key, s.get("round"), s.get("count"), q[0], at(0.5), at(0.9), at(0.99), q[-1]))
        parts.append(table(["series", "round", "samples", "min", "p50", "p90", "p99", "max"], qrows))

# Per-round ratios.
prr = rdma.get("per_round_ratios") or []
if prr:
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    rounds = [r.get("round") for r in prr]
    for key, label, marker in (
        ("events_vs_ib_send_lat_e", "events / ib_send_lat -e", "o"),
        ("events_syscall_vs_ib_send_lat_e", "events, syscall path / ib_send_lat -e", "x"),
        ("busy_vs_ib_send_lat", "busy / ib_send_lat", "s"),
        ("hybrid_vs_ib_send_lat", f"hybrid {spin} us / ib_send_lat", "^"),
        ("hybrid_adaptive_vs_ib_send_lat", "hybrid adaptive / ib_send_lat", "v"),
    ):
        pts = [(r, x.get(key)) for r, x in zip(rounds, prr) if x.get(key) is not None]
        if pts:
            ax1.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, label=label)
    ax1.axhline(1.10, color="green", linestyle="--", linewidth=1, label="goal 1.10 (events, busy)")
    ax1.axhline(1.25, color="red", linestyle="--", linewidth=1, label="goal 1.25 (hybrid)")
    ax1.axhline(1.0, color="black", linewidth=0.5)
    lo, hi = ax1.get_ylim()
    ax1.set_ylim(min(lo, 0.9), max(hi, 1.35))
    ax1.set_xlabel("round")
    ax1.set_ylabel("ours / perftest (lower is better)")
    ax1.set_title("latency ratio per round")
    ax1.set_xticks(rounds)
    ax1.legend(fontsize=7)
    for key, label, marker in (
        ("rate_vs_ib_send_bw", "busy / ib_send_bw", "o"),
        ("rate_events_vs_ib_send_bw_e", "events / ib_send_bw -e", "s"),
    ):
        pts = [(r, x.get(key)) for r, x in zip(rounds, prr) if x.get(key) is not None]
        if pts:
            ax2.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, label=label)
    ax2.axhline(0.90, color="green", linestyle="--", linewidth=1, label="goal 0.90")
    ax2.axhline(1.0, color="black", linewidth=0.5)
    ax2.set_xlabel("round")
    ax2.set_ylabel("ours / perftest (higher is better)")
    ax2.set_title("message-rate ratio per round")
    ax2.set_xticks(rounds)
    ax2.legend(fontsize=7)
    parts.append("<h3>Per-round ratios</h3>")
    parts.append(img(save(fig, "ratios_per_round.svg"), "ours / perftest per round, per mode, with the goals"))
    keys = ["events_vs_ib_send_lat_e", "events_syscall_vs_ib_send_lat_e", "busy_vs_ib_send_lat", "hybrid_vs_ib_send_lat", "hybrid_default_spin_vs_ib_send_lat",
            "hybrid_adaptive_vs_ib_send_lat", "events_vs_raw_events", "busy_vs_raw_busy", "rate_vs_ib_send_bw", "rate_events_vs_ib_send_bw_e"]
    parts.append(table(["round"] + [k.replace("_vs_", " / ") for k in keys], [[x.get("round")] + [x.get(k) for k in keys] for x in prr], "small"))

pm = rdma.get("per_message") or {}
if pm:
    cols = ["client_wakeups", "server_wakeups", "client_sleeps", "server_sleeps", "client_arms", "server_arms",
            "client_polls", "server_polls", "client_completions", "server_completions"]
    parts.append("<h3>Per message (medians over rounds)</h3>")
    parts.append(table(["run"] + [c.replace("_", " ") for c in cols], [[k] + [v.get(c) for c in cols] for k, v in pm.items()], "small"))

txt = os.path.join(RESULTS, "rdma.txt")
if os.path.exists(txt):
    with open(txt) as f:
        parts.append("<details><summary>rdma.txt</summary><pre>" + html.escape(f.read()) + "</pre></details>")
sections.append(("RDMA: ringverbs vs perftest (rdma.json)", "\n".join(parts)))

# ------------------------------------------------------------------------------------------------
# cost.json (tools/bench-cost): instructions and system calls per message and side, counted
# ------------------------------------------------------------------------------------------------
cost = load("cost.json")
if cost is not None:
    parts = []
    meta = cost.get("meta") or {}
    budget = cost.get("budget") or {}
    parts.append(
        "<p>"
        + html.escape(
            f"Counted, not timed (the same on any host): user-space instructions (callgrind, both processes) "
            f"and system calls (strace -c -f) per message and side of the 2-byte ping-pong on "
            f"{meta.get('device', '?')}, kernel {meta.get('kernel', '?')}; events: the {meta.get('long', '?')}-run "
            f"minus the {meta.get('short', '?')}-run; busy: a fit over four runs that takes the spinning out "
            f"(README, Benchmarks). Over budget: {', '.join(cost.get('over_budget') or []) or 'nothing'}."
        )
        + "</p>"
    )
    rows = []  # (label, mode, series)
    for mode in ("events", "busy", "hybrid"):
        for name in (cost.get(mode) or {}):
            rows.append((f"{mode}/{name}", mode, name))
    counted = [(label, cost[mode][name]["instructions"], g(budget, mode, name, "instructions"))
               for label, mode, name in rows if g(cost, mode, name, "instructions")]
    calls = [(label, cost[mode][name].get("by_name") or {}) for label, mode, name in rows
             if g(cost, mode, name, "syscalls") is not None]
    if counted or calls:
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
        if counted:
            labels = [c[0] for c in counted]
            colors = [OURS_COLOR if "/ours" in c[0] else RAW_COLOR for c in counted]
            ax1.barh(labels, [c[1] for c in counted], color=colors)
            for i, c in enumerate(counted):
                ax1.text(c[1], i, f" {c[1]:,}", va="center", fontsize=7)
                if c[2]:
                    ax1.plot([c[2], c[2]], [i - 0.4, i + 0.4], color="red", linewidth=1.5,
                             label="budget" if i == next(j for j, d in enumerate(counted) if d[2]) else None)
            # Issue 23's goals: ours at most 500 over the raw blocking loop (events), 200 over the
            # raw busy loop (busy).
            goals = {"events/ours": (g(cost, "events", "raw_read", "instructions"), 500),
                     "events/ours_syscall": (g(cost, "events", "raw_read", "instructions"), 500),
                     "busy/ours": (g(cost, "busy", "raw", "instructions"), 200)}
            first_goal = True
            for i, c in enumerate(counted):
                raw, over = goals.get(c[0], (None, 0))
                if raw:
                    ax1.plot([raw + over] * 2, [i - 0.4, i + 0.4], color="green", linestyle="--",
                             linewidth=1.5, label="goal (raw + 500 events, + 200 busy)" if first_goal else None)
                    first_goal = False
            ax1.invert_yaxis()
            ax1.set_xlabel("user-space instructions per message and side")
            ax1.set_title("instructions (lower is better)")
            ax1.legend(fontsize=7, loc="lower right")
        if calls:
            names = sorted({k for _, by in calls for k in by})
            left = [0.0] * len(calls)
            for k in names:
                vals = [by.get(k, 0.0) for _, by in calls]
                ax2.barh([c[0] for c in calls], vals, left=left, label=k)
                left = [a + b for a, b in zip(left, vals)]
            ax2.invert_yaxis()
            ax2.set_xlabel("system calls per message and side")
            ax2.set_title("system calls by name")
            ax2.legend(fontsize=7, loc="center right", bbox_to_anchor=(1.0, 0.4))
        parts.append(img(save(fig, "cost_per_message.svg"),
                         "Instructions and system calls per message and side (tools/bench-cost), with the budgets"))
    parts.append(
        table(
            ["series", "instructions", "budget", "per empty poll (busy)", "system calls", "by name"],
            [(label, g(cost, mode, name, "instructions"), g(budget, mode, name, "instructions"),
              g(cost, mode, name, "per_empty_poll"), g(cost, mode, name, "syscalls"),
              ", ".join(f"{k} {v:g}" for k, v in (g(cost, mode, name, "by_name") or {}).items()))
             for label, mode, name in rows],
        )
    )
    sections.append(("Cost per message, counted (cost.json)", "\n".join(parts)))

# ------------------------------------------------------------------------------------------------
# echo.json: messages/s (and CPU per message, when there) against the connection count
# ------------------------------------------------------------------------------------------------
echo = load("echo.json")
if echo is not None:
    runs = echo.get("runs") or {}
    parts = ["<p>" + html.escape(echo.get("note", "")) + "</p>"]
    groups = {}  # series name (the run name without its connection count) -> [(clients, run)]
    for name, r in runs.items():
        if not isinstance(r, dict) or "error" in r or r.get("clients") is None:
            continue
        series = re.sub(r"_?\d+_clients", "", name).strip("_") or name
        groups.setdefault(series, []).append((r["clients"], r))
    cpu_key = None
    for r in runs.values():
        if isinstance(r, dict):
            cpu_key = cpu_key or next((k for k in r if "cpu" in k and isinstance(r[k], (int, float))), None)
    if groups:
        n = 2 if cpu_key else 1
        fig, axes = plt.subplots(1, n, figsize=(6.4 * n, 4.2), squeeze=False)
        ax = axes[0][0]
        for series, pts in sorted(groups.items()):
            pts.sort(key=lambda p: p[0])
            ax.plot([p[0] for p in pts], [p[1].get("messages_per_s") for p in pts], marker="o", label=series)
        ax.set_xscale("log")
        ax.set_xlabel("connections (log scale)")
        ax.set_ylabel("messages/s")
        ax.set_title("echo: messages/s against connections")
        ax.legend(fontsize=6)
        if cpu_key:
            ax = axes[0][1]
            for series, pts in sorted(groups.items()):
                ys = [(p[0], p[1].get(cpu_key)) for p in pts if p[1].get(cpu_key) is not None]
                if ys:
                    ax.plot([y[0] for y in ys], [y[1] for y in ys], marker="o", label=series)
            ax.set_xscale("log")
            ax.set_xlabel("connections (log scale)")
            ax.set_ylabel(cpu_key)
            ax.set_title("echo: CPU per message against connections")
            ax.legend(fontsize=6)
        parts.append(img(save(fig, "echo_rate.svg"), "echo: messages/s" + (" and CPU per message" if cpu_key else "") + " against connections"))
    cols = ["clients", "mode", "inflight", "messages", "verified", "messages_per_s", "p50_us", "p99_us", "p999_us",
            "connect_p99_ms", "server_rss_peak_bytes", "server_registered_peak_bytes"] + ([cpu_key] if cpu_key else [])
    rows = []
    for name, r in runs.items():
        if not isinstance(r, dict):
            continue
        if "error" in r:
            rows.append([name, Markup(f'<span class="miss">{html.escape(str(r["error"]))}</span>')] + [""] * (len(cols) - 1))
            continue
        row = [name]
        for c in cols:
            v = r.get(c)
            if c.endswith("_bytes") and isinstance(v, (int, float)):
                v = f"{v / 1048576:.1f} MiB"
            row.append(v)
        rows.append(row)
    parts.append(table(["run"] + [c.replace("_", " ") for c in cols], rows, "small"))
    sections.append(("Echo server (echo.json)", "\n".join(parts)))

# ------------------------------------------------------------------------------------------------
# cluster.json: two guests, ratios
# ------------------------------------------------------------------------------------------------
cluster = load("cluster.json")
if cluster is not None:
    parts = ["<p>" + html.escape(f"{cluster.get('note', '')} ({cluster.get('rounds', '?')} rounds, host load {cluster.get('host_load', '?')})") + "</p>"]
    cr = cluster.get("ratios") or {}
    parts.append(
        table(
            ["", "ours", "perftest", "ratio", "per round"],
            [(k, v.get("ours"), v.get("perftest"), v.get("ratio"), ", ".join(num(x) for x in v.get("per_round") or [])) for k, v in cr.items()],
        )
    )
    if cr:
        fig, ax = plt.subplots()
        for k, v in cr.items():
            pr = v.get("per_round") or []
            pts = [(i + 1, x) for i, x in enumerate(pr) if x is not None]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=k)
        ax.axhline(1.0, color="black", linewidth=0.5)
        ax.set_xlabel("round")
        ax.set_ylabel("ours / perftest")
        ax.set_title("two guests: ratio per round (latency: lower is better, rate: higher)")
        ax.legend(fontsize=7)
        parts.append(img(save(fig, "cluster_ratios.svg"), "two guests: ours / perftest per round"))
    sections.append(("Across two guests (cluster.json)", "\n".join(parts)))

# ------------------------------------------------------------------------------------------------
# scale.json: rate per QP count (grouped bars), CPU per message against connections
# ------------------------------------------------------------------------------------------------
scale = load("scale.json")
if scale is not None:
    parts = []
    rq = [r for r in scale.get("rate_qps") or [] if isinstance(r, dict)]
    if rq:
        rq.sort(key=lambda r: (r.get("mode", ""), r.get("cq", ""), r.get("qps", 0)))
        labels = [f"{r.get('qps')} QPs\n{r.get('mode')}, {r.get('cq')}" for r in rq]
        x = list(range(len(rq)))
        w = 0.4
        fig, ax = plt.subplots(figsize=(max(6.4, 0.9 * len(rq) + 2), 4.2))
        ax.bar([i - w / 2 for i in x], [r.get("ours_mpps") or 0 for r in rq], w, label="ours", color=OURS_COLOR)
        ax.bar([i + w / 2 for i in x], [r.get("perftest_mpps") or 0 for r in rq], w, label="perftest", color=PERFTEST_COLOR)
        ax.set_xticks(x)
        ax.set_xticklabels(labels, fontsize=7)
        ax.set_ylabel("Mpps")
        ax.set_title("message rate against QP count (ours vs perftest)")
        ax.legend()
        parts.append(img(save(fig, "scale_rate_qps.svg"), "message rate per QP count, mode and CQ sharing"))
        parts.append(table(["QPs", "mode", "CQ", "ours Mpps", "perftest Mpps", "ratio"],
                           [(r.get("qps"), r.get("mode"), r.get("cq"), r.get("ours_mpps"), r.get("perftest_mpps"),
                             (r["ours_mpps"] / r["perftest_mpps"]) if r.get("ours_mpps") is not None and r.get("perftest_mpps") else None)
                            for r in rq]))
    cpm = sorted((r for r in scale.get("cpu_per_message") or [] if isinstance(r, dict) and r.get("connections")),
                 key=lambda r: r["connections"])
    if cpm:
        fig, ax = plt.subplots()
        for key, label, color in (("ours_us", "ours", OURS_COLOR), ("perftest_us", "perftest", PERFTEST_COLOR)):
            pts = [(r["connections"], r.get(key)) for r in cpm if r.get(key) is not None]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label, color=color)
        ax.set_xscale("log")
        ax.set_xlabel("connections (log scale)")
        ax.set_ylabel("CPU us per message")
        ax.set_title("CPU per message against connections")
        ax.legend()
        parts.append(img(save(fig, "scale_cpu_per_message.svg"), "CPU per message against connections"))
        parts.append(table(["connections", "ours us", "perftest us"], [(r["connections"], r.get("ours_us"), r.get("perftest_us")) for r in cpm]))
    mc = scale.get("many_cqs")
    if isinstance(mc, dict):
        parts.append("<h3>Many CQs</h3>")
        parts.append(table(list(mc.keys()), [list(mc.values())]))
    if not parts:
        parts.append("<p>scale.json has none of rate_qps, cpu_per_message, many_cqs.</p>")
    sections.append(("Scale (scale.json)", "\n".join(parts)))

# ------------------------------------------------------------------------------------------------
# The page
# ------------------------------------------------------------------------------------------------
style = """
body { font-family: sans-serif; max-width: 1400px; margin: 1em auto; padding: 0 1em; color: #222; }
h2 { border-bottom: 1px solid #ccc; margin-top: 1.6em; }
table { border-collapse: collapse; margin: 0.6em 0; }
th, td { border: 1px solid #ddd; padding: 2px 8px; text-align: right; font-size: 0.9em; }
th { background: #f3f3f3; }
td:first-child, th:first-child { text-align: left; }
table.small td, table.small th { font-size: 0.78em; }
.ok { color: #1a7f37; font-weight: bold; }
.miss { color: #c62828; font-weight: bold; }
.row { display: flex; flex-wrap: wrap; gap: 1em; }
figure { margin: 0.5em 0; }
figure img { max-width: 100%; border: 1px solid #eee; }
figcaption { font-size: 0.8em; color: #555; }
nav a { margin-right: 1em; }
"""
body = []
body.append("<h1>ringverbs benchmarks</h1>")
body.append("<nav>" + "".join(f'<a href="#s{i}">{html.escape(t)}</a>' for i, (t, _) in enumerate(sections)) + "</nav>")
for i, (title, content) in enumerate(sections):
    body.append(f'<h2 id="s{i}">{html.escape(title)}</h2>\n{content}')
page = (
    '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>ringverbs benchmarks</title>'
    f"<style>{style}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n"
)
tmp = OUT + ".tmp"
with open(tmp, "w") as f:
    f.write(page)
os.replace(tmp, OUT)
n_svg = page.count('src="plots/')
print(f"bench-report: wrote {OUT} ({n_svg} plots in {PLOTS})")
