# The two commands a newcomer types: `make lab` and `make test`. Both set themselves up.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DATA := data/kjv

.PHONY: setup constraints data lab readme ablation test bench clean

setup: $(STAMP)

# Reinstall only when the project's dependencies change. The machine's pip puts uv in a venv made
# without pip of its own; uv then installs everything, this torch included, unpacking on every core (a
# set-up from nothing 63 s with pip installing torch, 8 s so). uv reads no pip configuration: it is
# handed the folder of wheels pip's configuration names (this machine keeps the CPU build of torch there;
# without it, torch comes from the package index, a CUDA build of GBs). The library itself takes any torch
# in pyproject.toml's range; constraints.txt holds the exact versions of everything else the tests ran on.
# The venv's bytecode is written by the first process that imports a module, even where
# PYTHONDONTWRITEBYTECODE is set (as on our machines), not compiled whole at set-up: 1.4 GB of packages
# take 21 s to compile on two cores, the modules a run and the tests import 8 CPU-s once. Without it, every
# new process would compile torch, transformers and Lightning from source again (a cold
# `import transformers.trainer` 9.4 s, compiled 6.5 s), and every pytest worker its rewritten test modules.
unexport PYTHONDONTWRITEBYTECODE
TORCH := torch==2.13.0
FIND_LINKS := $(or $(PIP_FIND_LINKS),$(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null))
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv --without-pip $(VENV)
	$(PYTHON) -m pip --python $(BIN)/python install --quiet --disable-pip-version-check --constraint constraints.txt uv
	$(BIN)/uv pip install --quiet --python $(BIN)/python $(if $(FIND_LINKS),--find-links $(FIND_LINKS)) \
		--constraint constraints.txt "$(TORCH)" -e '.[test]'
	touch $(STAMP)

# After a dependency changed in pyproject.toml and is installed in the venv: its versions, as constraints.txt.
constraints:
	{ grep '^#' constraints.txt; $(BIN)/uv pip freeze --python $(BIN)/python | grep -vE '^(-e |exactresume|torch==|pip==)'; } \
		> constraints.txt.new && mv constraints.txt.new constraints.txt

data: $(STAMP)
	$(BIN)/exactresume prepare --out $(DATA)

lab: data
	$(BIN)/exactresume lab --data $(DATA) --out runs/lab --ablate

# Copy the lab's json and figures into docs/lab and regenerate the blocks made from them (README.md, docs/lab.md).
readme: lab
	$(BIN)/python docs/build_readme.py runs/lab

# Measure what each resume part protects on the default preset, keep the json, regenerate its table (docs/resume-file.md).
ablation: data
	$(BIN)/exactresume ablate --data $(DATA) --out runs/ablate
	mkdir -p docs && cp runs/ablate/ablation.json docs/ablation.json
	$(BIN)/exactresume ablate --markdown docs/ablation.json --readme docs/resume-file.md

# All tests, then the habits: lint, format and the import layers (pyproject.toml holds their rules).
# Two workers, one a core: a third gained nothing measurable (302 s against 300 s on one clean clone) and
# adds to the load the --nproc runs' ranks already put on two cores.
test: $(STAMP)
	$(BIN)/python -m pytest -n 2
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

# Every figure a ratio against a baseline in the same run (about 20 minutes on two cores); docs/performance.md's
# Performance table is regenerated from the json kept in docs/.
bench: data
	$(BIN)/python -m bench --data $(DATA) --out runs/bench
	mkdir -p docs && cp runs/bench/bench.json docs/bench.json
	$(BIN)/python -m bench.table docs/bench.json --readme docs/performance.md
	$(BIN)/python -m bench.pages docs/bench.json

clean:
	rm -rf $(VENV) runs data
