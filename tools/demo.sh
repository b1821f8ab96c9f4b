#!/usr/bin/env bash
# The ringverbs demo: the rdma_cm echo server and its client (examples/echo_server/,
# examples/echo_client.cpp). Installs what is missing first (as root on Debian 12), builds,
# and runs both where a real RDMA device exists: directly, or in one Soft-RoCE VM boot
# (tools/softroce-vm) when the host has none.
#
#   tools/demo.sh
#
# The client sends messages with SEND, the server sends each back with SEND, the client checks
# every byte: one connection in ping-pong (events mode), then 16 connections with 4 messages in
# flight each (hybrid mode). Prints messages and bytes verified, throughput, p50/p99 latency.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = --inside ]; then # where the device is
    addr=${RINGVERBS_ADDR:?RINGVERBS_ADDR: the device address}
    log=build/demo-server.log
    build/examples/echo_server --address "$addr" --port 18515 > "$log" 2>&1 &
    server=$!
    for _ in $(seq 100); do grep -q listening "$log" && break; sleep 0.1; done
    head -1 "$log"
    rc=0
    echo
    echo "--- 1 connection, ping-pong, 64-byte messages, events mode"
    build/examples/echo_client --address "$addr" --count 5000 --size 64 --mode events | sed 's/^echo_client: /  /' || rc=1
    echo
    echo "--- 16 connections, 4 messages in flight each, 1 KiB messages, hybrid mode"
    build/examples/echo_client --address "$addr" --clients 16 --inflight 4 --count 2000 --size 1024 --mode hybrid \
        | sed 's/^echo_client: /  /' || rc=1
    kill -TERM "$server"
    wait "$server" || rc=1
    echo
    tail -1 "$log"
    exit $rc
fi

# shellcheck source=SCRIPTDIR/lib/common.sh
. tools/lib/common.sh # ensure_build
bash tools/lib/install-deps.sh
ensure_build build debugoptimized examples/echo_server examples/echo_client
echo
echo "=== ringverbs demo: echo over RDMA (rdma_cm, RC SEND/RECV; Soft-RoCE VM when there is no device)"
rc=0
tools/softroce-vm -t 600 -- bash tools/demo.sh --inside || rc=$?
if [ "$rc" -eq 77 ]; then
    echo "demo: no RDMA device and no Soft-RoCE VM here: SKIPPED" >&2
fi
exit "$rc"
