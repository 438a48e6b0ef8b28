"""Grammar cases shared by the grammar unit tests and the constrained-decoding tests."""

from __future__ import annotations

import ast

SCHEMAS = {
    "flat_required": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                       "score": {"type": "number"}, "ok": {"type": "boolean"}},
        "required": ["name", "age", "score", "ok"],
    },
    "enum_and_optional": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]},
                       "size": {"type": "integer", "minimum": 1, "maximum": 99},
                       "note": {"type": "string", "maxLength": 12}},
        "required": ["color"],
    },
    "nested": {
        "type": "object",
        "properties": {
            "user": {"type": "object",
                     "properties": {"id": {"type": "integer"},
                                    "tags": {"type": "array", "items": {"type": "string"},
                                             "maxItems": 3}},
                     "required": ["id", "tags"]},
            "active": {"type": "boolean"},
        },
        "required": ["user", "active"],
    },
    "array_of_objects": {
        "type": "array",
        "items": {"type": "object",
                  "properties": {"x": {"type": "number"}, "kind": {"enum": ["a", "b", 3]}},
                  "required": ["x", "kind"]},
        "minItems": 1, "maxItems": 3,
    },
}
FIXED_KEYS = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 10},
                   "age": {"type": "integer", "minimum": 0, "maximum": 120},
                   "color": {"enum": ["red", "green", "blue"]},
                   "married": {"type": "boolean"}},
    "required": ["name", "age", "color", "married"],
}
REGEXES = [r"\d{3}-\d{4}", r"(cat|dog)s? [a-z]{1,5}", r"[A-Z][a-z]{1,6}@example\.(com|org)",
           r"(yes|no|maybe)"]
ARITH = r"""
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= num | "(" expr ")"
num ::= [1-9] [0-9]*
"""
CALL = r"""
root ::= name "(" args? ")"
name ::= "f" | "g" | "sum"
args ::= num (", " num)*
num ::= [0-9] | [1-9] [0-9]
"""


def arith_ok(node) -> bool:
    if isinstance(node, ast.BinOp):
        return isinstance(node.op, (ast.Add, ast.Sub)) and arith_ok(node.left) \
            and arith_ok(node.right)
    return isinstance(node, ast.Constant) and isinstance(node.value, int) and node.value > 0
