# Quick start: `make demo` and `make test` each set up .venv from nothing, then do their job.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
TORCH  := torch==2.13.0

.PHONY: demo test lint check clean gpu-check

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check $(TORCH)
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[test]'
	touch $(STAMP)

# Compile gpt-tiny at TP=2 with SP, prepare the embedded corpus (the standard library's own
# sources, byte tokenizer), train it on 2 gloo ranks and plot the loss: a few minutes on 2 cores.
demo: $(STAMP)
	$(BIN)/python -m specc_cli validate specs/*.yaml
	$(BIN)/python -m specc_cli compile specs/gpt-tiny.yaml --tp 2 --sp -o runs/demo
	$(BIN)/python -m specc_cli data prepare --stdlib --tokenizer byte --output-prefix runs/demo/data/stdlib_text_document
	$(BIN)/python -m specc_cli train specs/gpt-tiny.yaml --nproc-per-node 2 \
		--tensor-model-parallel-size 2 --sequence-parallel --micro-batch-size 16 --global-batch-size 32 \
		--train-iters 300 --lr 3e-3 --min-lr 3e-4 --lr-warmup-iters 20 --lr-decay-style cosine \
		--eval-interval 100 --eval-iters 4 --log-interval 25 --data-path runs/demo/data/stdlib_text_document --run-dir runs/demo
	$(BIN)/python -m specc_cli plot runs/demo

# The linter and `specc check` first (fast; stale generated files fail), then the suite.
test: lint check
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check specc runtime specc_torch specc_cli tests bench compile.py

check: $(STAMP)
	$(BIN)/python -m specc_cli check generated

# The prepared GPU check (bench/gpu_check.py; results in docs/benchmarks.md, "GPU check"): the first
# thing to run on a CUDA machine, under 10 minutes on one GPU. It uses .venv when there is one and
# the machine's own python3 (with torch) otherwise: a GPU machine may have no package registry.
gpu-check:
	$(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON)) bench/gpu_check.py

clean:
	rm -rf $(VENV) runs build *.egg-info
