"""docs/spec-language.md stays true: its op reference matches the registry, and every spec it
shows as an example compiles (at TP 1, 2 and 4, with and without SP)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from specc.compiler import load_and_compile
from specc.frontend.model import Settings
from specc.ops import SPEC_OPS

from .conftest import ROOT

DOC = ROOT / "docs" / "spec-language.md"
TEXT = DOC.read_text(encoding="utf-8")
# <!-- example: NAME [extends PARENT] --> followed by a ```yaml block
EXAMPLE = re.compile(r"<!-- example: (\S+)(?: extends (\S+))? -->\n```yaml\n(.*?)```", re.S)
EXAMPLES = {m.group(1): (m.group(2), m.group(3)) for m in EXAMPLE.finditer(TEXT)}


def test_the_op_reference_names_every_op_and_attribute():
    section = TEXT[TEXT.index("<!-- BEGIN ops"):TEXT.index("<!-- END ops -->")]
    for name, kind in SPEC_OPS.items():
        assert f"#### op: {name}" in section and f"[`{name}`]" in section
        for attr in kind.attrs:
            assert f"| `{attr.name}` |" in section.split(f"#### op: {name}")[1].split("#### op:")[0], (name, attr.name)


def test_the_op_reference_is_up_to_date():
    proc = subprocess.run([sys.executable, str(ROOT / "docs" / "gen_ops_table.py"), "--check"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_the_document_has_examples():
    assert {"first.yaml", "tiny-encoder.yaml", "encoder-base.yaml", "encoder-prenorm.yaml"} <= set(EXAMPLES)


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_examples_compile(tmp_path, name):
    for other, (_, text) in EXAMPLES.items():  # parents sit beside their children
        (tmp_path / other).write_text(text, encoding="utf-8")
    parent, _ = EXAMPLES[name]
    assert parent is None or parent in EXAMPLES
    for tp, sp in ((1, False), (2, False), (2, True), (4, False), (4, True)):
        spec, graph = load_and_compile(str(tmp_path / name), Settings(tp=tp, sp=sp))
        assert spec.name


def test_the_worked_example_is_what_the_text_says(tmp_path):
    (tmp_path / "tiny-encoder.yaml").write_text(EXAMPLES["tiny-encoder.yaml"][1], encoding="utf-8")
    spec, _ = load_and_compile(str(tmp_path / "tiny-encoder.yaml"), Settings(tp=4, sp=True))
    assert spec.modules["Attention"].submodules["core_attention"].attrs["causal"] is False
    assert spec.modules["Encoder"].submodules["lm_head"].attrs["tie"] == "embedding"
    assert spec.modules["Encoder"].submodules["layers"].repeat == 4
    (tmp_path / "encoder-prenorm.yaml").write_text(EXAMPLES["encoder-prenorm.yaml"][1], encoding="utf-8")
    spec, _ = load_and_compile(str(tmp_path / "encoder-prenorm.yaml"))
    assert list(spec.modules["EncoderLayer"].submodules) == ["attention_norm", "attention", "mlp_norm", "mlp"]


def test_the_quoted_size_error_is_real():
    line = next(ln for ln in TEXT.splitlines() if ln.startswith("specs/gpt.yaml:") and "num_heads=12" in ln)
    proc = subprocess.run([sys.executable, "-m", "specc_cli", "validate", "specs/gpt.yaml", "--tp", "8"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.strip() == line


FAMILIES = ROOT / "docs" / "families.md"


def test_the_families_table_lists_every_shipped_spec():
    text = FAMILIES.read_text(encoding="utf-8")
    table = text[:text.index("## The ops the families use")]
    for path in sorted((ROOT / "specs").glob("*.yaml")):
        assert f"`{path.name}`" in table, f"docs/families.md has no row for specs/{path.name}"


def test_the_families_worked_example_is_the_shipped_spec():
    text = FAMILIES.read_text(encoding="utf-8")
    block = re.search(r"<!-- example: starcoder2.yaml [^\n]*-->\n```yaml\n(.*?)```", text, re.S).group(1)
    assert block == (ROOT / "specs" / "starcoder2.yaml").read_text(encoding="utf-8")
