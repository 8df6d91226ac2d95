#!/usr/bin/env bash
# GPU check for one machine with one GPU (an H200 here): every figure jaxdist cannot measure
# on the CPU machine, in one command that ends in well under 8 minutes.
#
#   bash scripts/gpu_check.sh            # from the repository root; no network needed
#
#  1. JAX sees the GPU; this repository's pure-Python dependencies are present (installed
#     from a wheel folder, WHEELS=... or ./wheels or /opt/wheels, only where missing).
#  2. NVML: the real telemetry backend around ~3 s of bf16 matmuls (counter vs integral).
#  3. Memory: gpt-small bf16 under ddp (mesh 1): measured peak (memory_stats) vs the
#     compiler's allocation bound (goal: within 10%). fsdp on one device shards nothing
#     (the ddp program) and is refused; fsdp's bound is checked in step 7.
#  4. llama-1b bf16 (cuDNN attention, remat dots): mfu (model FLOPs) and hfu (compiled
#     FLOPs) (goal: mfu >= 50%).
#  5. --matmul-precision default vs highest on gpt-small float32: step time and mfu, each
#     against the peak of the precision it ran at (TF32 vs FP32).
#  6. JAX vs PyTorch on mlp-10m, float32, both at --matmul-precision highest (FP32 both
#     sides) — skipped with a message when torch is missing.
#  7. XLA:GPU with the device vs compiled without one (scripts/compare_compilers.py
#     --with-device): memory and collectives of both, the source of every plan's figures.
#  8. One table (scripts/gpu_table.py --check); exit 1 when a figure is missing.
#  (Between 6 and 7: a --layout ps run whose worker is on the GPU, and the PyTorch run of 6,
#  have a power block.)
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
WHEELS=${WHEELS:-}
OUT=${GPU_CHECK_DIR:-${OUT:-$(mktemp -d)}/gpu_check}
STEPS=${STEPS:-30}
mkdir -p "$OUT"
say() { printf '\n== %s\n' "$*"; }
die() { printf 'gpu_check: %s\n' "$*" >&2; exit 1; }

if [[ -z "$WHEELS" ]]; then
  for d in ./wheels ./.whl /opt/wheels; do
    if compgen -G "$d/*.whl" >/dev/null; then WHEELS=$d; break; fi
  done
fi
offline_install() {  # offline_install PIP_NAME...: from $WHEELS only
  [[ -n "$WHEELS" ]] || return 1
  "$PY" -m pip install -q --no-index --find-links "$WHEELS" "$@"
}

say "python and JAX"
"$PY" --version
"$PY" - <<'PYEOF' || die "JAX sees no GPU: check the CUDA plugin and the driver"
import jax
print("jax", jax.__version__, "backend", jax.default_backend(), jax.devices(),
      [d.device_kind for d in jax.devices()])
assert jax.default_backend() == "gpu"
PYEOF

say "pure-Python dependencies (only those missing)"
missing=()
for pair in flax:flax optax:optax chex:chex tensorboardX:tensorboardX pynvml:nvidia-ml-py \
            matplotlib:matplotlib tqdm:tqdm numpy:numpy orbax.checkpoint:orbax-checkpoint \
            grpc:grpcio sklearn:scikit-learn scipy:scipy; do
  "$PY" -c "import ${pair%%:*}" 2>/dev/null || missing+=("${pair#*:}")
done
if ((${#missing[@]})); then
  echo "missing: ${missing[*]}"
  offline_install "${missing[@]}" \
    || timeout 60 "$PY" -m pip install -q --retries 0 --timeout 10 "${missing[@]}" \
    || die "cannot install ${missing[*]} (no wheel folder has them and no network)"
else
  echo "all present"
fi

say "NVML smoke test (real backend, 50 ms sampling, ~3 s of bf16 matmuls)"
timeout 120 "$PY" - <<'PYEOF'
import json, time
import jax, jax.numpy as jnp
from jaxdist.telemetry import PowerConfig, create_monitor, memory_snapshot
x = jnp.ones((8192, 8192), jnp.bfloat16)
f = jax.jit(lambda a: (a @ a) * 1e-4)
f(x).block_until_ready()
mon = create_monitor(PowerConfig(), devices=jax.devices())
assert mon.available, mon.reason
with mon:
    time.sleep(0.3)
    mon.open_window()
    t = time.time()
    n = 0
    while time.time() - t < 3.0:
        f(x).block_until_ready(); n += 1
    mon.close_window()
r = mon.result(n, n, None)
g = r["gpus"][0]
print(json.dumps({k: r.get(k) for k in ("energy_j", "energy_source", "energy_counter_j",
                  "energy_integral_j", "avg_w", "peak_gpu_w")}, indent=1))
print("gpu:", {k: g.get(k) for k in ("name", "power_source", "samples")})
print("memory:", memory_snapshot(jax.devices(), mon))
c, i = r["energy_counter_j"], r["energy_integral_j"]
assert r["energy_j"] > 0 and c and i, "no energy measured"
print(f"counter vs integral: {c:.1f} J vs {i:.1f} J ({i / c - 1:+.1%})")
PYEOF

run() {  # run NAME ARGS...: one experiments.run into $OUT/NAME, its log beside it
  local name=$1; shift
  rm -rf "${OUT:?}/$name"
  echo "-- $name: $*"
  timeout "${RUN_TIMEOUT:-150}" "$PY" -m experiments.run --mesh 1 --warmup 3 \
      --steps "$STEPS" --logdir "$OUT/$name" --no-progress "$@" > "$OUT/$name.log" 2>&1 \
    || { echo "   failed (see $OUT/$name.log):"; tail -5 "$OUT/$name.log"; }
}

power_check() {  # power_check WHAT RUN_DIR LOG: the run's power block is its GPU's NVML one
  "$PY" - "$1" "$2" <<'PYEOF' || echo "   the $1 power check failed (see $3)"
import json, sys
what, run = sys.argv[1:3]
r = json.load(open(run + "/results.json"))
p = r["power"]
print(f"{what} device:", r["env"].get("device_kind"), "| power:",
      f"avg {p['avg_w']:.0f} W, {p['energy_per_sample_j']:.4g} J/sample" if p["available"]
      else p["reason"])
assert p["available"] and "cpu" not in str(r["env"].get("device_kind", "cpu")).lower()
PYEOF
}

say "memory: measured peak vs the compiler's bound (gpt-small bf16, batch 64)"
run mem-ddp --layout ddp --model gpt-small --dtype bfloat16 --batch-size 64

say "mfu / hfu: llama-1b bf16, cuDNN attention, remat dots, batch 8"
STEPS=12 run llama-1b --layout ddp --model llama-1b --model-opts attention=cudnn \
    --dtype bfloat16 --remat dots --batch-size 8 --power-sample-ms 100

say "--matmul-precision: gpt-small float32, default (TF32) vs highest (FP32)"
run prec-default --layout ddp --model gpt-small --dtype float32 --batch-size 64 \
    --matmul-precision default
run prec-highest --layout ddp --model gpt-small --dtype float32 --batch-size 64 \
    --matmul-precision highest

say "JAX vs PyTorch: mlp-10m float32, both at --matmul-precision highest"
run jax-mlp --layout ddp --model mlp-10m --dtype float32 --batch-size 256 \
    --matmul-precision highest
TORCH_RUN=""
if "$PY" -c "import torch; assert torch.cuda.is_available()" 2>/dev/null; then
  rm -rf "$OUT/torch-mlp"
  # JAX in the torch process only builds the shared initial weights: keep it off the GPU.
  JAX_PLATFORMS=cpu timeout 180 "$PY" -m experiments.torch_run --strategy ddp --nproc 1 \
      --device cuda --model mlp-10m --dtype float32 --batch-size 256 --warmup 3 \
      --steps "$STEPS" --matmul-precision highest --logdir "$OUT/torch-mlp" --no-progress \
      > "$OUT/torch-mlp.log" 2>&1 && TORCH_RUN="$OUT/torch-mlp" \
    || { echo "   torch run failed (see $OUT/torch-mlp.log):"; tail -5 "$OUT/torch-mlp.log"; }
  [[ -n "$TORCH_RUN" ]] && "$PY" -m experiments.compare "$OUT/jax-mlp" "$TORCH_RUN" || true
  # The rank samples its GPU with jaxdist.telemetry, as the JAX run does (issue 35 item 6).
  [[ -z "$TORCH_RUN" ]] || power_check "torch rank" "$TORCH_RUN" "$OUT/torch-mlp.log"
else
  echo "torch with CUDA is not installed here: the JAX vs PyTorch row is missing"
fi

say "parameter server: a worker on the GPU measures its power (mlp-10m sync, 1 worker, 1 shard)"
# Not in the table below: the check is that the worker ran on the GPU and that results.power
# is the worker's NVML block (jaxdist.telemetry.combine), not "unavailable".
run ps-mlp --layout ps --mesh 1x1 --ps-shards 1 --ps-mode sync --model mlp-10m \
    --dtype float32 --batch-size 256
power_check "ps worker" "$OUT/ps-mlp" "$OUT/ps-mlp.log"

say "XLA:GPU with the device vs without (gpt-tiny bf16 ddp, fsdp, tp_pp; llama-tiny cuDNN)"
# The figures every plan gives come from the device-less compile: they must match this GPU's.
timeout 240 "$PY" scripts/compare_compilers.py --with-device --layouts ddp,fsdp \
    --hardware "${GPU_PART:-h200}" 2>&1 | tee "$OUT/compilers.log" \
  || echo "   compiler comparison failed (see $OUT/compilers.log)"
timeout 120 "$PY" scripts/compare_compilers.py --with-device --layouts fsdp \
    --model llama-tiny --model-opts attention=cudnn --batch-size 8 \
    --hardware "${GPU_PART:-h200}" 2>&1 | tee -a "$OUT/compilers.log" || true

say "summary ($OUT)"
runs=()
for name in mem-ddp llama-1b prec-default prec-highest jax-mlp; do
  runs+=("$OUT/$name")
done
[[ -n "$TORCH_RUN" ]] && runs+=("$TORCH_RUN")
"$PY" scripts/gpu_table.py --check --expect-torch "${runs[@]}"
