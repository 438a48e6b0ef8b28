"""Find grammar rules that can never finish, before a request is admitted.

A rule is *productive* when some finite string matches it. A grammar that can reach an
unproductive rule (``root ::= "a" root``; a JSON schema whose required property is the schema
itself) lets the model write text that can never complete, and xgrammar's jump-forward search
follows such a rule's single forced continuation forever (and its memory with it). So such a
grammar is refused with a 400 instead.

The check reads the grammar as xgrammar prints it (``str(xgr.Grammar)``, one normalized rule
per line): ``name ::= ((a "b" [c-d]*) | ("" ))``, with repetitions ``* + ? {m, n}``,
lookaheads ``(=(...))`` and ``Regex("...")`` terminals. It only proves; anything it does not
recognise (structural-tag dispatch, a format it has not seen) makes it give no verdict, never a
false refusal.
"""

from __future__ import annotations

import re

# tokens of xgrammar's printed EBNF, in match order
_TOKEN = re.compile(r'''
    (?P<string>"(?:[^"\\]|\\.)*")
  | (?P<cls>\[(?:[^\]\\]|\\.)*\])
  | (?P<call>Regex\()
  | (?P<name>[A-Za-z_][A-Za-z0-9_.\-]*)
  | (?P<repeat>\{\s*\d+\s*,\s*-?\d+\s*\})
  | (?P<punct>\(=|::=|[()|*+?,=])
  | (?P<space>\s+)
''', re.VERBOSE)


class _Unknown(Exception):
    """A construct this check does not know: no verdict."""


def _tokens(line: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    while pos < len(line):
        m = _TOKEN.match(line, pos)
        if m is None:
            raise _Unknown(line[pos:pos + 20])
        if m.lastgroup != "space":
            out.append((m.lastgroup, m.group()))
        pos = m.end()
    return out


class _Parser:
    """One rule body -> a formula: True (a terminal), ("ref", name), ("and", [...]),
    ("or", [...])."""

    def __init__(self, tokens: list[tuple[str, str]]):
        self.tokens, self.i = tokens, 0

    def peek(self) -> tuple[str, str] | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def take(self, text: str | None = None) -> tuple[str, str]:
        tok = self.peek()
        if tok is None or (text is not None and tok[1] != text):
            raise _Unknown(f"expected {text!r}")
        self.i += 1
        return tok

    def alternatives(self):
        options = [self.sequence()]
        while self.peek() == ("punct", "|"):
            self.take()
            options.append(self.sequence())
        return ("or", options)

    def sequence(self):
        items = []
        while (tok := self.peek()) is not None and tok[1] not in (")", "|"):
            item = self.item()
            if item is not None:
                items.append(item)
        return ("and", items)

    def item(self):
        kind, text = self.take()
        if kind in ("string", "cls"):
            atom = True
        elif kind == "name":
            atom = ("ref", text)
        elif kind == "call":  # Regex("...", json_string=true): a terminal
            depth = 1
            while depth:
                depth += {"(": 1, ")": -1}.get(self.take()[1], 0)
            atom = True
        elif text == "(=":  # a lookahead matches nothing itself
            self.alternatives()
            self.take(")")
            return None
        elif text == "(":
            atom = self.alternatives()
            self.take(")")
        else:
            raise _Unknown(text)
        suffix = self.peek()
        if suffix is not None and suffix[1] in ("*", "?", "+"):
            self.take()
            return True if suffix[1] in "*?" else atom
        if suffix is not None and suffix[0] == "repeat":
            self.take()
            least = int(suffix[1].strip("{}").split(",")[0])
            return True if least == 0 else atom
        return atom


def _rules(ebnf: str) -> dict[str, object]:
    rules = {}
    for line in ebnf.splitlines():
        if not line.strip():
            continue
        tokens = _tokens(line)
        if len(tokens) < 3 or tokens[0][0] != "name" or tokens[1][1] != "::=":
            raise _Unknown(line[:40])
        parser = _Parser(tokens[2:])
        body = parser.alternatives()
        while parser.peek() is not None:  # a trailing lookahead (=(...))
            if parser.item() is not None:
                raise _Unknown(line[:40])
        rules[tokens[0][1]] = body
    return rules


def productive_rules(rules: dict[str, object]) -> set[str]:
    """The rules some finite text matches. Productivity spreads up from the terminals through
    a graph of the formulas' nodes, each node taken once: linear in the grammar's size (a
    fixed point that re-evaluates every rule per pass is quadratic on a chain of rules, and a
    JSON schema of many ``$defs`` is one)."""
    parents: list[list[int]] = []  # node -> the and/or nodes it is a part of
    ops: list[str] = []  # node -> "and" | "or" | "ref" | "term"
    pending: dict[int, int] = {}  # and-node -> its parts not yet known productive
    users: dict[str, list[int]] = {}  # rule name -> the ref nodes naming it
    rule_of: dict[int, str] = {}  # a rule's body node -> the rule
    ready: list[int] = []  # nodes known productive, not yet spread

    def add(formula, parent: int | None) -> int:
        node = len(ops)
        parents.append([] if parent is None else [parent])
        if formula is True:
            ops.append("term")
            ready.append(node)
            return node
        op, arg = formula
        ops.append(op)
        if op == "ref":
            users.setdefault(arg, []).append(node)
        else:
            if op == "and":
                pending[node] = len(arg)
                if not arg:  # the empty sequence matches ""
                    ready.append(node)
            for part in arg:
                add(part, node)
        return node

    for name, body in rules.items():
        rule_of[add(body, None)] = name
    productive: set[str] = set()
    done = [False] * len(ops)
    while ready:
        node = ready.pop()
        if done[node]:
            continue
        done[node] = True
        name = rule_of.get(node)
        if name is not None and name not in productive:
            productive.add(name)
            ready.extend(users.get(name, ()))
        for parent in parents[node]:
            if ops[parent] == "and":
                pending[parent] -= 1
                if pending[parent]:
                    continue
            ready.append(parent)
    return productive


def _refs(formula, out: set[str]) -> set[str]:
    if formula is not True:
        op, arg = formula
        if op == "ref":
            out.add(arg)
        else:
            for f in arg:
                _refs(f, out)
    return out


def unfinishable_rule(ebnf: str, root: str = "root") -> str | None:
    """The name of a rule reachable from ``root`` that no finite text matches, or None (all
    finish, or the text holds something this check cannot read)."""
    try:
        rules = _rules(ebnf)
    except _Unknown:
        return None
    if root not in rules:
        return None
    productive = productive_rules(rules)
    seen, todo = set(), [root]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        if name not in rules:  # a name this check cannot resolve: no verdict
            return None
        if name not in productive:
            return name
        todo.extend(_refs(rules[name], set()))
    return None
