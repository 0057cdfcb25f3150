# Quick start: `make demo` and `make test` each set up .venv from nothing, then do their job.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
TORCH  := torch==2.13.0

.PHONY: demo test lint check clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check $(TORCH)
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m specc validate specs/*.yaml
	$(BIN)/python -m specc plan specs/gpt-tiny.yaml --tp 2 --sp
	$(BIN)/python -m specc compile specs/gpt-tiny.yaml --tp 2 --sp -o runs/demo

test: $(STAMP)
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check specc runtime tests bench compile.py

check: $(STAMP)
	$(BIN)/python -m specc check generated

clean:
	rm -rf $(VENV) runs build *.egg-info
