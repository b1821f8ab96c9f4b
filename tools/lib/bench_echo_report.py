#!/usr/bin/env python3
"""tools/bench-echo's report: OUT.lines (one JSON object per run, from bench_echo_inside.py)
becomes OUT (echo.json) and a table.
Usage: bench_echo_report.py OUT"""
import json, sys
out = sys.argv[1]
runs = [json.loads(l) for l in open(out + ".lines")]
result = {"note": "echo_client vs echo_server, 64-byte SEND ping-pong, one VM boot; round trips in microseconds; "
                  "server peaks sampled every 0.2 s while the client ran (registered: MR bytes in restrack)",
          "runs": {r.pop("run"): r for r in runs}}
json.dump(result, open(out, "w"), indent=2)
print(f"{'run':<44} {'msg/s':>8} {'p50 us':>9} {'p99 us':>9} {'conn p99':>9} {'reg MiB':>8} {'RSS MiB':>8}  verified")
for k, r in result["runs"].items():
    if "error" in r:
        print(f"{k:<44} {r['error']}")
        continue
    print(f"{k:<44} {r['messages_per_s']:>8.0f} {r['p50_us']:>9.1f} {r['p99_us']:>9.1f} {r.get('connect_p99_ms', 0):>8.0f}ms"
          f" {r['server_registered_peak_bytes'] / 2**20:>8.1f} {r['server_rss_peak_bytes'] / 2**20:>8.1f}  {r['verified']}/{r['messages']}")
