#!/usr/bin/env bash
# One command, one H100/H200-class GPU, under 5 minutes: bf16 training of llama3-1b at world 1,
# compile off and on (one process each, so each peak memory is its own), tokens/s, MFU and peak
# memory, beside the planner's memory prediction for the same layout.
#
#   bash benchmarks/gpu.sh            # on the GPU machine, from the repository root
#   bash benchmarks/gpu.sh --dry-run  # CPU, debug model: checks the plumbing
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
out=$(mktemp -d)
for mode in off on; do
  timeout 240 "$PY" benchmarks/gpu_throughput.py --compile "$mode" "$@" | tail -n 1 > "$out/$mode.json"
done
"$PY" - "$out" <<'PYEOF'
import json, sys
from pathlib import Path
rows = {m: json.loads((Path(sys.argv[1]) / f"{m}.json").read_text()) for m in ("off", "on")}
r = rows["off"]
print(f"{r['preset']} ({r['params_m']:,.0f}M params) on {r['device']}, bf16, seq {r['seq']}, micro-batch {r['micro_batch']}, world 1")
print("| compile | tokens/s | MFU | peak allocated GiB | peak reserved GiB | planner GiB | allocated / planner | warm-up s |")
print("|---|---|---|---|---|---|---|---|")
for m, r in rows.items():
    print(f"| {m} | {r['tokens_per_s']:,.0f} | {100 * r['mfu']:.1f}% | {r['peak_alloc_gib']:.1f} | "
          f"{r['peak_reserved_gib']:.1f} | {r['planner_memory_gib']:.1f} | "
          f"{r['peak_alloc_gib'] / r['planner_memory_gib']:.2f} | {r['warmup_s']:.0f} |")
print(f"compile on / off tokens/s: {rows['on']['tokens_per_s'] / rows['off']['tokens_per_s']:.3f}x "
      f"(MFU peak: {rows['off']['peak_source']}; planner hardware: {rows['off']['planner_hw']})")
PYEOF
