#!/usr/bin/env bash
# The ringverbs demo. Installs what is missing first (as root on Debian 12), builds, runs.
#
#   tools/demo.sh
#
# Today the demo is examples/tcp_echo: an echo server and clients as coroutines on one
# io_context over TCP on 127.0.0.1, every byte verified. The RDMA echo server and client
# (Soft-RoCE VM when the host has no device) replace it when the completion runtime lands.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/lib/install-deps.sh
if [ ! -f build/build.ninja ]; then
    meson setup build --buildtype=debugoptimized
fi
ninja -C build examples/tcp_echo
echo
build/examples/tcp_echo --clients 8 --messages 20000 --size 64
