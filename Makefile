# Two entry points: `make demo` and `make test`. Both create .venv and install nnh into it.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test bench lint clean

$(PY):
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# torch==2.13.0 first when missing: the CPU wheel lies on disk; an unpinned torch pulls a CUDA build.
$(STAMP): $(PY) pyproject.toml
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[dev,lightning,accelerate]"
	touch $(STAMP)

# The main job on CPU: 2 DDP processes, synthetic shards written once to build/demo/data.
demo: $(STAMP)
	rm -rf build/demo/run
	$(VENV)/bin/torchrun --standalone --nproc_per_node=2 examples/train_minimal.py \
		--device cpu --data-dir build/demo/data --run-dir build/demo/run

# 3 test processes on 2 cores: most long tests wait on the ranks, launchers and workers they start.
test: $(STAMP)
	$(PY) -m pytest -q -n 3 --dist worksteal

bench: $(STAMP)
	for b in tools/bench/*.py; do echo "== $$b"; $(PY) $$b; done

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
