#!/usr/bin/env bash
# Creates, sets up, runs and tears down bertjax pretraining on a Cloud TPU VM slice with gcloud.
# Every worker of the slice runs the same `make pretrain`; bertjax.distributed finds the others
# through the TPU metadata server. See launch/README.md.
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: launch/tpu_vm.sh SUBCOMMAND [options]

Subcommands:
  create   create the TPU VM slice            (needs TPU_NAME, ZONE, ACCELERATOR_TYPE)
  setup    copy the repo to every worker and run `make install` there
  run      start `make pretrain` on every worker, detached (nohup), log in <dir>/logs/pretrain.log
  status   show the slice state and whether the job runs on each worker
  logs     follow worker 0's log (Ctrl-C stops following, not the job)
  stop     stop the job on every worker (SIGTERM to its process group, SIGKILL after 30 s)
  delete   delete the slice

Options (each also read from the environment variable in capitals, or given as KEY=VALUE
like CONFIG=configs/bert_base.py; the option wins over the environment):
  --tpu_name NAME           TPU_NAME          slice name
  --zone ZONE               ZONE              e.g. us-central2-b
  --project ID              PROJECT           default: gcloud's configured project
  --accelerator_type TYPE   ACCELERATOR_TYPE  e.g. v4-32, v5litepod-16, v5p-8, v6e-8
  --runtime_version V       RUNTIME_VERSION   default by type: v4 tpu-ubuntu2204-base,
                                              v5litepod v2-alpha-tpuv5-lite, v5p v2-alpha-tpuv5,
                                              v6e v2-alpha-tpuv6e
  --spot | --preemptible                      create a Spot / preemptible slice
  --repo PATH_OR_URL        REPO              default: this checkout (its tracked and untracked,
                                              not ignored files are copied); a git URL is cloned
  --remote_dir DIR          REMOTE_DIR        folder on the workers, relative to home (default bertjax)
  --config FILE             CONFIG            e.g. configs/bert_base.py (run)
  --workdir gs://...        WORKDIR           shared by all workers (run)
  --args "..."              ARGS              extra bertjax flags, e.g. "--config.train.steps=1000"
  --worker N                                  worker whose log `logs` follows (default 0)
  --lines N                                   lines of log history `logs` shows (default 100)
  --dry-run                                   print every command instead of running it
  -h, --help                                  this text

Example:
  export TPU_NAME=bert ZONE=us-central2-b ACCELERATOR_TYPE=v4-32
  launch/tpu_vm.sh create --spot && launch/tpu_vm.sh setup
  launch/tpu_vm.sh run --config configs/bert_base.py --workdir gs://my-bucket/bert_base
  launch/tpu_vm.sh logs; launch/tpu_vm.sh stop; launch/tpu_vm.sh delete
EOF
}

die() {
  echo "tpu_vm.sh: error: $*" >&2
  exit 2
}

# Quotes one word for a POSIX shell exactly as Python's shlex.quote does.
quote() {
  local word="$1" squote="'"
  if [[ -z $word ]]; then
    printf "''"
  elif [[ $word =~ ^[A-Za-z0-9_@%+=:,./-]+$ ]]; then
    printf '%s' "$word"
  else
    printf "'%s'" "${word//$squote/$squote\"$squote\"$squote}"
  fi
}

# Prints its arguments as one shell-quoted command line.
join_quoted() {
  local out="" word
  for word in "$@"; do
    out+="$(quote "$word") "
  done
  printf '%s\n' "${out% }"
}

run() {
  if [[ $dry_run == 1 ]]; then
    join_quoted "$@"
  else
    echo "+ $(join_quoted "$@")" >&2
    "$@"
  fi
}

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
tpu_name="${TPU_NAME:-}"
zone="${ZONE:-}"
project="${PROJECT:-}"
accelerator_type="${ACCELERATOR_TYPE:-}"
runtime_version="${RUNTIME_VERSION:-}"
repo="${REPO:-$repo_root}"
remote_dir="${REMOTE_DIR:-bertjax}"
config="${CONFIG:-}"
workdir="${WORKDIR:-}"
args="${ARGS:-}"
capacity=""
worker=0
lines=100
dry_run=0
subcommand=""

while [[ $# -gt 0 ]]; do
  option="$1"
  value=""
  has_value=0
  if [[ $option == --*=* ]]; then
    value="${option#*=}"
    option="${option%%=*}"
    has_value=1
  fi
  case "$option" in
    --tpu_name | --zone | --project | --accelerator_type | --runtime_version | --repo | \
      --remote_dir | --config | --workdir | --args | --worker | --lines)
      if [[ $has_value == 0 ]]; then
        [[ $# -ge 2 ]] || die "$option needs a value"
        # Only --args takes a value that looks like an option; use --args="..." to be safe.
        [[ $2 != -* || $option == --args ]] || die "$option needs a value, got option '$2'"
        value="$2"
        shift
      fi
      case "$option" in
        --tpu_name) tpu_name="$value" ;;
        --zone) zone="$value" ;;
        --project) project="$value" ;;
        --accelerator_type) accelerator_type="$value" ;;
        --runtime_version) runtime_version="$value" ;;
        --repo) repo="$value" ;;
        --remote_dir) remote_dir="$value" ;;
        --config) config="$value" ;;
        --workdir) workdir="$value" ;;
        --args) args="$value" ;;
        --worker) worker="$value" ;;
        --lines) lines="$value" ;;
      esac
      ;;
    --spot | --preemptible)
      [[ -z $capacity || $capacity == "$option" ]] || die "choose one of --spot and --preemptible"
      capacity="$option"
      ;;
    --dry-run | --dry_run) dry_run=1 ;;
    -h | --help)
      usage
      exit 0
      ;;
    -*) die "unknown option '$option' (see --help)" ;;
    TPU_NAME=* | ZONE=* | PROJECT=* | ACCELERATOR_TYPE=* | RUNTIME_VERSION=* | REPO=* | \
      REMOTE_DIR=* | CONFIG=* | WORKDIR=* | ARGS=*)
      # make-style KEY=VALUE, as in the README: the same as --key VALUE
      value="${option#*=}"
      case "${option%%=*}" in
        TPU_NAME) tpu_name="$value" ;;
        ZONE) zone="$value" ;;
        PROJECT) project="$value" ;;
        ACCELERATOR_TYPE) accelerator_type="$value" ;;
        RUNTIME_VERSION) runtime_version="$value" ;;
        REPO) repo="$value" ;;
        REMOTE_DIR) remote_dir="$value" ;;
        CONFIG) config="$value" ;;
        WORKDIR) workdir="$value" ;;
        ARGS) args="$value" ;;
      esac
      ;;
    *)
      [[ -z $subcommand ]] || die "unexpected argument '$option' after subcommand '$subcommand'"
      subcommand="$option"
      ;;
  esac
  shift
done

[[ -n $subcommand ]] || die "no subcommand; one of create setup run status logs stop delete (see --help)"
case "$subcommand" in
  create | setup | run | status | logs | stop | delete) ;;
  *) die "unknown subcommand '$subcommand'; one of create setup run status logs stop delete" ;;
esac

require() { # NAME VALUE REGEX HINT
  [[ -n $2 ]] || die "$1 is not set (use --$(tr '[:upper:]' '[:lower:]' <<<"$1") or $1=...)"
  [[ $2 =~ $3 ]] || die "$1='$2' is not valid ($4)"
}
require TPU_NAME "$tpu_name" '^[a-z]([-a-z0-9]*[a-z0-9])?$' "lowercase letters, digits and hyphens"
require ZONE "$zone" '^[a-z]+-[a-z]+[0-9]+-[a-z]$' "a zone such as us-central2-b"
if [[ -n $project && ! $project =~ ^[a-z][-a-z0-9.:]*[a-z0-9]$ ]]; then
  die "PROJECT='$project' is not a valid project id"
fi
[[ $remote_dir =~ ^[A-Za-z0-9_.][A-Za-z0-9_./-]*$ ]] ||
  die "REMOTE_DIR='$remote_dir' must be a plain relative path"
if [[ $dry_run == 0 ]] && ! command -v gcloud >/dev/null; then
  die "gcloud not found; install the Google Cloud CLI or use --dry-run"
fi

where=(--zone="$zone")
[[ -z $project ]] || where+=(--project="$project")
tpu=(gcloud compute tpus tpu-vm)
rdir="$(quote "$remote_dir")"
pid_file="$rdir/logs/pretrain.pid"
log_file="$rdir/logs/pretrain.log"

case "$subcommand" in
  create)
    require ACCELERATOR_TYPE "$accelerator_type" '^v[0-9]+[a-z]*-[0-9]+$' "e.g. v4-32, v5litepod-16"
    if [[ -z $runtime_version ]]; then
      case "$accelerator_type" in
        v4-*) runtime_version="tpu-ubuntu2204-base" ;;
        v5litepod-*) runtime_version=v2-alpha-tpuv5-lite ;;
        v5p-*) runtime_version=v2-alpha-tpuv5 ;;
        v6e-*) runtime_version=v2-alpha-tpuv6e ;;
        *) die "RUNTIME_VERSION is not set and there is no default for $accelerator_type" ;;
      esac
    fi
    cmd=("${tpu[@]}" create "$tpu_name" "${where[@]}" --accelerator-type="$accelerator_type")
    cmd+=(--version="$runtime_version")
    [[ -z $capacity ]] || cmd+=("$capacity")
    run "${cmd[@]}"
    ;;
  setup)
    if [[ $repo =~ ^(https://|http://|ssh://|git://|git@) ]]; then
      fetch="if [ -d $rdir/.git ]; then git -C $rdir pull --ff-only;"
      fetch+=" else git clone $(quote "$repo") $rdir; fi"
      run "${tpu[@]}" ssh "$tpu_name" "${where[@]}" --worker=all --command "$fetch"
    else
      git -C "$repo" rev-parse --is-inside-work-tree >/dev/null 2>&1 ||
        die "REPO='$repo' is neither a git URL nor a local git checkout"
      tarball="${TMPDIR:-/tmp}/bertjax-src-$tpu_name.tar.gz"
      pack="git -C $(quote "$repo") ls-files -z --cached --others --exclude-standard"
      pack+=" | tar --null --ignore-failed-read -czf $(quote "$tarball") -C $(quote "$repo") -T -"
      run bash -c "$pack"
      run "${tpu[@]}" scp "$tarball" "$tpu_name:bertjax-src.tar.gz" "${where[@]}" --worker=all
      unpack="mkdir -p $rdir && tar -xzf bertjax-src.tar.gz -C $rdir && rm bertjax-src.tar.gz"
      run "${tpu[@]}" ssh "$tpu_name" "${where[@]}" --worker=all --command "$unpack"
    fi
    run "${tpu[@]}" ssh "$tpu_name" "${where[@]}" --worker=all --command "cd $rdir && make install"
    ;;
  run)
    require CONFIG "$config" '^[^[:space:]]+$' "a path such as configs/bert_base.py"
    require WORKDIR "$workdir" '^gs://[^[:space:]]+$' "a gs:// path every worker can reach"
    make_cmd="make pretrain $(quote "CONFIG=$config") $(quote "WORKDIR=$workdir")"
    make_cmd+=" $(quote "ARGS=$args")"
    start="cd $rdir && mkdir -p logs || exit 1;"
    start+=" if [ -f logs/pretrain.pid ] && kill -0 \"\$(cat logs/pretrain.pid)\" 2>/dev/null;"
    start+=" then echo \"\$(hostname): a job is already running; use stop first\" >&2; exit 1; fi;"
    start+=" setsid nohup $make_cmd > logs/pretrain.log 2>&1 < /dev/null &"
    start+=" echo \$! > logs/pretrain.pid; echo \"\$(hostname): started pid \$!, log $log_file\""
    run "${tpu[@]}" ssh "$tpu_name" "${where[@]}" --worker=all --command "$start"
    ;;
  status)
    run "${tpu[@]}" describe "$tpu_name" "${where[@]}" --format "value(state,health,acceleratorType)"
    check="if [ -f $pid_file ] && kill -0 \"\$(cat $pid_file)\" 2>/dev/null;"
    check+=" then echo \"\$(hostname): running (pid \$(cat $pid_file))\";"
    check+=" else echo \"\$(hostname): not running\"; fi"
    run "${tpu[@]}" ssh "$tpu_name" "${where[@]}" --worker=all --command "$check"
    ;;
  logs)
    [[ $worker =~ ^[0-9]+$ ]] || die "--worker must be a worker number, got '$worker'"
    [[ $lines =~ ^[0-9]+$ ]] || die "--lines must be a number, got '$lines'"
    run "${tpu[@]}" ssh "$tpu_name" "${where[@]}" --worker="$worker" \
      --command "tail -n $lines -F $log_file"
    ;;
  stop)
    halt="if [ -f $pid_file ]; then pid=\$(cat $pid_file); kill -TERM -- -\$pid 2>/dev/null;"
    halt+=" for i in \$(seq 30); do kill -0 -- -\$pid 2>/dev/null || break; sleep 1; done;"
    halt+=" kill -KILL -- -\$pid 2>/dev/null; rm -f $pid_file; fi; echo \"\$(hostname): stopped\""
    run "${tpu[@]}" ssh "$tpu_name" "${where[@]}" --worker=all --command "$halt"
    ;;
  delete)
    run "${tpu[@]}" delete "$tpu_name" "${where[@]}" --quiet
    ;;
esac
