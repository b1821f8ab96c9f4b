#!/bin/bash
# The guest's side of tools/softroce-vm: run by the initrd's init (tools/lib/softroce-vm/init)
# with the host's bash, chrooted into the host's root; sets up the device and runs the command.
# shellcheck disable=SC2154 # cmd, cwd, kver, ... come from the params file
set -u
R=/run/ringverbs
log() { local up _; read -r up _ </proc/uptime; echo "softroce-vm guest.sh [$up] $*"; }
fail() { log "$*"; echo "$*" >"$R/setup-error"; exit 125; }
# shellcheck source=/dev/null
source "$R/params"

C=/run/ringverbs-cluster
if [ "$node" != 0 ]; then
  # The cluster share tells node 1 when node 2 failed (its own ctl share is not visible there).
  fail() { log "$*"; echo "$*" >"$R/setup-error"; echo "node $node: $*" >"$C/setup-error.$node"; exit 125; }
fi
if [ "$node" = 0 ]; then
  log "rdma link add"
  addr=198.18.0.1 addr6=fd00::1
  rdma link add rxe0 type rxe netdev d0 || fail "could not create rxe0 on the dummy netdev d0"
  want4=0000:0000:0000:0000:0000:ffff:c612:0001 # ::ffff:198.18.0.1
  want6=fd00:0000:0000:0000:0000:0000:0000:0001
else
  addr=198.18.1.$node addr6=fd01::$node peer=$((3 - node))
  peer_addr=198.18.1.$peer peer_addr6=fd01::$peer
  log "eth0 $addr, rdma link add"
  { ip link set eth0 up && ip addr add "$addr/24" dev eth0 &&
      ip -6 addr add "$addr6/64" dev eth0 nodad; } || fail "could not set up eth0 (the link between the nodes)"
  rdma link add rxe0 type rxe netdev eth0 || fail "could not create rxe0 on eth0"
  want4=$(printf '0000:0000:0000:0000:0000:ffff:c612:01%02x' "$node")
  want6=$(printf 'fd01:0000:0000:0000:0000:0000:0000:%04x' "$node")
fi

# GIDs are filled in from netdev events: wait until the IPv4-mapped one is there and the port is
# ACTIVE, and take the indexes from sysfs rather than assuming them. The table has 1024 entries:
# read the first few, with builtins only.
port=/sys/class/infiniband/rxe0/ports/1
gid4="" gid6="" state=""
for _ in {1..100}; do
  for i in {0..15}; do
    read -r v <"$port/gids/$i" 2>/dev/null || continue
    [ "$v" = "$want4" ] && gid4=$i
    [ "$v" = "$want6" ] && gid6=$i
  done
  read -r state <"$port/state"
  [ -n "$gid4" ] && [ -n "$gid6" ] && [[ $state == *ACTIVE* ]] && break
  sleep 0.05
done
[ -n "$gid4" ] || fail "rxe0 has no GID for $addr"
[[ $state == *ACTIVE* ]] || fail "rxe0 port 1 is not ACTIVE ($state)"
log "rxe0 ready: GID index $gid4 = $addr, ${gid6:-none} = $addr6"
dev=rxe0 transport=roce
if [ "$provider" = siw ]; then
  # siw0 on d1 (made by the init); its single GID comes from d1's MAC address. The port turns
  # ACTIVE with the netdev, which is up already: no GID to wait for.
  log "rdma link add siw0"
  rdma link add siw0 type siw netdev d1 || fail "could not create siw0 on the dummy netdev d1"
  port=/sys/class/infiniband/siw0/ports/1
  state=""
  for _ in {1..100}; do
    read -r state <"$port/state"
    [[ $state == *ACTIVE* ]] && break
    sleep 0.05
  done
  [[ $state == *ACTIVE* ]] || fail "siw0 port 1 is not ACTIVE ($state)"
  dev=siw0 transport=iwarp addr=198.18.2.1 addr6=fd02::1 gid4=0 gid6=0
  log "siw0 ready: $addr, $addr6"
fi

# shellcheck source=/dev/null
source "$R/env"
export RINGVERBS_DEVICE=$dev RINGVERBS_ADDR=$addr RINGVERBS_ADDR6=$addr6 RINGVERBS_TRANSPORT=$transport
export RINGVERBS_GID_INDEX=$gid4 RINGVERBS_GID_INDEX6=$gid6 RINGVERBS_IN_VM=1 RINGVERBS_VM_ACCEL=$accel
export RINGVERBS_HOST_LOAD=$host_load RINGVERBS_HOST_CPUS=$host_cpus
if [ "$node" != 0 ]; then
  export RINGVERBS_NODE=$node RINGVERBS_NODES=2 RINGVERBS_PEER_ADDR=$peer_addr RINGVERBS_PEER_ADDR6=$peer_addr6
  export RINGVERBS_CLUSTER=$C
fi
# The host root is read-only here: send caches to the tmpfs when HOME cannot take them.
if [ -z "${HOME:-}" ] || [ ! -w "$HOME" ]; then export XDG_CACHE_HOME=/tmp/.cache; fi
if [ -n "${TMPDIR:-}" ] && { [ ! -d "$TMPDIR" ] || [ ! -w "$TMPDIR" ]; }; then export TMPDIR=/tmp; fi
ulimit -l unlimited
ulimit -Hn "$nofile_hard" 2>/dev/null
ulimit -Sn "$nofile_soft" 2>/dev/null
umask "$umask_host"
cd "$cwd" || fail "the working directory $cwd does not exist in the VM (share it with RINGVERBS_SHARE)"
if [ "$node" = 2 ]; then
  touch "$C/ready.2"
  log "node agent"
  exec </dev/null >>"$R/stdout" 2>>"$R/stderr"
  # shellcheck source=/dev/null
  source "$R/agent.sh"
  node_agent
fi
if [ "$node" = 1 ]; then
  # Node 2 must be up (its agent ready) before the command may use it.
  for _ in {1..1200}; do
    [ -f "$C/ready.2" ] && break
    [ -f "$C/setup-error.2" ] && fail "$(cat "$C/setup-error.2")"
    sleep 0.05
  done
  [ -f "$C/ready.2" ] || fail "node 2 did not come up within 60 s"
fi
# The start is claimed atomically (mkdir on the host's directory): the host's boot watchdog
# claims it too before it stops a guest that took too long, so that a command never starts in
# a guest about to be stopped, and one that started is never stopped by it (and never run again).
mkdir "$R/started" 2>/dev/null || fail "the host stopped waiting for this boot (RINGVERBS_VM_BOOT_LIMIT)"
read -r up _ </proc/uptime
echo "$up" >"$R/ready" || fail "could not write $R/ready"
log "running the command"

exec </dev/null >>"$R/stdout" 2>>"$R/stderr"
if [ "$node" = 0 ] && [ "$dev" = siw0 ]; then
  echo "softroce-vm: device siw0 (Soft-iWARP in QEMU, kernel $kver; rxe0 at 198.18.0.1 too), address $addr" >&2
elif [ "$node" = 0 ]; then
  echo "softroce-vm: device rxe0 (Soft-RoCE in QEMU, kernel $kver), address $addr" >&2
else
  echo "softroce-vm: node 1 of 2, device rxe0 on eth0 (Soft-RoCE in QEMU, kernel $kver), address $addr; node 2 at $peer_addr" >&2
fi
# A guest kernel oops in a system call kills only the calling thread: the process lives on,
# hangs, and says nothing of it. What the kernel logged while the command ran is shown; so is
# its line for a process killed by a fault ("segfault at ... in libX.so[base+size]"), which
# names the library and the faulting address when no core was kept.
dmesg -C 2>/dev/null # a throwaway guest: only what the command's run logs (a count would skew on wrap)
# Also followed into the control share as it comes: a command that hangs until the VM is
# killed never reaches the check below; the host reads $R/kmsg then (its TIMEOUT report).
dmesg -w >"$R/kmsg" 2>/dev/null &
kmsg_pid=$!
rc=0
# A program, as exec ran it: a name that is also a builtin or one of this script's functions
# (test, kill, log, fail) goes through env, which runs the program of that name.
case $(type -t -- "${cmd[0]}") in
  file | "") "${cmd[@]}" || rc=$? ;;
  *) env -- "${cmd[@]}" || rc=$? ;;
esac
kill "$kmsg_pid" 2>/dev/null
kmsg=$(dmesg 2>/dev/null)
# The same pattern as softroce-vm's TIMEOUT report.
first=$(grep -n -m1 -E 'Oops|BUG:|WARNING:|general protection|Call Trace|segfault at|traps:' <<<"$kmsg" | cut -d: -f1)
if [ -n "$first" ]; then
  echo "softroce-vm: the guest kernel reported a problem while the command ran (dmesg, from a little before the first):" >&2
  tail -n "+$((first > 10 ? first - 10 : 1))" <<<"$kmsg" | head -150 >&2
fi
exit "$rc"
