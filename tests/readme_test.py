#!/usr/bin/env python3
"""The README's quick start must be examples/quick_start.cpp, which is built and run."""
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
lines = [l for l in block.splitlines() if l.strip()]
print(f"quick start: {len(lines)} lines")
sys.exit(0 if len(lines) <= 30 else 1)
