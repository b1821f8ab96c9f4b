#!/bin/bash
# install-deps.sh: make sure the Debian 12 packages that ringverbs needs are installed.
#
#   tools/lib/install-deps.sh [--check] [PACKAGE...]
#   . tools/lib/install-deps.sh     (checks/installs the whole list; returns instead of exiting;
#                                    then ringverbs_install_deps [--check] [PACKAGE...] is defined)
#
# With no PACKAGE, the whole list below: building (meson, compilers, liburing, rdma-core headers,
# doctest), the Soft-RoCE VM of tools/softroce-vm, and the RDMA tools (perftest). Not in the list:
# what `tools/softroce-vm -p siw` needs to build siw.ko (linux-source-6.1, the guest kernel's
# linux-headers-<kver>, make): tools/lib/build-siw.sh installs those through this script when
# it first builds it, since the headers' name follows the guest kernel.
# Fast path: when dpkg says everything is installed, nothing else runs (no apt, no network).
# Otherwise, as root: one `apt-get update`, then one
# `apt-get install -y --no-install-recommends` of the missing ones. Not root, or --check: names
# the missing packages and the command to install them, and fails (status 1).
#
# On --no-install-recommends and QEMU: qemu-system-x86 only recommends qemu-system-gui (displays,
# audio), qemu-utils, ovmf and qemu-block-extra (network block drivers); none of them is needed
# here: -virtfs (9p) is built into the qemu-system-x86_64 binary, and TCG comes from
# qemu-system-common, a hard dependency. tools/softroce-vm runs with -display none.

ringverbs_deps=(
  # build and test
  meson ninja-build g++ clang clang-format pkg-config python3 cmake
  liburing-dev libibverbs-dev librdmacm-dev doctest-dev
  # a test's process that does not end is shown with its threads' backtraces before it is
  # killed (tests/support/harness.py, Server.stop): in CI too, inside the guest
  gdb
  # the Soft-RoCE VM (tools/softroce-vm)
  qemu-system-x86 busybox-static cpio kmod iproute2 rdma-core ibverbs-providers xz-utils
  # RDMA tools: ibv_devinfo, rping, perftest (tools/perftest-reference)
  ibverbs-utils rdmacm-utils perftest
)

ringverbs_install_deps() {
  local check_only=0 p missing=() wanted=()
  for p in "$@"; do
    case $p in
      --check) check_only=1 ;;
      -h | --help)
        sed -n '2,21p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
        return 0
        ;;
      *) wanted+=("$p") ;;
    esac
  done
  [ ${#wanted[@]} -gt 0 ] || wanted=("${ringverbs_deps[@]}")

  # One dpkg-query for all. "install ok installed" only: a removed package can still be listed
  # as "deinstall ok config-files"; one never installed is not listed at all.
  local installed
  installed=$(dpkg-query -W -f='${Package} ${Status}\n' "${wanted[@]}" 2>/dev/null |
    awk '$2 == "install" && $4 == "installed" { print $1 }' || true)
  for p in "${wanted[@]}"; do
    grep -qxF -- "$p" <<<"$installed" || missing+=("$p")
  done
  [ ${#missing[@]} -gt 0 ] || return 0

  local cmd="apt-get update && apt-get install -y --no-install-recommends ${missing[*]}"
  if [ "$check_only" = 1 ] || [ "$(id -u)" != 0 ]; then
    echo "install-deps: missing Debian packages: ${missing[*]}" >&2
    echo "install-deps: install them as root with: $cmd" >&2
    return 1
  fi
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "install-deps: missing ${missing[*]}, and this is no Debian system (no apt-get)" >&2
    return 1
  fi
  echo "install-deps: installing ${missing[*]}" >&2
  # Never stop to ask: CI has no standard input.
  DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2 || {
    echo "install-deps: apt-get update failed" >&2
    return 1
  }
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2 || {
    echo "install-deps: apt-get install failed; the command was: $cmd" >&2
    return 1
  }
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  set -euo pipefail
  ringverbs_install_deps "$@"
  exit $?
else
  # Sourced: "$@" would be the sourcing script's own arguments, so take none.
  ringverbs_install_deps
fi
