#!/usr/bin/env bash
# jzero's host-offload check for one lent GPU: ZeRO stage 2 in bf16 on a GPT of about 300 M
# parameters, with and without offload_optimizer (pinned_host); see benchmarks/gpu_check.py.
#
#   bash benchmarks/gpu_check.sh [gpu_check.py flags, e.g. --layers 12]
#
# It builds its own virtual environment (the repo's .venv is for CPU): python3 -m venv, then
# jzero with the pinned versions of constraints.txt and jax[cuda12] of the pinned jax version.
# JZERO_WHEELS=<folder> installs from wheels in that folder instead of a package index. Where no
# index is reachable and no wheels are given, it says so and runs on the python3 already on the
# machine (its own JAX, jzero from this source tree); the table prints the JAX version used.
# Writes $OUT/gpu_check.json when OUT is set. The whole check is bounded to under 6 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
venv="${JZERO_GPU_VENV:-/tmp/jzero-gpu-venv}"
jax_version="$(sed -n 's/^jax==//p' constraints.txt)"
source_opts=(--retries 1 --timeout 15)
if [[ -n "${JZERO_WHEELS:-}" ]]; then
  source_opts=(--no-index --find-links "$JZERO_WHEELS")
fi

install() {
  python3 -m venv "$venv" &&
    timeout 150 "$venv/bin/python" -m pip install -q --disable-pip-version-check \
      "${source_opts[@]}" -c constraints.txt -e . "jax[cuda12]==$jax_version"
}

if install; then
  py="$venv/bin/python"
  echo "gpu_check: jzero and jax[cuda12]==$jax_version installed into $venv"
else
  py=python3
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
  echo "gpu_check: could not install jax[cuda12]==$jax_version (no package index or wheels);"
  echo "gpu_check: running on $(command -v python3) with its own JAX and jzero from $PWD"
fi
"$py" -c 'import jax; d = jax.devices()[0]; print(f"gpu_check: jax {jax.__version__}, {d.platform} {d.device_kind}")'
left=$((350 - (SECONDS - start)))
exec timeout "$left" "$py" benchmarks/gpu_check.py "$@"
