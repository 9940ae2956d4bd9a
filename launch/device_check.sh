#!/usr/bin/env bash
# The accelerator check in one command (`make device-check`). See launch/README.md.
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: launch/device_check.sh [--dry] [--out DIR] [--budget_s N] [-- <device_check arguments>]

On a machine with an NVIDIA GPU or a TPU: makes a fresh Python environment with the platform's
JAX build, installs bertjax into it (with --no-deps), runs the tests marked `accelerator` and the
bf16 benchmarks, and writes DIR/device_report.json and DIR/device_report.md. Everything, the
install included, stops within --budget_s seconds; what did not fit is listed under "skipped".

The environment:
  - where this machine's python3 already has a JAX that sees the accelerator (an image with JAX,
    no network), that python with a private site folder in DEVICE_VENV holding bertjax and the
    wheels in $WHEELS that it lacks (`make device-wheels` downloads them on any machine with pip);
  - else a plain venv with `pip install -e .[cuda]` or `.[tpu]` (needs the package index).
--dry checks the test selection, the benchmark plan and the report's schema, on any machine.

Environment: PYTHON (default python3), WHEELS (default .whl), DEVICE_VENV (default
/tmp/bertjax-device-venv), OUT and BUDGET_S as the flags.
EOF
}

started=$(date +%s)
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=${OUT:-device_report}
budget=${BUDGET_S:-480}
dry=""
python=${PYTHON:-python3}
wheels=${WHEELS:-$repo/.whl}
venv=${DEVICE_VENV:-/tmp/bertjax-device-venv}
while (($#)); do
  case "$1" in
    --dry) dry=1 ;;
    --out) out=$2; shift ;;
    --budget_s) budget=$2; shift ;;
    -h|--help) usage; exit 0 ;;
    --) shift; break ;;
    *) echo "device_check.sh: error: unknown option '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done
case "$out" in /*) ;; *) out="$PWD/$out" ;; esac
mkdir -p "$out"

if [[ -n "$dry" ]]; then
  exec "$python" -m bertjax.tools.device_check --dry --out "$out" --budget_s "$budget" \
    --started "$started" "$@"
fi

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  platform=cuda
elif ls /dev/accel* /dev/vfio/[0-9]* >/dev/null 2>&1; then
  platform=tpu
else
  echo "device_check.sh: no NVIDIA GPU or TPU on this machine; use --dry" >&2
  exit 2
fi
echo "device_check.sh: platform $platform, budget ${budget} s, report in $out"

# Does this python already have a JAX that sees the accelerator?
has_jax=$("$python" - "$platform" <<'EOF' 2>/dev/null || true
import sys
import jax
want = {"cuda": "gpu", "tpu": "tpu"}[sys.argv[1]]
print("yes" if jax.default_backend() == want else "no")
EOF
)
rm -rf "$venv"
if [[ "$has_jax" == yes ]]; then
  # That python's own packages (its JAX build, torch, transformers) plus a private site folder
  # with bertjax and the carried wheels: nothing of that python is changed.
  run_python=$python
  site="$venv/site"
  mkdir -p "$site"
  if compgen -G "$wheels/*.whl" >/dev/null; then
    "$python" -m pip install -q --no-index --no-deps --no-compile --target "$site" "$wheels"/*.whl
  fi
  if ! "$python" -m pip install -q --no-deps --no-index --no-build-isolation --target "$site" \
      "$repo" >"$out/install.log" 2>&1; then
    echo "device_check.sh: pip could not install bertjax (see $out/install.log); using the checkout"
  fi
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
else
  "$python" -m venv "$venv"
  run_python="$venv/bin/python"
  "$run_python" -m pip install -q --upgrade pip
  "$run_python" -m pip install -q -e "$repo[$([[ $platform == tpu ]] && echo tpu || echo cuda),test]"
fi
echo "device_check.sh: environment ready after $(($(date +%s) - started)) s"
cd "$repo"
export BERTJAX_REPO="$repo"
exec "$run_python" -m bertjax.tools.device_check --out "$out" --budget_s "$budget" \
  --started "$started" "$@"
