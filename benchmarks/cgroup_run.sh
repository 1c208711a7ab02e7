#!/usr/bin/env bash
# Run a command inside a memory cgroup of LIMIT bytes, as a container would hold it (cgroup v1 or v2; needs root).
# Usage: LIMIT=$((4<<30)) benchmarks/cgroup_run.sh python benchmarks/zero_infinity.py ...
# Prints the group's peak usage and whether the kernel hit the limit, then exits with the command's status.
set -u
LIMIT=${LIMIT:-$((4 << 30))}
if [ -f /sys/fs/cgroup/cgroup.controllers ]; then  # v2
    CG=/sys/fs/cgroup$(awk -F: '$1=="0"{print $3}' /proc/self/cgroup)/microspeed_run.$$
    mkdir -p "$CG" && echo "$LIMIT" > "$CG/memory.max" && echo $$ > "$CG/cgroup.procs"
    "$@"; rc=$?
    echo "cgroup v2 $CG: memory.max $(cat "$CG/memory.max"), peak $(cat "$CG/memory.peak" 2>/dev/null || echo n/a)," \
         "events: $(tr '\n' ' ' < "$CG/memory.events")"
    echo $$ > "$(dirname "$CG")/cgroup.procs" && rmdir "$CG"
else  # v1
    CG=/sys/fs/cgroup/memory$(awk -F: '$2=="memory"{print $3}' /proc/self/cgroup)/microspeed_run.$$
    mkdir -p "$CG" && echo "$LIMIT" > "$CG/memory.limit_in_bytes" && echo $$ > "$CG/cgroup.procs"
    "$@"; rc=$?
    echo "cgroup v1 $CG: limit $(cat "$CG/memory.limit_in_bytes"), max_usage $(cat "$CG/memory.max_usage_in_bytes")," \
         "failcnt $(cat "$CG/memory.failcnt"), $(grep oom_kill "$CG/memory.oom_control" | tr '\n' ' ')"
    echo $$ > "$(dirname "$CG")/cgroup.procs" && rmdir "$CG"
fi
exit $rc
