#!/usr/bin/env bash
# The prepared GPU check: one H100/H200, at most 8 minutes, one table. Each stage runs in its own
# process under its own `timeout`; a stage that cannot run (no torchao, an older torch, a crash,
# a time-out) is one line of the table, never the end of the check. It runs on the machine's own
# CUDA torch with PYTHONPATH=src (the pinned 2.13 wheel is a CPU build), and says which torch.
#
#   bash benchmarks/gpu_check.sh             # on the GPU machine, from the repository root
#   bash benchmarks/gpu_check.sh --dry-run   # CPU, tiny shapes: the default test suite runs this
#   GPU_CHECK_STAGES="cp-attention tf32" bash benchmarks/gpu_check.sh   # some stages only
#
# A machine whose Python has only its torch (no pydantic, which the config needs; no torchao, which
# the fp8 stages need) gets them offline from wheelhouse/py<XY>/, which scripts/gpu_wheelhouse.sh
# builds where PyPI can be reached (carry the ignored wheelhouse/ folder along): whatever the
# machine's Python lacks is installed into a folder of this run on PYTHONPATH, and its own
# packages stay as they are. GPU_CHECK_WHEELHOUSE names another folder.
#
# Stage budgets (seconds, GPU, process start included): 470 s in all, under 8 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
dry=${1:-}
# The GPU machine's own python (its CUDA torch); the dry run uses the project's venv where there is one.
if [ -z "${PY:-}" ]; then
  PY=$(command -v python3 || echo python)
  [ -n "$dry" ] && [ -x .venv/bin/python ] && PY=.venv/bin/python
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
out=$(mktemp -d "${TMPDIR:-/tmp}/ndtrain-gpu-check.XXXXXX")
house="${GPU_CHECK_WHEELHOUSE:-wheelhouse}/$("$PY" -c 'import sys; print(f"py{sys.version_info[0]}{sys.version_info[1]}")')"
if compgen -G "$house/*.whl" >/dev/null; then
  # Only the distributions this Python does not have: never a second copy beside its own.
  lacking=$("$PY" - "$house" <<'PYEOF'
import importlib.metadata as md, pathlib, re, sys
for wheel in sorted(pathlib.Path(sys.argv[1]).glob("*.whl")):
    name = wheel.name.split("-", 1)[0]
    try:
        md.version(re.sub(r"[-_.]+", "-", name))
    except md.PackageNotFoundError:
        print(wheel)
PYEOF
)
  if [ -n "$lacking" ]; then
    mapfile -t wheels <<< "$lacking"
    if "$PY" -m pip install --quiet --disable-pip-version-check --no-index --no-deps --target "$out/site" \
         "${wheels[@]}" >"$out/wheelhouse.log" 2>&1; then
      export PYTHONPATH="$PYTHONPATH:$out/site"
      echo "wheelhouse: installed ${#wheels[@]} wheels offline from $house ($(basename -a "${wheels[@]}" | cut -d- -f1 | tr '\n' ' '| sed 's/ $//'))"
    else
      echo "wheelhouse: $house could not be installed ($(grep -v '^\s*$' "$out/wheelhouse.log" | tail -n 1 | cut -c1-200)); stages run without it"
    fi
  fi
elif [ -z "$dry" ]; then
  echo "wheelhouse: none at $house (bash scripts/gpu_wheelhouse.sh builds it); stages run on this Python's own packages"
fi
# stage:seconds
STAGES="env:20 calibrate:60 train-eager:55 train-compiled:100 fp8:70 cp-attention:30 doc-mask:40 ac-recompute:35 tf32:15 ckpt-stall:45"
[ -n "$dry" ] && STAGES=$(echo "$STAGES" | sed -E 's/:[0-9]+/:120/g')
# GPU_CHECK_BUDGET_SCALE=x multiplies every stage's seconds: off the GPU machine (the tests, on CPU
# hosts of differing speed and load) a budget only stops a hung stage, so it scales with the host.
scale=${GPU_CHECK_BUDGET_SCALE:-1}
# GPU_CHECK_STAGES="env tf32" runs only those stages (e.g. to repeat one).
if [ -n "${GPU_CHECK_STAGES:-}" ]; then
  STAGES=$(for item in $STAGES; do case " $GPU_CHECK_STAGES " in *" ${item%%:*} "*) echo "$item";; esac; done)
fi
rows="$out/rows.jsonl"
for item in $STAGES; do
  stage=${item%%:*}; budget=$(awk -v b="${item##*:}" -v s="$scale" 'BEGIN { printf "%d", b * s + 0.5 }')
  line=$(timeout --kill-after=10 "$budget" "$PY" benchmarks/gpu_check.py "$stage" $dry --out "$out" --budget "$((budget - 5))" 2>"$out/$stage.err" | tail -n 1)
  rc=$?
  if [ $rc -ne 0 ] || [ "${line:0:1}" != "{" ]; then
    why="exit $rc"; [ $rc -eq 124 ] || [ $rc -eq 137 ] && why="timed out after ${budget} s"
    last=$(grep -v '^\s*$' "$out/$stage.err" | tail -n 1 | cut -c1-200 | tr '"\\' "'/")
    line="{\"stage\": \"$stage\", \"result\": \"did not run ($why): $last\", \"pass_means\": \"-\", \"verdict\": \"FAIL\"}"
  fi
  echo "$line" >> "$rows"
done
"$PY" - "$rows" <<'PYEOF'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
print("| stage | result | a pass means | verdict |")
print("|---|---|---|---|")
cell = lambda text: str(text).replace("|", "\\|")  # a | in a result would split its cell
for r in rows:
    print(f"| {r['stage']} | {cell(r['result'])} | {cell(r['pass_means'])} | {r['verdict']} |")
bad = [r["stage"] for r in rows if r["verdict"] == "FAIL"]
print(f"{len(rows)} stages: {sum(r['verdict'] == 'pass' for r in rows)} pass, {len(bad)} FAIL"
      + (f" ({', '.join(bad)})" if bad else "") + f", {sum(r['verdict'] == 'skip' for r in rows)} skipped, "
      f"{sum(r['verdict'] == 'info' for r in rows)} info")
PYEOF
