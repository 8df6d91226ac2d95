#!/usr/bin/env bash
# Single-GPU speed check (issue: Go et al. reproduction, GPU speed): a ~1.1B-parameter
# Llama-style decoder (llama-1b: 20 layers, width 2048, GQA 16/8, seq 2048) in bf16 with
# cuDNN flash attention (jax.nn.dot_product_attention implementation="cudnn"), trying a few
# remat policies and batch sizes, printing tokens/s and MFU of each and the best.
# Goal: MFU >= 50% on one H200 (torchtitan's Llama 3.1 8B on 8 H100 with FSDP: 5,762
# tokens/s per GPU). Run from the repository root on a machine with a GPU:
#   bash scripts/gpu_perf.sh            # CONFIGS="dots:8 dots:16 none:8" to choose
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${GPU_PERF_DIR:-${OUT:-$(mktemp -d)}/gpu_perf}
CONFIGS=${CONFIGS:-"dots:8 dots:16 full:16 none:4"}
STEPS=${STEPS:-12}
mkdir -p "$OUT"
"$PY" -c "import jax; assert jax.default_backend() == 'gpu', jax.devices(); print(jax.devices())" \
  || { echo "gpu_perf: JAX sees no GPU" >&2; exit 1; }

for cfg in $CONFIGS; do
  remat=${cfg%%:*}; batch=${cfg##*:}
  name="remat-${remat}-b${batch}"
  echo "== $name"
  timeout 300 "$PY" -m experiments.run --layout ddp --mesh 1 --model llama-1b \
      --model-opts attention=cudnn --dtype bfloat16 --remat "$remat" --batch-size "$batch" \
      --warmup 3 --steps "$STEPS" --power-sample-ms 100 --logdir "$OUT/$name" --no-progress \
      > "$OUT/$name.log" 2>&1 || { echo "   failed (see $OUT/$name.log):"; tail -3 "$OUT/$name.log"; }
done

"$PY" - "$OUT" <<'PYEOF'
import json, pathlib, sys
rows = []
for path in sorted(pathlib.Path(sys.argv[1]).glob("*/results.json")):
    r = json.loads(path.read_text())
    m = r["mfu"]
    rows.append((path.parent.name, r["step_time_s"]["p50"], r["throughput"]["tokens_per_s"],
                 m["value"], m.get("hfu"), r["memory"]["measured_peak_bytes"]))
print(f"\n{'config':<16}{'step p50 ms':>12}{'tokens/s':>12}{'mfu':>13}"
      f"{'hfu':>11}{'peak GiB':>10}")
for name, p50, tps, mfu_a, mfu_c, peak in rows:
    fmt = lambda x: "n/a" if x is None else f"{x:.1%}"
    fmt2 = lambda b: "n/a" if b is None else f"{b / 2**30:.1f}"
    print(f"{name:<16}{p50 * 1e3:>12.1f}{tps:>12,.0f}{fmt(mfu_a):>13}{fmt(mfu_c):>11}"
          f"{fmt2(peak):>10}")
if rows:
    best = max(rows, key=lambda r: r[2])
    print(f"\nbest: {best[0]}: {best[2]:,.0f} tokens/s, mfu (model FLOPs) "
          f"{fmt(best[3])} (goal >= 50% on one H200)")
PYEOF
