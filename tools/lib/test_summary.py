#!/usr/bin/env python3
"""tools/test.sh's closing lines: per suite run (the meson JSON logs in LOGS), then
"tests: N passed, N failed, N skipped", and the failures' last lines. Exits 1 on a failure.
Usage: test_summary.py LOGS"""
import json, os, re, sys
logs = sys.argv[1]
counts = {"passed": 0, "failed": 0, "skipped": 0}
failures = []
for name in sorted(os.listdir(logs)):
    if not name.endswith(".json"):
        continue
    per = {"passed": 0, "failed": 0, "skipped": 0}
    with open(os.path.join(logs, name)) as f:
        for line in f:
            r = json.loads(line)
            res = r.get("result")
            key = "passed" if res in ("OK", "EXPECTEDFAIL") else "skipped" if res == "SKIP" else "failed"
            per[key] += 1
            if key == "failed":
                failures.append((name[:-5], r.get("name", "?"), res,
                                 (r.get("stdout") or "") + (r.get("stderr") or "")))
    print(f"  {name[:-5]:<12} {per['passed']} passed, {per['failed']} failed, {per['skipped']} skipped")
    for k in counts:
        counts[k] += per[k]
skipped_suites = os.path.join(logs, "skipped-suites")
if os.path.exists(skipped_suites):
    print("  SKIPPED suites:", ", ".join(l.split()[1] for l in open(skipped_suites)))
steps = os.path.join(logs, "failed-steps")
if os.path.exists(steps):
    print("  FAILED steps:", "; ".join(l.strip() for l in open(steps)))
# The failures last, with the end of their output: a CI log is often read from its tail.
for suite, test, res, out in failures:
    print(f"\n--- FAILED {suite} / {test} ({res}); the last lines of its output:")
    lines = out.rstrip().splitlines()
    # Why a test died is often a stderr line (unbuffered) printed above the buffered report
    # that ends the output: a watchdog, std::terminate, a sanitizer, an assertion.
    why = re.compile(r"watchdog: '|terminate called|Sanitizer|runtime error:|Assertion|Aborted")
    early = [l for l in lines[:-25] if why.search(l)]
    if early:
        print("    (earlier lines that may say why:)")
        for l in early[-10:]:
            print("    " + l[:300])
    for l in lines[-25:]:
        print("    " + l[:300])
if failures:
    print()
print(f"tests: {counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped")
sys.exit(1 if counts["failed"] else 0)
