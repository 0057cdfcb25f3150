"""A JSON Schema of the spec language, generated from the op registry so it never drifts."""

from __future__ import annotations

import json

from .frontend.load import IMPLS
from .ops import SPEC_OPS

_INTERP = {"type": "string", "pattern": r"\$\{[^{}]+\}"}
_TYPES = {
    "int": {"anyOf": [{"type": "integer"}, _INTERP]},
    "float": {"anyOf": [{"type": "number"}, _INTERP]},
    "bool": {"anyOf": [{"type": "boolean"}, _INTERP]},
    "str": {"type": "string"},
    "int_list": {"type": "array", "items": {"anyOf": [{"type": "integer"}, _INTERP]}, "minItems": 1},
    "float_list": {"type": "array", "items": {"anyOf": [{"type": "number"}, _INTERP]}, "minItems": 1},
}
_IDENT = {"type": "string", "pattern": "^[A-Za-z_][A-Za-z0-9_]*$"}


def _op_schema(kind) -> dict:
    props = {"op": {"const": kind.name}, "impl": {"enum": ["auto", *kind.impls]}, "description": {"type": "string"}}
    for a in kind.attrs:
        p = dict(_TYPES[a.type])
        if a.choices:
            p = {"enum": list(a.choices)}
        if a.doc:
            p["description"] = a.doc
        if a.default is not None:
            p["default"] = a.default
        props[a.name] = p
    return {"type": "object", "description": kind.doc, "properties": props, "additionalProperties": False,
            "required": ["op"] + [a.name for a in kind.attrs if a.required]}


def json_schema() -> dict:
    ref = {"type": "object", "properties": {"module": _IDENT, "repeat": _TYPES["int"], "description": {"type": "string"}},
           "required": ["module"], "additionalProperties": False}
    module = {
        "type": "object",
        "properties": {
            "description": {"type": "string"},
            "inputs": {"type": "array", "items": _IDENT},
            "submodules": {"type": "object", "additionalProperties": {"anyOf": [ref] + [
                {"$ref": f"#/$defs/op_{n}"} for n in sorted(SPEC_OPS)]}},
            "forward": {"type": "array", "items": {"type": "string"}, "minItems": 1,
                        "description": "steps like 'y = f(x)', 'y = a + b', ending with 'return y'"},
            "recompute": {"enum": ["full", "selective"],
                          "description": "activation recompute: full (every call keeps only its inputs and runs "
                                         "again in backward) or selective (its attention cores)"},
        },
        "required": ["forward"],
        "additionalProperties": False,
    }
    model_input = {"type": "object", "properties": {
        "shape": {"type": "array", "items": {"anyOf": [{"type": "integer"}, {"type": "string"}]}},
        "dtype": {"enum": ["int64", "int32", "float32", "bfloat16", "float16"]}}, "required": ["shape"],
        "additionalProperties": False}
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "specc model spec",
        "type": "object",
        "properties": {
            "name": _IDENT,
            "description": {"type": "string"},
            "extends": {"type": "string", "description": "path of a spec to inherit from, relative to this file"},
            "config": {"type": "object", "additionalProperties": {"anyOf": [
                {"type": ["integer", "number", "boolean", "string"]}, {"type": "array"}]}},
            "model": {"type": "object", "properties": {"module": _IDENT, "inputs": {
                "type": "object", "additionalProperties": model_input}}, "required": ["module"], "additionalProperties": False},
            "modules": {"type": "object", "additionalProperties": {"$ref": "#/$defs/module"}},
            "hf": {"type": "object"},
            "megatron": {"type": "object", "description": "Megatron-LM's flags this spec answers to", "properties": {
                "flags": {"type": "object", "description": "a flag -> the config value it sets",
                          "propertyNames": {"pattern": "^--[a-z0-9][a-z0-9-]*$"}, "additionalProperties": _IDENT},
                "structure": {"type": "object", "description": "an architecture flag whose structure the spec has -> "
                              "true, or the value that selects it", "propertyNames": {"pattern": "^--[a-z0-9][a-z0-9-]*$"},
                              "additionalProperties": {"type": ["boolean", "string"]}},
                "no_effect": {"type": "object", "description": "a flag that changes nothing in this spec's model -> "
                              "why (accepted, with a note in the run's log)",
                              "propertyNames": {"pattern": "^--[a-z0-9][a-z0-9-]*$"},
                              "additionalProperties": {"type": "string"}}},
                "additionalProperties": False},
        },
        "required": ["name", "model", "modules"],
        "additionalProperties": False,
        "$defs": {"module": module, **{f"op_{n}": _op_schema(k) for n, k in sorted(SPEC_OPS.items())}},
        "x-impls": list(IMPLS),
    }


def schema_text() -> str:
    return json.dumps(json_schema(), indent=2) + "\n"
