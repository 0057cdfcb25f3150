"""Located YAML: every key, value and character inside a string knows its line and column, and
hostile documents are refused quickly."""

from __future__ import annotations

import time

import pytest

from specc.errors import Loc, SpecError
from specc.frontend.yamlload import MAX_BYTES, LDict, LList, LStr, load_yaml, read_text

from .conftest import BASE


def doc(text):
    return load_yaml(text, "s.yaml")


def where(loc):
    return (loc.line, loc.col)


def test_keys_values_and_items_are_located():
    d = doc("a: 1\nb:\n  c: [x, 'y']\n  d:\n    - 5\n")
    assert isinstance(d, LDict) and isinstance(d["b"], LDict) and isinstance(d["b"]["c"], LList)
    assert where(d.key_loc("a")) == (1, 1) and where(d.value_loc("a")) == (1, 4)
    assert where(d["b"].key_loc("c")) == (3, 3) and where(d["b"].value_loc("c")) == (3, 6)
    assert [where(d["b"]["c"].item_loc(i)) for i in range(2)] == [(3, 7), (3, 10)]
    assert where(d["b"]["d"].item_loc(0)) == (5, 7)


def test_characters_inside_an_unquoted_scalar():
    s = doc("key: ${hidden_size * 4}\n")["key"]
    assert isinstance(s, LStr) and not s.quoted
    assert where(s.loc_at(0)) == (1, 6)
    assert where(s.loc_at(2)) == (1, 8)  # the 'h' of hidden_size
    assert where(s.loc_at(2).shifted(14)) == (1, 22)  # shifting an anchored location stays exact


def test_characters_inside_a_quoted_scalar():
    s = doc('key: "${hidden_size * 4}"\n')["key"]
    assert s.quoted
    assert where(s.loc_at(0)) == (1, 7)  # past the opening quote
    assert where(s.loc_at(2)) == (1, 9)
    s = doc("key: 'it''s ${x}'\n")["key"]
    assert s == "it's ${x}"
    assert where(s.loc_at(s.index("x"))) == (1, 15)  # after the doubled quote


def test_characters_after_escapes_in_a_double_quoted_scalar():
    s = doc('key: "\\t\\u00e9\\\\${x}"\n')["key"]
    assert s == "\té\\${x}"
    assert where(s.loc_at(s.index("x"))) == (1, 19)


def test_characters_inside_block_and_folded_scalars():
    s = doc("steps:\n  - |  # a comment with x in it\n    h = f(x)\n")["steps"][0]
    assert where(s.loc_at(s.index("x"))) == (3, 11)
    s = doc("key: a plain\n  folded ${x}\n")["key"]
    assert s == "a plain folded ${x}"
    assert where(s.loc_at(s.index("x"))) == (2, 12)


def test_crlf_and_bom():
    d = doc("\ufeffa: 1\r\nb: ${x}\r\n")
    assert d["a"] == 1
    assert where(d["b"].loc_at(2)) == (2, 6)


def test_an_empty_document_is_null():
    assert doc("---\n...\n") is None


def test_aliases_share_one_value():
    d = doc("a: &s some text\nb: *s\nc: [*s, *s]\n")
    assert d["b"] is d["a"] and d["c"][0] is d["a"]


@pytest.mark.parametrize("text, what, at", [
    ("a: 1\na: 2\n", "duplicate key 'a'", (2, 1)),
    ("a: [1\n", "YAML syntax error", None),
    ("a:\n\t- 1\n", "YAML syntax error: found character '\\t' that cannot start any token", (2, 1)),
    ("a: 1\n---\nb: 2\n", "expected a single document in the stream, but found another document", (2, 1)),
    ("<<: {a: 1}\n", "YAML merge keys ('<<') are not supported", (1, 1)),
    ("a: !!python/name:os.system x\n", "unsupported YAML tag", (1, 4)),
    ("a: !!set {x, y}\n", "unsupported YAML tag 'tag:yaml.org,2002:set'", (1, 4)),
    ("a: 2024-01-01\n", "unsupported YAML value of type date", (1, 4)),
    ("? [a, b]\n: 1\n", "mapping keys must be plain strings", (1, 3)),
    ("1.5: x\n", "mapping key 1.5 must be a string", (1, 1)),
    ("a: &a [1, *a]\n", "an alias refers to a value that contains it", (1, 4)),
    ("a: " + "[" * 100 + "]" * 100 + "\n", "document is nested too deeply (more than 64 levels)", None),
    ("a: b\x07\n", "character U+0007 is not allowed", (1, 5)),
    ("", "file is empty", (1, 1)),
    ("# only\n\n# comments\n", "file holds only comments", (1, 1)),
])
def test_bad_documents(text, what, at):
    with pytest.raises(SpecError) as info:
        doc(text)
    assert what in info.value.what
    if at:
        assert where(info.value.loc) == at


def test_alias_bomb_is_refused_before_anything_is_built():
    lines = ["a: &a [x, x, x, x, x, x, x, x, x, x]"]
    for i, name in enumerate("bcdefghijk"):
        prev = "abcdefghijk"[i]
        lines.append(f"{name}: &{name} [" + ", ".join([f"*{prev}"] * 10) + "]")
    start = time.perf_counter()
    with pytest.raises(SpecError) as info:
        doc("\n".join(lines) + "\n")  # 10**11 values once expanded
    assert time.perf_counter() - start < 0.5
    assert info.value.what == "this value expands to more than 200000 values"
    assert where(info.value.loc) == (6, 4)  # 'f', the first list that is too big by itself


def test_long_strings_multiplied_by_aliases_are_refused():
    text = "s: &s " + "x" * 10000 + "\nl: &l [" + ", ".join(["*s"] * 30) + "]\nm: [" + ", ".join(["*l"] * 30) + "]\n"
    with pytest.raises(SpecError) as info:
        doc(text)
    assert "characters of text" in info.value.what


def test_read_text(tmp_path):
    with pytest.raises(SpecError) as info:
        read_text(str(tmp_path / "missing.yaml"))
    assert info.value.format() == f"{tmp_path / 'missing.yaml'}: error: no such file (check the path)"
    with pytest.raises(SpecError) as info:
        read_text(str(tmp_path))
    assert "is a directory" in info.value.what
    big = tmp_path / "big.yaml"
    big.write_bytes(b"#" * (MAX_BYTES + 1))
    with pytest.raises(SpecError) as info:
        read_text(str(big))
    assert info.value.what == f"file is larger than {MAX_BYTES} bytes"
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(b"a: 1\nb: \xff\n")
    with pytest.raises(SpecError) as info:
        read_text(str(bad))
    assert info.value.loc == Loc(str(bad), 2, 4)


def test_shipped_specs_parse_with_locations():
    d = doc(BASE)
    assert where(d["modules"]["MLP"]["submodules"].key_loc("act")) == (23, 7)
