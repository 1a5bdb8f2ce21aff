"""Caps on the parts of a request that cost the engine far more than their size: output grammars.

A JSON schema, a regular expression, a grammar or a tool's parameters become a grammar the worker
compiles before the request's first token (vLLM's structured outputs, xgrammar by default). Most
compile in milliseconds; a few small ones take minutes. Measured with xgrammar 0.2.8 and a 46k-token
vocabulary (docs/SECURITY.md): the pattern ``(.{0,8}){0,8}`` took 7.8 s, ``(.{0,16}){0,16}`` 91 s, and
schemas grow faster than their size (23 KB: 0.09 s, 184 KB: 1.2 s, 368 KB: 3.8 s). The caps below
refuse those with a 400 naming the parameter, before anything is counted; what they let through
compiles in about a second or less.

These are plain functions over the client's JSON; :mod:`flatfare.gateway.openai.protocol` calls them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping
from typing import Any

import orjson

from flatfare.gateway.errors import APIError, invalid

# One schema (response_format's, structured_outputs', one tool's), serialized compactly.
MAX_SCHEMA_BYTES = 32 * 1024
# All tools together: with tool_choice "required" vLLM compiles them into one schema.
MAX_TOOLS_BYTES = 128 * 1024
MAX_TOOLS = 128
# Objects and arrays inside one another, counted on the JSON document.
MAX_SCHEMA_DEPTH = 32
MAX_GRAMMAR_BYTES = 16 * 1024
MAX_PATTERN_CHARS = 1000
# A counted repetition's bound ({m,n}), and the product of counted repetitions nested in one another.
MAX_REPEAT = 1000
MAX_NESTED_REPEAT = 16

# Fields that carry an output constraint (vLLM's current and removed spellings alike: an older
# engine may still honour the latter).
CONSTRAINT_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                     "guided_grammar", "guided_whitespace_pattern")
_REGEX_KEYS = frozenset(("pattern", "regex", "whitespace_pattern", "guided_regex", "guided_whitespace_pattern"))
_GRAMMAR_KEYS = frozenset(("grammar", "guided_grammar"))
# Keywords whose values are data, not schema: never read as patterns.
_DATA_KEYS = frozenset(("enum", "const", "default", "examples", "example"))
# Keywords whose keys are names (of properties, definitions), each mapping to a schema.
_NAME_MAPS = frozenset(("properties", "$defs", "definitions", "dependentSchemas"))


def check_constraints(fields: Mapping[str, Any]) -> None:
    """Refuse any output constraint among the request's ``fields`` that could stall the engine."""
    for name in CONSTRAINT_FIELDS:
        value = fields.get(name)
        if value is None:
            continue
        if isinstance(value, str):
            _check_text_constraint(name, value, name)
        else:
            check_schema(value, name)


def check_tools(tools: list[dict[str, Any]]) -> None:
    if len(tools) > MAX_TOOLS:
        raise invalid(f"tools has {len(tools)} entries; at most {MAX_TOOLS} are allowed.", param="tools")
    total = 0
    for i, tool in enumerate(tools):
        total += check_schema(tool, f"tools[{i}]")
    if total > MAX_TOOLS_BYTES:
        raise invalid(f"tools take {total} bytes of JSON together; at most {MAX_TOOLS_BYTES} are allowed.",
                      param="tools", code="schema_too_large")


def check_schema(value: Any, param: str) -> int:
    """Size, depth, patterns, grammars and references of one constraint; returns its size in bytes."""
    size = len(orjson.dumps(value))
    if size > MAX_SCHEMA_BYTES:
        raise invalid(f"{param} is {size} bytes of JSON; at most {MAX_SCHEMA_BYTES} are allowed.", param=param,
                      code="schema_too_large")
    for path, key, item in _walk(value, param, 1):
        if key == "$ref" and isinstance(item, str) and not item.startswith("#"):
            raise invalid(f"{path} refers outside the schema ({item[:80]!r}); only local references "
                          "('#/$defs/...') are allowed.", param=path, code="invalid_schema")
        if key == "patternProperties" and isinstance(item, dict):
            for pattern in item:
                check_pattern(pattern, f"{path}[{pattern[:40]!r}]")
        elif isinstance(item, str):
            _check_text_constraint(key, item, path)
    return size


def _check_text_constraint(key: str, text: str, param: str) -> None:
    if key in _REGEX_KEYS:
        check_pattern(text, param)
    elif key in _GRAMMAR_KEYS:
        if len(text.encode()) > MAX_GRAMMAR_BYTES:
            raise invalid(f"{param} is longer than {MAX_GRAMMAR_BYTES} bytes.", param=param, code="grammar_too_large")
    elif key in ("guided_json", "json"):  # a schema sent as JSON text
        if len(text.encode()) > MAX_SCHEMA_BYTES:
            raise invalid(f"{param} is longer than {MAX_SCHEMA_BYTES} bytes.", param=param, code="schema_too_large")
        try:
            schema = orjson.loads(text)
        except orjson.JSONDecodeError:
            return  # not JSON: the engine refuses it itself
        check_schema(schema, param)


def _walk(node: Any, path: str, depth: int, names: bool = False) -> Iterator[tuple[str, str, Any]]:
    """Every (path, key, value) of the objects inside ``node``, refusing nesting past the cap.

    ``names``: the keys of ``node`` are property names (under ``properties``, ``$defs``...), not
    keywords, so none of them is skipped as data."""
    if depth > MAX_SCHEMA_DEPTH:
        raise invalid(f"{path} nests objects and arrays more than {MAX_SCHEMA_DEPTH} deep.", param=path,
                      code="schema_too_deep")
    if isinstance(node, dict):
        for key, value in node.items():
            if not names and key in _DATA_KEYS:
                continue
            child = f"{path}.{key}"
            yield child, key, value
            if isinstance(value, (dict, list)):
                yield from _walk(value, child, depth + 1, names=not names and key in _NAME_MAPS)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            if isinstance(value, (dict, list)):
                yield from _walk(value, f"{path}[{i}]", depth + 1)


def check_pattern(pattern: str, param: str) -> None:
    """A regular expression the engine compiles into a grammar: short, with bounded repetitions."""
    if len(pattern) > MAX_PATTERN_CHARS:
        raise invalid(f"{param} is {len(pattern)} characters long; at most {MAX_PATTERN_CHARS} are allowed.",
                      param=param, code="pattern_too_complex")
    try:
        repeat, nested = repetition_cost(pattern)
    except ValueError as exc:
        raise invalid(f"{param} is not a regular expression the platform can check: {exc}.", param=param,
                      code="invalid_pattern") from None
    if repeat > MAX_REPEAT:
        raise invalid(f"{param} repeats {repeat} times in one quantifier; at most {MAX_REPEAT} are allowed "
                      "(use * or + for open-ended lengths).", param=param, code="pattern_too_complex")
    if nested > MAX_NESTED_REPEAT:
        raise invalid(f"{param} nests counted repetitions that multiply to {nested}; at most "
                      f"{MAX_NESTED_REPEAT} are allowed (a quantifier such as {{0,8}} inside another one "
                      "makes the engine's grammar explode; use * or + in one of them).", param=param,
                      code="pattern_too_complex")


def repetition_cost(pattern: str) -> tuple[int, int]:
    """(largest single bound, largest product of counted repetitions nested in one another).

    A scanner, not a full parser, so that it reads the dialects clients send (JSON Schema's ECMA-262,
    Python's, PCRE's) alike: it knows escapes, character classes, groups and quantifiers, which is all
    the cost depends on. Raises ValueError for unbalanced groups or classes."""
    largest = 0
    # One frame per open group: the largest nested product inside it so far.
    stack: list[int] = [1]
    last = 1  # the product of the atom a quantifier would apply to (1: a plain character)
    worst = 1
    i, n = 0, len(pattern)
    while i < n:
        char = pattern[i]
        if char == "\\":
            i += 2
            if i <= n and pattern[i - 1] in "pPxuk" and i < n and pattern[i] == "{":  # \p{L}, \x{41}, \u{1F600}
                end = pattern.find("}", i)
                if end < 0:
                    raise ValueError("an escape's '{' is never closed")
                i = end + 1
            last = 1
            continue
        if char == "[":
            i = _class_end(pattern, i)
            last = 1
            continue
        if char == "(":
            stack.append(1)
            last = 1
            i += 1
            continue
        if char == ")":
            if len(stack) == 1:
                raise ValueError("a ')' closes no group")
            last = stack.pop()
            stack[-1] = max(stack[-1], last)
            i += 1
            continue
        if char == "{":
            bound, end = _counted(pattern, i)
            if bound is not None:
                largest = max(largest, bound)
                product = bound * last
                if last > 1:  # a counted repetition of something that holds one: they multiply
                    worst = max(worst, product)
                stack[-1] = max(stack[-1], product)
                last = product
                i = end
                continue
        # any other character, or *, +, ? (open-ended loops add no states)
        if char not in "*+?":
            last = 1
        i += 1
    if len(stack) != 1:
        raise ValueError("a '(' is never closed")
    return largest, worst


def _class_end(pattern: str, start: int) -> int:
    """The index after the ``]`` that closes the class opened at ``start``."""
    i = start + 1
    if i < len(pattern) and pattern[i] == "^":
        i += 1
    if i < len(pattern) and pattern[i] == "]":  # a leading ']' is a literal
        i += 1
    while i < len(pattern):
        if pattern[i] == "\\":
            i += 2
            continue
        if pattern[i] == "]":
            return i + 1
        i += 1
    raise ValueError("a '[' is never closed")


def _counted(pattern: str, start: int) -> tuple[int | None, int]:
    """The upper bound of a ``{m}``, ``{m,}``, ``{m,n}`` or ``{,n}`` quantifier at ``start`` (None when
    the brace is a literal), and the index after it. ``{m,}`` counts as m: its open end is a loop."""
    end = pattern.find("}", start)
    if end < 0:
        return None, start + 1
    low, comma, high = (part.strip() for part in pattern[start + 1:end].partition(","))
    if not (low.isdigit() or (comma and high.isdigit())) or (high and not high.isdigit()):
        return None, start + 1
    bound = int(high) if high else int(low)  # {,n} (Python's {0,n}) counts as n
    return max(bound, int(low or 0)), end + 1


def constraint_digest(fields: Mapping[str, Any]) -> str | None:
    """A digest of the grammar the engine would compile for this request, or None when it compiles
    none of its own (plain text, JSON mode, tools with tool_choice "none"). Tools the model may
    ignore (``auto``) count too: vLLM 0.32 compiles their schemas whenever the model's entry sets a
    ``tool_strict_level`` (the default model's does) or a tool is ``strict``."""
    parts: dict[str, Any] = {}
    for name in CONSTRAINT_FIELDS:
        value = fields.get(name)
        if value is None:
            continue
        if name == "response_format" and isinstance(value, dict) and value.get("type") in ("text", "json_object"):
            continue
        if name == "structured_outputs" and isinstance(value, dict) and set(value) <= {"json_object"}:
            continue
        parts[name] = value
    tool_choice = fields.get("tool_choice")
    if fields.get("tools") and tool_choice != "none":
        parts["tools"] = fields["tools"]
        parts["tool_choice"] = tool_choice
    if not parts:
        return None
    return hashlib.sha256(orjson.dumps(parts, option=orjson.OPT_SORT_KEYS)).hexdigest()


def refuse_field(name: str, why: str) -> APIError:
    return invalid(f"{name} is not accepted: {why}", param=name, code="unsupported_parameter")
