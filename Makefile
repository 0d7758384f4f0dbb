# The two commands a newcomer types: `make lab` and `make test`. Both set themselves up.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DATA := data/kjv

.PHONY: setup data lab readme ablation test bench clean

setup: $(STAMP)

# Reinstall only when the project's dependencies change. pip installs the pinned torch, from where its
# own configuration finds it (this machine keeps the CPU build on its disk), and uv; uv then installs
# the rest in seconds where pip takes minutes, keeping that torch.
TORCH_PIN = $$(grep -m1 -o '"torch==[^"]*"' pyproject.toml | tr -d '"')
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check "$(TORCH_PIN)" uv
	$(BIN)/uv pip install --quiet --python $(BIN)/python -e '.[test]'
	touch $(STAMP)

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
