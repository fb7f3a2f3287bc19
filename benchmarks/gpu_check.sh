#!/usr/bin/env bash
# jzero's checks for one lent GPU: one section per issue that asks for one, run one after the other.
#
#   host offload  benchmarks/gpu_check.py: ZeRO stage 2 in bf16 on a GPT of about 300 M
#                 parameters, without offload, with offload_optimizer (pinned_host) whole and
#                 streamed over sub-groups (through the device, and updated on the host:
#                 compute: host), and with the NVMe tier: device peak from
#                 memory_stats(), step-time ratios. $OUT/gpu_check.json
#   step time     benchmarks/gpu_step_time.py: the same GPT under ZeRO stages 0-3 against a
#                 hand-written plain JAX data-parallel step: ms/step, tokens/s, MFU, compile
#                 time, collective bytes, layout copies, peak memory. $OUT/gpu_step_time.json
#                 With two or more GPUs visible, then benchmarks/tensor_parallel.py: the GPT at
#                 stage 1 with AutoTP T=1 against T=2 (tensor_parallel.autotp_size, the global
#                 batch the same): model state and temp per device, collective bytes by mesh
#                 axis, ms/step. $OUT/gpu_tensor_parallel.json (skipped, and says so, on one GPU)
#                 Then benchmarks/pipeline.py: the GPT at stage 1 with pipeline.stages 1 and 2
#                 (1F1B, interleaved 1F1B with V = 2, zero-bubble; M = 4 micro-batches):
#                 bubble, model state and temp per device, bytes between stages, ms/step.
#                 $OUT/gpu_pipeline.json. On one GPU P = 1 only, and it says so.
#   memory wall   benchmarks/gpu_step_time.py --name memory_wall: the GPT at stage 3 as a scan,
#                 as a Python loop over layers, that loop with activation_checkpointing (policy
#                 full) and with cpu_checkpointing, the scan with policy full: device peak and
#                 step time. $OUT/gpu_memory_wall.json
#   long_context  benchmarks/long_sequence.py --gpu: attention in bf16 at 32K tokens through
#                 cuDNN's fused attention (jzero.blockwise_attention picks it on a GPU) and the
#                 blockwise XLA path (ms/call, peak); the GPT (4 layers, d_model 256, 2 heads)
#                 with blockwise attention, tiled loss and MLP, activation checkpointing and
#                 offload, and ring attention over every GPU, at 131,072 tokens: ms/step,
#                 tokens/s, device peak
#   comm          benchmarks/gpu_comm.py: the GPT at stage 3 with overlap_comm false/true,
#                 ZeRO++ qwZ, qgZ and all three: ms/step, MFU, collective bytes, how many
#                 collectives XLA runs asynchronously beside compute. $OUT/gpu_comm.json
#                 (last in the default order: JZERO_GPU_SECTIONS=comm runs it alone)
#
#   auto_layout   parallel sizes "auto": the layout the engine keeps within a budget, its step
#                 time and the next two candidates' (benchmarks/auto_layout.py; on one device
#                 only data parallelism exists, so a single GPU shows the stage choice alone)
#
#   bash benchmarks/gpu_check.sh [flags for every section, e.g. --layers 12]
#   JZERO_GPU_SECTIONS="step_time memory_wall" bash benchmarks/gpu_check.sh   # some sections
#
# The flags go to every section, so pass only those they share: --smoke, --layers, --d-model,
# --heads, --seq-len, --micro-batch, --steps, --warmup.
#
# It builds its own virtual environment (the repo's .venv is for CPU): python3 -m venv, then
# jzero with the pinned versions of constraints.txt and jax[cuda12] of the pinned jax version.
# JZERO_WHEELS=<folder> installs from wheels in that folder instead of a package index. Where no
# index is reachable and no wheels are given, it says so and runs on the python3 already on the
# machine (its own JAX, jzero from this source tree); each table prints the JAX version used.
#
# Time: the whole script finishes in under 8 minutes. The install is bounded to 150 s (on a
# machine with no package index it fails at once), the host offload section to 130 s, the
# step-time section to 120 s and the memory-wall section to 110 s (those two get --time-budget
# a little under that, so they stop their variants and still print their tables), the step
# time's T=1 vs T=2 row (several GPUs only) to 90 s, its pipeline row to 60 s, the long-context
# section to 75 s, the comm section to 120 s (no variant
# starts in its last 40 s), the auto layout section (last) to 60 s; each section
# is also cut to what is left of the overall limit. A section that fails or runs out of time says so and the
# next one runs; the exit status is non-zero when any section failed.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
overall=465  # seconds: 8 minutes less a margin for start-up and a last SIGKILL grace
venv="${JZERO_GPU_VENV:-/tmp/jzero-gpu-venv}"
sections="${JZERO_GPU_SECTIONS:-offload step_time memory_wall long_context comm auto_layout}"
jax_version="$(sed -n 's/^jax==//p' constraints.txt)"
source_opts=(--retries 1 --timeout 15)
if [[ -n "${JZERO_WHEELS:-}" ]]; then
  source_opts=(--no-index --find-links "$JZERO_WHEELS")
fi

install() {  # 150 s in all
  timeout 30 python3 -m venv "$venv" &&
    timeout $((150 - (SECONDS - start))) "$venv/bin/python" -m pip install -q --disable-pip-version-check \
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
timeout 60 "$py" -c 'import jax; d = jax.devices()[0]; print(f"gpu_check: jax {jax.__version__}, {jax.device_count()} x {d.platform} {d.device_kind}")' ||
  echo "gpu_check: could not list the devices (the sections will say why)"

failed=()
limit_for() {  # limit_for CAP: CAP seconds, or what is left of the overall limit when less
  local left=$((overall - (SECONDS - start)))
  echo $(($1 < left ? $1 : left))
}

run_section() {  # run_section NAME LIMIT COMMAND...: runs COMMAND for at most LIMIT seconds
  local name=$1 limit=$2 rc=0
  shift 2
  if ((limit < 30)); then
    echo "gpu_check: section '$name' not run: ${limit} s left of the ${overall} s limit"
    failed+=("$name")
    return
  fi
  echo
  echo "gpu_check: section '$name' (at most ${limit} s): $*"
  # timeout signals its whole process group, so per-variant child processes end with it.
  timeout --kill-after=10 "$limit" "$@" || rc=$?
  if ((rc == 124 || rc == 137)); then
    echo "gpu_check: section '$name' timed out after ${limit} s"
    failed+=("$name")
  elif ((rc != 0)); then
    echo "gpu_check: section '$name' failed with exit status $rc"
    failed+=("$name")
  else
    echo "gpu_check: section '$name' passed"
  fi
}

for section in $sections; do
  case "$section" in
    offload) run_section "host offload" "$(limit_for 130)" "$py" benchmarks/gpu_check.py "$@" ;;
    step_time)
      limit=$(limit_for 120)  # the script's own budget ends 15 s earlier: its table still prints
      run_section "step time" "$limit" \
        "$py" benchmarks/gpu_step_time.py --time-budget $((limit - 15)) "$@"
      # AutoTP T=1 vs T=2 needs two GPUs; with --smoke on a machine without any it runs on the
      # 8 virtual CPU devices tensor_parallel.py sets up (so the smoke run covers it too).
      read -r platform gpus < <(timeout 60 "$py" -c \
        'import jax; print(jax.devices()[0].platform, jax.device_count())' 2>/dev/null) || true
      [[ "${gpus:-}" =~ ^[0-9]+$ ]] || gpus=0
      smoke=0
      for arg in "$@"; do
        if [[ "$arg" == --smoke ]]; then smoke=1; fi
      done
      if [[ "${platform:-}" == cpu ]]; then  # only the smoke sizes are meant for CPU
        if ((smoke)); then gpus=8; else gpus=0; fi
      fi
      if ((gpus >= 2)); then
        run_section "step time T=1 vs T=2" "$(limit_for 90)" \
          "$py" benchmarks/tensor_parallel.py --tp 1,2 --sp 1 --stages 1 --layers 24 --d-model 1024 \
          --heads 16 --seq-len 512 --micro-batch 8 --steps 3 --warmup 1 \
          ${OUT:+--json "$OUT/gpu_tensor_parallel.json"} "$@"
      else
        echo "gpu_check: step time T=1 vs T=2 (tensor_parallel.autotp_size=2) skipped:" \
          "${gpus} GPU(s) visible, it needs at least 2"
      fi
      pipes=1
      if ((gpus >= 2)); then pipes=1,2; else
        echo "gpu_check: pipeline P=2 (pipeline.stages=2) skipped: ${gpus} GPU(s) visible, it" \
          "needs at least 2; P=1 only"
      fi
      run_section "step time pipeline P=${pipes}" "$(limit_for 60)" \
        "$py" benchmarks/pipeline.py --pipeline "$pipes" --micro 4 --layers 24 --d-model 1024 \
        --heads 16 --seq-len 512 --micro-batch 2 --steps 3 --warmup 1 \
        --schedules 1f1b,interleaved_1f1b,zero_bubble ${OUT:+--json "$OUT/gpu_pipeline.json"} "$@"
      ;;
    memory_wall)
      limit=$(limit_for 110)
      run_section "memory wall" "$limit" \
        "$py" benchmarks/gpu_step_time.py --name memory_wall --stages 3,3-unrolled,3-unrolled-ac,3-unrolled-ac-cpu,3-ac \
        --time-budget $((limit - 15)) "$@"
      ;;
    long_context)
      run_section "long context" "$(limit_for 75)" "$py" benchmarks/long_sequence.py --gpu \
        --steps 2 "$@"
      ;;
    comm)
      limit=$(limit_for 120)  # variants start until 40 s before the end: the table still prints
      run_section "comm" "$limit" "$py" benchmarks/gpu_comm.py --time-budget $((limit - 40)) "$@"
      ;;
    auto_layout)
      run_section "auto layout" "$(limit_for 60)" "$py" benchmarks/auto_layout.py "$@"
      ;;
    *)
      echo "gpu_check: unknown section '$section' in JZERO_GPU_SECTIONS (offload, step_time, memory_wall, long_context, comm, auto_layout)"
      failed+=("$section")
      ;;
  esac
done
echo
echo "gpu_check: done in $((SECONDS - start)) s"
if ((${#failed[@]})); then
  echo "gpu_check: failed sections: ${failed[*]}"
  exit 1
fi
