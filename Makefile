# The two commands a newcomer types: `make lab` and `make test`. Both set themselves up.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DATA := data/kjv

.PHONY: setup constraints data lab readme ablation test bench clean

setup: $(STAMP)

# Reinstall only when the project's dependencies change. pip installs this torch, from where its own
# configuration finds it (this machine keeps the CPU build on its disk), and uv; uv then installs the
# rest in seconds where pip takes minutes, keeping that torch. The library itself takes any torch in
# pyproject.toml's range; constraints.txt holds the exact versions of everything else the tests ran on.
# uv compiles what it installs to bytecode (pip does, uv does not by default): where PYTHONDONTWRITEBYTECODE
# is set, as on our machines, each new process would otherwise compile transformers, Lightning and numpy
# from source again (a cold `import transformers.trainer` 9.4 s, compiled 6.5 s).
TORCH := torch==2.13.0
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --constraint constraints.txt "$(TORCH)" uv
	$(BIN)/uv pip install --quiet --compile-bytecode --python $(BIN)/python --constraint constraints.txt -e '.[test]'
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
