#!/usr/bin/env bash
# The ringverbs demo. Installs what is missing first (as root on Debian 12), builds, runs.
#
#   tools/demo.sh
#
# 1. examples/tcp_echo on the host: an echo server and clients as coroutines on one
#    io_context over TCP on 127.0.0.1, every byte verified (the engine alone).
# 2. examples/rdma_pingpong where a real RDMA device exists (tools/softroce-vm: directly, or
#    Soft-RoCE in a QEMU VM when the host has none): two RC queue pairs exchange messages,
#    every send and receive a co_await resumed by its own completion, in the events and
#    hybrid polling modes.
# (The rdma_cm echo server and client replace step 2 when they land.)
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/lib/install-deps.sh
if [ ! -f build/build.ninja ]; then
    meson setup build --buildtype=debugoptimized
fi
ninja -C build examples/tcp_echo examples/rdma_pingpong
echo
echo "=== engine: TCP echo on 127.0.0.1"
build/examples/tcp_echo --clients 8 --messages 20000 --size 64
echo
echo "=== RDMA: ping-pong over RC queue pairs (Soft-RoCE VM when there is no device)"
rc=0
tools/softroce-vm -t 600 -- sh -c '
    build/examples/rdma_pingpong --mode events --messages 5000 --size 64 &&
    build/examples/rdma_pingpong --mode hybrid --messages 5000 --size 64' || rc=$?
if [ "$rc" -eq 77 ]; then
    echo "demo: no RDMA device and no Soft-RoCE VM here: the RDMA part was SKIPPED" >&2
fi
exit "$rc"
