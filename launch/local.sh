#!/usr/bin/env bash
# Runs NPROC bertjax processes on this machine, each with its own simulated CPU devices, as a
# stand-in for NPROC hosts. See launch/README.md.
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: launch/local.sh NPROC [--devices_per_process N] -- <bertjax arguments>

Starts NPROC processes of `python -m bertjax.cli <bertjax arguments>` on this machine, each with
JAX_PLATFORMS=cpu and N simulated CPU devices (default 1), joined through bertjax.distributed
(BERTJAX_COORDINATOR=127.0.0.1:<free port>, BERTJAX_NUM_PROCESSES, BERTJAX_PROCESS_ID).
Waits for all of them. If one fails, the others are stopped and the script exits non-zero.

Environment:
  STOP_GRACE_S seconds between SIGTERM and SIGKILL when stopping processes (default 5)
  LOG_DIR      per-process logs process_K.log, appended to (default: WORKDIR/logs of the run's
               --workdir, else ./workdir/logs); process 0 also on console
  BERTJAX_CMD  command to run instead of "<repo>/.venv/bin/python -m bertjax.cli",
               split on spaces, e.g. BERTJAX_CMD="python tests/multihost_probe.py"

Example:
  launch/local.sh 2 --devices_per_process 4 -- pretrain --config=configs/demo.py --workdir=/tmp/w
EOF
}

die() {
  echo "local.sh: error: $*" >&2
  exit 2
}

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

[[ $# -ge 1 ]] || { usage >&2; exit 2; }
if [[ $1 == -h || $1 == --help ]]; then
  usage
  exit 0
fi
nproc="$1"
shift
[[ $nproc =~ ^[1-9][0-9]*$ ]] || die "NPROC must be a positive integer, got '$nproc'"
devices=1
while [[ $# -gt 0 ]]; do
  case "$1" in
    --devices_per_process)
      [[ $# -ge 2 ]] || die "--devices_per_process needs a value"
      devices="$2"
      shift 2
      ;;
    --devices_per_process=*)
      devices="${1#*=}"
      shift
      ;;
    --)
      shift
      break
      ;;
    -h | --help)
      usage
      exit 0
      ;;
    *) die "unknown option '$1' before '--' (see --help)" ;;
  esac
done
[[ $devices =~ ^[1-9][0-9]*$ ]] || die "--devices_per_process must be a positive integer, got '$devices'"
[[ $# -ge 1 || -n ${BERTJAX_CMD:-} ]] ||
  die "no bertjax command after '--' (e.g. -- pretrain --config=... --workdir=...)"

python="$repo_root/.venv/bin/python"
[[ -x $python ]] || python="$(command -v python3 || true)"
[[ -n $python ]] || die "no python: create $repo_root/.venv (make install) or put python3 on PATH"
if [[ -n ${BERTJAX_CMD:-} ]]; then
  read -r -a cmd <<<"$BERTJAX_CMD"
else
  cmd=("$python" -m bertjax.cli)
fi

# Logs go under the run's --workdir (a local one), so that runs do not share a log folder.
run_workdir=""
for ((i = 1; i <= $#; i++)); do
  arg="${!i}"
  if [[ $arg == --workdir=* ]]; then
    run_workdir="${arg#--workdir=}"
  elif [[ $arg == --workdir ]] && ((i < $#)); then
    next=$((i + 1))
    run_workdir="${!next}"
  fi
done
default_log_dir="workdir/logs"
[[ -n $run_workdir && $run_workdir != *://* ]] && default_log_dir="$run_workdir/logs"
log_dir="${LOG_DIR:-$default_log_dir}"
mkdir -p "$log_dir" || die "cannot create log folder '$log_dir'"
port="$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')" ||
  die "could not find a free port"

# Keep the caller's XLA_FLAGS except any device count, which this script sets.
xla_flags=""
for flag in ${XLA_FLAGS:-}; do
  [[ $flag == --xla_force_host_platform_device_count=* ]] || xla_flags+="$flag "
done
xla_flags+="--xla_force_host_platform_device_count=$devices"

# JAX turns SIGTERM into a preemption notice, so a process gets this long to stop before SIGKILL.
stop_grace_s="${STOP_GRACE_S:-5}"
[[ $stop_grace_s =~ ^[0-9]+$ ]] || die "STOP_GRACE_S must be a whole number of seconds, got '$stop_grace_s'"
pids=()
stop_all() {
  local pid
  for pid in "${pids[@]}"; do
    kill -TERM "$pid" 2>/dev/null || true
  done
  for _ in $(seq "$((stop_grace_s * 10))"); do
    local alive=0
    for pid in "${pids[@]}"; do
      if kill -0 "$pid" 2>/dev/null; then alive=1; fi
    done
    [[ $alive == 1 ]] || return 0
    sleep 0.1
  done
  for pid in "${pids[@]}"; do
    kill -KILL "$pid" 2>/dev/null || true
  done
}
trap 'echo "local.sh: interrupted; stopping all processes" >&2; stop_all; exit 130' INT TERM

echo "local.sh: $nproc processes x $devices CPU devices, coordinator 127.0.0.1:$port, logs in $log_dir"
for ((k = 0; k < nproc; k++)); do
  log="$log_dir/process_$k.log"
  launch_env=(
    JAX_PLATFORMS=cpu
    "XLA_FLAGS=$xla_flags"
    "BERTJAX_COORDINATOR=127.0.0.1:$port"
    "BERTJAX_NUM_PROCESSES=$nproc"
    "BERTJAX_PROCESS_ID=$k"
    PYTHONUNBUFFERED=1
  )
  if [[ $k == 0 ]]; then
    env "${launch_env[@]}" "${cmd[@]}" "$@" > >(tee -a "$log") 2>&1 &
  else
    env "${launch_env[@]}" "${cmd[@]}" "$@" >>"$log" 2>&1 &
  fi
  pids+=("$!")
  echo "local.sh: started process $k (pid $!), log $log"
done

describe_status() {
  local rc="$1"
  if ((rc > 128)); then
    echo "status $rc (killed by signal $(kill -l $((rc - 128)) 2>/dev/null || echo $((rc - 128))))"
  else
    echo "status $rc"
  fi
}

running=("${pids[@]}")
while [[ ${#running[@]} -gt 0 ]]; do
  still=()
  for pid in "${running[@]}"; do
    if kill -0 "$pid" 2>/dev/null; then
      still+=("$pid")
      continue
    fi
    rc=0
    wait "$pid" 2>/dev/null || rc=$?
    for ((k = 0; k < nproc; k++)); do
      [[ ${pids[k]} == "$pid" ]] && break
    done
    if [[ $rc != 0 ]]; then
      echo "local.sh: error: process $k (pid $pid) exited with $(describe_status "$rc");" \
        "stopping the other processes; see $log_dir/process_$k.log" >&2
      stop_all
      wait 2>/dev/null || true
      exit 1
    fi
  done
  running=("${still[@]+"${still[@]}"}")
  if [[ ${#running[@]} -gt 0 ]]; then sleep 0.2; fi
done
wait || true
echo "local.sh: all $nproc processes finished OK; logs in $log_dir"
