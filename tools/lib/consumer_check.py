#!/usr/bin/env python3
"""tools/consumer-test's check of a subproject build: only the consumers and ringverbs' three
libraries were built, no tests or install rules came along, and our warning flags reached our
sources but not the consumer's.
Usage: consumer_check.py INTROSPECT.json COMPILE_COMMANDS.json"""
import json, sys

intro = json.load(open(sys.argv[1]))
problems = []
targets = sorted(t["name"] for t in intro["targets"])
want = ["consumer", "consumer_engine", "ringverbs-cm", "ringverbs-engine", "ringverbs-rdma"]
if targets != want:
    problems.append(f"targets are {targets}, not the consumers and ringverbs' three libraries")
if intro["tests"]:
    problems.append(f"tests came along: {[t['name'] for t in intro['tests']]}")
if intro["installed"]:
    problems.append(f"install rules came along: {sorted(intro['installed'].values())}")

ours = ("-Wextra", "-Wpedantic")
main_seen = lib_seen = 0
for c in json.load(open(sys.argv[2])):
    args = c["command"].split()
    f = c["file"]
    if f.endswith("subproject-src/main.cpp"):
        main_seen += 1
        if "-std=c++20" not in args:
            problems.append(f"main.cpp is not compiled with -std=c++20: {c['command']}")
        leaked = [a for a in args if a in ours]
        if leaked:
            problems.append(f"our warning flags reach the consumer's main.cpp: {leaked}")
    elif "subprojects/ringverbs/src/" in f:
        lib_seen += 1
        missing = [a for a in ours + ("-std=c++20", "-Werror") if a not in args]
        if missing:
            problems.append(f"ringverbs' {f} lacks {missing}")
if main_seen != 1 or lib_seen == 0:
    problems.append(f"compile_commands.json: {main_seen} main.cpp, {lib_seen} ringverbs sources")
for p in problems:
    print("consumer-test: FAIL:", p, file=sys.stderr)
if problems:
    sys.exit(1)
print(f"consumer-test: only the consumers + ringverbs' three libraries built, no tests/install rules; main.cpp: "
      f"-std=c++20 without {', '.join(ours)}; {lib_seen} ringverbs sources with them and -Werror")
