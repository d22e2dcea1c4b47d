# Two commands on a fresh machine: `make train` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
NDTRAIN := $(VENV)/bin/ndtrain
STAMP := $(VENV)/.installed
DATA := data/stdlib-byte

.PHONY: install data train test test-slow clean

install: $(STAMP)

# Reinstalls only when the project metadata changes; the CPU torch 2.13.0 wheel is pinned in
# pyproject.toml (an unpinned torch would pull a multi-GB CUDA build).
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[test]'
	touch $(STAMP)

data: install
	$(NDTRAIN) prepare --out $(DATA) --max-mb 16 --if-absent

train: data
	$(NDTRAIN) train --config configs/default.toml --nproc 2

# Two pytest-xdist workers, one test file each at a time (--dist loadfile keeps a file's shared
# spawned groups in one process): a serial run averages ~1 busy core of the two (most tests are
# one process, or a Gloo world waiting on itself), and on an Intel host with 4x the per-op cost
# it took 15m37s, past the 15-minute promise. TEST_WORKERS=0 runs serially.
TEST_WORKERS ?= 2

test: install
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=25

# The longest end-to-end tests (@pytest.mark.heavy): CI runs them after `make test` (.ci/run), so
# nothing leaves CI, while `make test` fits 15 minutes on the slowest host kind seen (a Zen 1 EPYC,
# ~2x this reference host per core: docs/results/benchmarks.md).
test-heavy: install
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m heavy --durations=10

test-slow: install
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m slow

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
