# Sourced by build.sh and smoke.sh: flags that keep a container's limits
# within what this host lets a runtime set. An engine's defaults (1048576
# open files, podman's process limit) may be above this host's hard limits,
# and this kernel also refuses a process limit above kernel.pid_max; runc
# then fails every container ("error setting rlimit type 6/7: operation
# not permitted"). Appends to the array named by $1.
host_limits() {
  local -n flags=$1
  local nofile nproc pid_max
  nofile=$(ulimit -Hn)
  [ "$nofile" = unlimited ] || flags+=(--ulimit "nofile=$nofile:$nofile")
  nproc=$(ulimit -Hu)
  pid_max=$(cat /proc/sys/kernel/pid_max 2>/dev/null || echo 32768)
  if [ "$nproc" = unlimited ] || [ "$nproc" -gt "$pid_max" ]; then nproc=$pid_max; fi
  flags+=(--ulimit "nproc=$nproc:$nproc")
}

# podman on a host whose cgroups are not unified v2 (v1 or hybrid): crun
# refuses to run containers there, runc does not.
host_runtime() {
  local -n flags=$1
  [ "$(basename "$engine")" = podman ] || return 0
  local runtime=${RUNTIME:-}
  if [ -z "$runtime" ] && [ "$(stat -fc %T /sys/fs/cgroup)" != cgroup2fs ] && command -v runc >/dev/null; then
    runtime=runc
  fi
  [ -z "$runtime" ] || flags+=(--runtime "$runtime")
}
