# shellcheck shell=bash
# tools/lib/common.sh: what the benchmark scripts in tools/ share, sourced, never run:
#
#   here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)
#   . "$here/lib/common.sh"
#
# Inside tools/softroce-vm the project tree is shared at the same path, so a script's --inside
# part finds this file where its host part did. Defines functions only (and prog, below); sets
# no shell options and is safe under set -euo pipefail. Functions that end a script (skip,
# need_perftest, find_device) exit; the others return a status.

# The name in messages: the running script's (a script may set prog after sourcing this file).
prog=${0##*/}
common_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd -P) # the project's top directory

# say MESSAGE...: "PROG: MESSAGE" on stderr.
say() { printf '%s: %s\n' "$prog" "$*" >&2; }

# skip MESSAGE...: "PROG: SKIP: MESSAGE" on stderr, then exit 77 (a SKIP, never a pass).
skip() {
  say "SKIP: $*"
  exit 77
}

# header_text FIRST [LAST]: lines FIRST to LAST of the running script ($0) without their leading
# '# ', on stdout; without LAST, up to the line before the first `set -euo`. For usage().
header_text() {
  if [ -n "${2:-}" ]; then
    sed -n "$1,$2p" "$0" | sed 's/^# \{0,1\}//'
  else
    sed -n "$1,/^set -euo/p" "$0" | sed '$d; s/^# \{0,1\}//'
  fi
}

# isnum VALUE: true when VALUE is a number JSON can take as it is (sign, decimals, exponent);
# false for what perftest prints when it has none (-nan, inf) and for nothing.
isnum() { [[ ${1:-} =~ ^-?[0-9]+(\.[0-9]*)?([eE][-+]?[0-9]+)?$ ]]; }

# json_num VALUE: VALUE when isnum, else null, on stdout (no newline): for jq --argjson or JSON.
json_num() { if isnum "${1:-}"; then printf '%s' "$1"; else printf 'null'; fi; }

# json_or_null FILE: FILE's content when it is non-empty valid JSON, else null, on stdout.
json_or_null() { if [ -s "$1" ] && jq -e . "$1" >/dev/null 2>&1; then cat "$1"; else echo null; fi; }

# abs_path PATH: PATH made absolute against the current directory (not resolved), on stdout.
abs_path() { case $1 in /*) printf '%s\n' "$1" ;; *) printf '%s\n' "$PWD/$1" ;; esac; }

# loadavg: this machine's 1-minute load average, on stdout.
loadavg() { cut -d' ' -f1 /proc/loadavg; }

# stamp_host_load FILE PATH START: when FILE is not empty, sets PATH.host_load_start to START
# and PATH.host_load_end to the load now in the JSON object in FILE (PATH: a jq path such as
# .setup, or '' for the top level). A jq failure leaves FILE as it was (and returns 0).
stamp_host_load() {
  [ -s "$1" ] || return 0
  if jq --argjson l "$(loadavg)" --argjson s "$3" "$2.host_load_start = \$s | $2.host_load_end = \$l" \
    "$1" >"$1.tmp"; then
    mv "$1.tmp" "$1"
  fi
}

# ensure_build DIR BUILDTYPE TARGET...: configures DIR (relative: to the project's top) with
# meson --buildtype=BUILDTYPE unless it has a build.ninja already, then builds the TARGETs with
# ninja. meson's and ninja's output on stdout.
ensure_build() {
  local dir=$1 type=$2
  shift 2
  case $dir in /*) ;; *) dir=$common_root/$dir ;; esac
  if [ ! -f "$dir/build.ninja" ]; then
    (cd "$common_root" && meson setup "$dir" --buildtype="$type")
  fi
  ninja -C "$dir" "$@"
}

# run_in_vm SOFTROCE_VM_ARGS...: tools/softroce-vm with these arguments (e.g. -t 600 -- COMMAND
# ARGS...), run from the project's top so that the whole tree is shared with the guest at the
# same path. When it exits 125 (the VM died or could not set up the device) or 77 (a
# prerequisite is missing) and RINGVERBS_VM_FALLBACK names another softroce-vm harness, runs
# once more with that one. Returns the (last) exit status.
run_in_vm() {
  local rc=0
  (cd "$common_root" && "$common_root/tools/softroce-vm" "$@") || rc=$?
  if [ "$rc" = 125 ] || [ "$rc" = 77 ]; then
    if [ -n "${RINGVERBS_VM_FALLBACK:-}" ]; then
      say "tools/softroce-vm failed ($rc); trying $RINGVERBS_VM_FALLBACK"
      rc=0
      (cd "$common_root" && "$RINGVERBS_VM_FALLBACK" "$@") || rc=$?
    else
      say "tools/softroce-vm exited $rc (set RINGVERBS_VM_FALLBACK to another harness to retry with it)"
    fi
  fi
  return "$rc"
}

# need_perftest: skips (exit 77) unless perftest's ib_send_lat and ib_send_bw are installed.
need_perftest() {
  local t
  for t in ib_send_lat ib_send_bw; do
    command -v "$t" >/dev/null || skip "$t not found (apt-get install perftest)"
  done
}

# perftest_version [TOOL]: perftest's version as TOOL (default ib_send_lat) --version gives it,
# on stdout; empty when unknown.
perftest_version() { "${1:-ib_send_lat}" --version 2>&1 | awk '/Version/ { print $2; exit }'; }

# find_device: sets dev (RINGVERBS_DEVICE, else the first device in /sys/class/infiniband),
# addr (RINGVERBS_ADDR, default 198.18.0.1, tools/softroce-vm's) and gid (RINGVERBS_GID_INDEX,
# default 1); skips (exit 77) when there is no such device.
# shellcheck disable=SC2034 # addr, gid: for the caller
find_device() {
  local d
  dev=${RINGVERBS_DEVICE:-}
  if [ -z "$dev" ]; then
    for d in /sys/class/infiniband/*; do [ -e "$d" ] && { dev=${d##*/}; break; }; done
  fi
  if [ -z "$dev" ] || [ ! -d "/sys/class/infiniband/$dev" ]; then
    skip "no RDMA device here (run from the host, or under tools/softroce-vm)"
  fi
  addr=${RINGVERBS_ADDR:-198.18.0.1}
  gid=${RINGVERBS_GID_INDEX:-1}
}

# wait_listening PORT [SECONDS]: waits until a TCP socket listens on PORT (perftest's server
# opens its socket only after setting up the device), polling ss every 0.1 s for up to SECONDS
# (default 15); returns 1 if none did. Without ss, just waits a fifth of SECONDS and returns 0.
wait_listening() {
  local port=$1 tries=$((${2:-15} * 10)) i
  for i in $(seq "$tries"); do
    if command -v ss >/dev/null; then
      [ -n "$(ss -Htln "sport = :$port" 2>/dev/null)" ] && return 0
    elif [ "$i" -ge $((tries / 5)) ]; then
      return 0
    fi
    sleep 0.1
  done
  return 1
}

# report_line FILE: the line under perftest's "#bytes" header in FILE (its report), or nothing.
report_line() { awk '/^ *#bytes/ { getline; print; exit }' "$1"; }

# twice COMMAND...: runs COMMAND, once more if it failed; if both failed, sets failed=1. Returns 0.
twice() {
  "$@" && return 0
  say "retrying"
  "$@" && return 0
  # shellcheck disable=SC2034 # for the caller
  failed=1
  return 0
}
