#!/usr/bin/env bash
# GPU check: one command on a GPU machine without network, from the repository root.
#
#   bash scripts/gpu_check.sh            # TARGET_S=30 seconds of timed steps per layout
#
# 1. Finds the JAX already installed (or installs it from a wheel folder, never the network).
# 2. Installs this repository's pure-Python dependencies only where missing.
# 3. NVML smoke test: the real telemetry backend around ~3 s of matmuls.
# 4. A short ddp run to time a step, then ddp and fsdp runs of ~TARGET_S s each
#    (gpt-small, bf16, batch 64, one GPU); total well under 5 minutes.
# 5. Prints one table (layout, step p50, samples/s, MFU, measured vs estimated memory,
#    avg W, J/sample, samples/(s*MJ)) and fails unless power and memory were measured.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
WHEELS=${WHEELS:-}            # a folder of .whl files; default: ./wheels or /opt/wheels
TARGET_S=${TARGET_S:-30}
OUT=${GPU_CHECK_DIR:-${OUT:-$(mktemp -d)}/gpu_check}
mkdir -p "$OUT"
say() { printf '\n== %s\n' "$*"; }
die() { printf 'gpu_check: %s\n' "$*" >&2; exit 1; }

if [[ -z "$WHEELS" ]]; then
  for d in ./wheels /opt/wheels; do
    if compgen -G "$d/*.whl" >/dev/null; then WHEELS=$d; break; fi
  done
fi
offline_install() {  # offline_install PIP_NAME...: from $WHEELS only
  [[ -n "$WHEELS" ]] || return 1
  "$PY" -m pip install -q --no-index --find-links "$WHEELS" "$@"
}

say "python and JAX"
"$PY" --version
if ! "$PY" -c "import jax" 2>/dev/null; then
  offline_install jax jaxlib 'jax-cuda12-plugin[with-cuda]' || offline_install jax jaxlib \
    || die "JAX is not installed for $PY and no wheel folder (WHEELS=..., ./wheels," \
           "/opt/wheels) has it; install jax[cuda12]==0.10.2 first"
fi
"$PY" - <<'EOF' || die "JAX sees no GPU: check the CUDA plugin (jax[cuda12]) and the driver"
import jax
print("jax", jax.__version__, "backend", jax.default_backend(), jax.devices())
assert jax.default_backend() == "gpu"
EOF

say "pure-Python dependencies (only those missing)"
missing=()
for pair in flax:flax optax:optax chex:chex tensorboardX:tensorboardX pynvml:nvidia-ml-py \
            matplotlib:matplotlib tqdm:tqdm numpy:numpy orbax.checkpoint:orbax-checkpoint; do
  "$PY" -c "import ${pair%%:*}" 2>/dev/null || missing+=("${pair#*:}")
done
if ((${#missing[@]})); then
  echo "missing: ${missing[*]}"
  # Versions as pinned in pyproject.toml; the wheel folder first, the index only if reachable.
  offline_install "${missing[@]}" \
    || timeout 120 "$PY" -m pip install -q --retries 0 --timeout 10 "${missing[@]}" \
    || die "cannot install ${missing[*]} (no wheel folder has them and no network)"
else
  echo "all present"
fi

say "NVML smoke test (real backend, 50 ms sampling, ~3 s of bf16 matmuls)"
timeout 120 "$PY" - <<'EOF'
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
print(json.dumps({k: r[k] for k in ("energy_j", "energy_source", "energy_counter_j",
                  "energy_integral_j", "avg_w", "peak_gpu_w", "achieved_sample_ms")}, indent=1))
print("gpu:", {k: g[k] for k in ("name", "power_source", "power_note", "clock_reasons_source",
                                  "unsupported", "samples", "energy_counter_note")})
print("temp/sm clock:", g["temp_gpu_c"], g["sm_clock_mhz"])
print("flags:", [f["code"] for f in r["flags"]], "errors:", r["errors_total"], r["errors"][:3])
print("memory:", memory_snapshot(jax.devices(), mon))
c, i = r["energy_counter_j"], r["energy_integral_j"]
assert r["energy_j"] > 0 and c and i, "no energy measured"
print(f"counter vs integral: {c:.1f} J vs {i:.1f} J ({i / c - 1:+.1%})")
EOF

run() {  # run LAYOUT STEPS DIR
  rm -rf "$3"
  timeout "${RUN_TIMEOUT:-170}" "$PY" -m experiments.run --layout "$1" --mesh 1 \
    --model gpt-small --dtype bfloat16 --batch-size 64 --steps "$2" --warmup 3 \
    --logdir "$3" --no-progress
}

say "calibration: ddp, 30 steps"
run ddp 30 "$OUT/calibrate" >/dev/null
STEPS=$("$PY" - "$OUT/calibrate/results.json" "$TARGET_S" <<'EOF'
import json, math, sys
r = json.load(open(sys.argv[1]))
step = r["step_time_s"]["mean"]
print(max(50, min(50_000, math.ceil(float(sys.argv[2]) / step))))
EOF
)
echo "steps per layout: $STEPS (target ${TARGET_S} s of timed steps)"

for layout in ddp fsdp; do
  say "$layout: $STEPS steps"
  run "$layout" "$STEPS" "$OUT/$layout" | tail -n 25
done

say "summary ($OUT)"
"$PY" scripts/gpu_table.py --check "$OUT/ddp" "$OUT/fsdp"
