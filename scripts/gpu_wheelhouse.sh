#!/usr/bin/env bash
# Builds wheelhouse/py<XY>/: the wheels benchmarks/gpu_check.sh needs beyond what a GPU image's own
# Python brings (its CUDA torch, numpy, tokenizers, pyarrow, safetensors...): pydantic and its
# parts, tomli_w and typing_extensions (the config), torchao (the fp8 stages). Run it where PyPI
# can be reached; the GPU machine cannot download, so the wheelhouse travels with the working tree
# (an ignored folder: name it among the paths a remote run carries), and gpu_check.sh installs
# from it offline. Versions follow pyproject.toml's pins.
#
#   bash scripts/gpu_wheelhouse.sh                          # for the GPU image's Python 3.12
#   bash scripts/gpu_wheelhouse.sh --python-version 3.11 --bare   # a Python that has only torch
#
# --bare adds what a Python with only torch lacks (numpy, ...): a torch-only venv plus this
# wheelhouse runs the check's --dry-run (tests/tools/test_gpu_wheelhouse.py).
set -euo pipefail
cd "$(dirname "$0")/.."
pyver=3.12 dest=wheelhouse bare="" limit_mib=50
while [ $# -gt 0 ]; do
  case "$1" in
    --python-version) pyver=$2; shift 2;;
    --dest) dest=$2; shift 2;;
    --bare) bare=1; shift;;
    *) echo "gpu_wheelhouse.sh: unknown argument '$1' (--python-version X.Y, --dest DIR, --bare)" >&2; exit 2;;
  esac
done
case "$pyver" in [0-9].[0-9]|[0-9].[0-9][0-9]) ;; *) echo "gpu_wheelhouse.sh: --python-version '$pyver' is not X.Y" >&2; exit 2;; esac
out="$dest/py${pyver/./}"
PY=$(command -v python3 || echo python)
# The requirement strings, as pyproject.toml pins them (never a second copy of a pin here).
names="pydantic tomli_w typing_extensions torchao"
[ -n "$bare" ] && names="$names numpy"
reqs=$("$PY" - "$names" <<'PYEOF'
import re, sys, tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
want = sys.argv[1].split()
by_name = {re.split(r"[<>=!~; \[]", d, 1)[0].lower().replace("-", "_"): d for d in deps}
missing = [n for n in want if n not in by_name]
if missing:
    sys.exit(f"gpu_wheelhouse.sh: pyproject.toml names no {missing}")
print("\n".join(by_name[n] for n in want))
PYEOF
)
mkdir -p "$out"
mapfile -t req_list <<< "$reqs"
"$PY" -m pip download --quiet --disable-pip-version-check --only-binary=:all: --python-version "$pyver" \
  --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux_2_28_x86_64 --dest "$out" "${req_list[@]}" \
  2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)  # pip's note on this host's local mirrors
size_kib=$(du -sk "$out" | cut -f1)
count=$(ls "$out"/*.whl | wc -l)
echo "gpu_wheelhouse.sh: $count wheels, $((size_kib / 1024)) MiB in $out (Python $pyver)"
if [ "$size_kib" -gt $((limit_mib * 1024)) ]; then
  echo "gpu_wheelhouse.sh: $out is over $limit_mib MiB: too much to carry to the GPU machine" >&2
  exit 1
fi
