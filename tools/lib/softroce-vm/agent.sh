#!/bin/bash
# Node 2's job agent for tools/softroce-vm -n 2 (sourced by guest.sh; see tools/on-node).
# shellcheck disable=SC2154 # C and node come from guest.sh, job_cwd and job_cmd from the job file
node_agent() {
  local J=$C/jobs f id
  while [ ! -f "$C/shutdown" ]; do
    for f in "$J/$node".*.job; do
      [ -f "$f" ] || continue
      id=${f%.job}
      mv "$f" "$id.taken" || continue
      (
        # shellcheck source=/dev/null
        source "$id.taken"
        cd "$job_cwd" || { echo "on-node: no directory $job_cwd on node $node" >"$id.err"; echo 125 >"$id.st"; mv "$id.st" "$id.status"; exit; }
        setsid "${job_cmd[@]}" </dev/null >>"$id.out" 2>>"$id.err" &
        echo $! >"$id.pid"
        wait $!
        echo $? >"$id.st"
        mv "$id.st" "$id.status"
      ) &
    done
    for f in "$J/$node".*.signal; do
      [ -f "$f" ] || continue
      id=${f%.signal}
      [ -f "$id.pid" ] && kill -s "$(cat "$f")" -- "-$(cat "$id.pid")" 2>/dev/null
      rm -f "$f"
    done
    sleep 0.05
  done
  exit 0
}
