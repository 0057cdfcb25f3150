"""Helpers for the front-end tests: a small valid spec, and writing spec text to files."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from specc.errors import SpecError
from specc.frontend.load import load_spec
from specc.frontend.model import Settings

ROOT = Path(__file__).resolve().parents[3]

# the smallest spec that exercises config, interpolation, a module reference, ops and dataflow
BASE = textwrap.dedent("""\
    name: tiny
    config:
      hidden_size: 64
      vocab_size: 256
    model:
      module: Model
      inputs:
        tokens: {shape: [micro_batch_size, 8], dtype: int64}
    modules:
      Model:
        inputs: [tokens]
        submodules:
          embedding: {op: embedding, num_embeddings: "${vocab_size}", embedding_dim: "${hidden_size}"}
          block: {module: MLP}
        forward:
          - h = embedding(tokens)
          - h = block(h)
          - return h
      MLP:
        inputs: [x]
        submodules:
          fc1: {op: linear, parallel: column, in_features: "${hidden_size}", out_features: "${4 * hidden_size}"}
          act: {op: gelu}
          fc2: {op: linear, parallel: row, in_features: "${4 * hidden_size}", out_features: "${hidden_size}"}
        forward:
          - h = fc1(x)
          - h = act(h)
          - y = fc2(h)
          - return y
    """)


@pytest.fixture
def write(tmp_path):
    """write(text, name='spec.yaml') -> path of a spec file holding `text` (dedented)."""

    def make(text: str, name: str = "spec.yaml") -> str:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text), encoding="utf-8")
        return str(path)

    return make


@pytest.fixture
def load(write):
    """load(text, **settings) -> Spec, from spec text written to a file."""

    def make(text: str, overrides=(), **settings):
        return load_spec(write(text), Settings(**settings), list(overrides))

    return make


@pytest.fixture
def error(write):
    """error(text, **settings) -> the SpecError that loading the text raises."""

    def make(text: str, overrides=(), name: str = "spec.yaml", **settings) -> SpecError:
        path = write(text, name)
        with pytest.raises(SpecError) as info:
            load_spec(path, Settings(**settings), list(overrides))
        return info.value

    return make


def with_config(text: str, **values) -> str:
    """BASE-like text with extra config lines (values are written as given)."""
    extra = "".join(f"  {k}: {v}\n" for k, v in values.items())
    return text.replace("config:\n", "config:\n" + extra, 1)
