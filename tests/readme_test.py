#!/usr/bin/env python3
"""The README's code must be the examples that are built and run: the quick start
(examples/quick_start.cpp) and the rdma_cm server and client (examples/reverse_server.cpp,
reverse_client.cpp)."""
import pathlib
import sys

root = pathlib.Path(sys.argv[1])
readme = (root / "README.md").read_text()
start = readme.index("```cpp\n", readme.index("## Quick start")) + len("```cpp\n")
block = readme[start:readme.index("```\n", start)]
example = (root / "examples" / "quick_start.cpp").read_text()
body = example.split("\n", 1)[1]  # after the first comment line
if block != body:
    print("README quick start and examples/quick_start.cpp differ")
    sys.exit(1)
# The Layout section names every public header of each layer folder, and only those.
layout = readme[readme.index("## Layout"):]
layout = layout[:layout.index("\n## ", 1)]


def layout_entries(starts):
    """The Layout lines whose first word passes `starts`, continuation lines joined: {word: text}."""
    found, current = {}, None
    for line in layout.splitlines():
        if starts(line):
            current = line.split()[0]
            found[current] = line[len(current):]
        elif line.startswith(" ") and current is not None:
            found[current] += " " + line
        else:
            current = None
    return found


entries = layout_entries(lambda l: l.startswith("include/ringverbs/") and not l.startswith("include/ringverbs/*"))
problems = []
for folder, text in entries.items():
    if folder == "include/ringverbs/":
        continue
    words = set(w.strip(",.:;()") for w in text.split())
    headers = {p.stem for p in (root / folder).glob("*.hpp")}
    for h in sorted(headers - words):
        problems.append(f"README Layout: {folder} does not name {h}.hpp")
for folder in sorted({f"include/ringverbs/{p.name}/" for p in (root / "include" / "ringverbs").iterdir()
                      if p.is_dir()} - set(entries)):
    problems.append(f"README Layout: no line for {folder}")
top = {p.name for p in (root / "include" / "ringverbs").glob("*.hpp")}
for h in sorted(top):
    if h not in entries.get("include/ringverbs/", ""):
        problems.append(f"README Layout: include/ringverbs/ does not name {h}")
# The tools/ and examples/ lines name every file there (tools/lib/ as lib/NAME).
blocks = layout_entries(lambda l: l.startswith(("tools/ ", "examples/ ")))
for folder, prefix in (("tools/", ""), ("tools/lib/", "lib/"), ("examples/", "")):
    text = blocks.get(folder.split("/")[0] + "/", "")
    words = set(w.strip(",.:;()+") for w in text.split())
    for f in sorted((root / folder).iterdir()):
        if f.name in ("meson.build", "__pycache__", "lib") or f.name.startswith("."):
            continue
        name = prefix + f.name + ("/" if f.is_dir() else "")
        stem = prefix + f.stem if f.suffix == ".cpp" else None  # an example by its program
        if name not in words and name.rstrip("/") not in words and stem not in words:
            problems.append(f"README Layout: {folder.split('/')[0]}/ does not name {name}")
for p in problems:
    print(p)
if problems:
    sys.exit(1)
print(f"README Layout names every public header ({len(entries)} folders), every tool and example")
lines = [l for l in block.splitlines() if l.strip()]
print(f"quick start: {len(lines)} lines")
status = 0 if len(lines) <= 30 else 1
# The connection section: its first two cpp blocks are the server and the client.
at = readme.index("## Connections in a few lines")
for name in ("reverse_server", "reverse_client"):
    start = readme.index("```cpp\n", at) + len("```cpp\n")
    end = readme.index("```\n", start)
    block = readme[start:end]
    at = end + 4
    body = (root / "examples" / f"{name}.cpp").read_text().split("\n", 1)[1]
    if block != body:
        print(f"README connection section and examples/{name}.cpp differ")
        status = 1
    # User code: what is not an include, a using, a comment or a brace alone.
    code = [l for l in block.splitlines()
            if l.strip() and not l.startswith(("#include", "using ", "//")) and l.strip() not in ("}", "};")]
    print(f"{name}: {len(code)} lines of code")
    if len(code) > 35:
        status = 1
sys.exit(status)
