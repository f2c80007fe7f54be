"""Structured outputs: grammars compiled from a ``StructuredSpec``, one matcher
per constrained sequence, and the token masks applied to the logits.

Engine: xgrammar, chosen over llguidance for its per-token mask fill time on
SmolLM2's 49,152-token vocabulary (``tools/bench_grammar_engines.py``;
docs/benchmarks.md, "Grammar engine").

Where grammars are compiled: the spec *string* travels (in
``SamplingParams.structured``); prepare compiles it once to refuse a bad one
as the request's 400 before anything reaches the conductor, and every rank
compiles it again with its own bounded cache. We do not ship the compiled
grammar: it carries its token-mask cache (far larger than the spec), would
go to every rank in every ``SeqStart``, and would tie the protocol to the
engine's serialization version; a recompile costs milliseconds, once per
distinct spec per rank (the compiler's cache is an LRU bounded in bytes).

Per-sequence state (``GrammarMatchers``, one per rank): a matcher is made at
``SeqStart`` and fed the outputs the sequence already has, so a sequence
restarted after a preemption resumes with its grammar state; it advances with
each sampled token, which is the same on every rank, so every rank's matchers
agree; it is dropped when the sequence is forgotten (finish or abort).

A grammar that is complete allows only the stop tokens (EOS), so the model
samples one and the scheduler ends the request with ``finish_reason: "stop"``.

A reply that reasons first (``StructuredSpec.reasoning``, vLLM's structured
outputs with a reasoning parser) is free while it thinks: its matcher waits
for ``</think>`` and takes the tokens after it; one not opened in its prompt
may open ``<think>`` as its first token (the mask allows it beside the
grammar's own), else the grammar holds from that token.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from mstar_actors import messages
from mstar_actors.runner import ebnf_text
from mstar_actors.frontend.xml_calls import (FUNCTION_CLOSE, FUNCTION_OPEN, PARAM_CLOSE, PARAM_OPEN, choices, nullable,
                                             resolved, value_type)

log = logging.getLogger(__name__)
COMPILER_CACHE_BYTES = 64 << 20  # compiled grammars kept per process (LRU)
ANY_OBJECT_SCHEMA = '{"type": "object"}'  # response_format json_object
MAX_SCHEMA_TEXTS = 256  # JSON schemas whose grammar text is kept (_json_grammar_text)
# The engine writes the characters of a string with a length bound as this
# class, which lets raw control characters (invalid JSON) through; its plain
# strings exclude them, as JSON requires.
_LOOSE_STRING_CHAR = ebnf_text.normalized(r'[^\"\\\r\n]')
_JSON_STRING_CHAR = ebnf_text.normalized(r'[^\0-\x1f\"\\\r\n]')
# "[13:34:24] /project/cpp/x.cc:94: " of the engine's errors, first or inside (a Lark error quoting a regex's)
_ENGINE_PREFIX = re.compile(r"\[[\d:]+\] \S+:\d+: ")


class GrammarError(ValueError):
    """A spec the engine refuses; ``reason`` is the engine's own words."""

    def __init__(self, kind: str, reason: str):
        super().__init__(f"invalid {kind} for structured output: {reason}")
        self.kind = kind
        self.reason = reason


class GrammarEngineError(RuntimeError):
    """The grammar engine is missing or broken: the server can't start."""


def _xgr() -> Any:
    try:
        import xgrammar
    except Exception as err:  # ImportError, or a broken native library
        raise GrammarEngineError(f"structured outputs need xgrammar (pip install xgrammar): {type(err).__name__}: {err}") from None
    return xgrammar


def tokenizer_info(tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int]) -> Any:
    """The engine's view of a Hugging Face tokenizer, padded to the model's ``vocab_size`` (the logits' width)."""
    return _xgr().TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=list(eos_token_ids))


def raw_tokenizer_info(vocab: list[str], eos_token_ids: Iterable[int]) -> Any:
    """A tokenizer of literal token strings (tests, the start check)."""
    return _xgr().TokenizerInfo(vocab, vocab_size=len(vocab), stop_token_ids=list(eos_token_ids))


def load_matchers(info: Any, device: torch.device | str = "cpu", max_rows: int = 1) -> GrammarMatchers:
    """A rank's matchers for the model of ``info`` (a ``ModelInfo``), from its
    tokenizer, masking logits on ``device`` for up to ``max_rows`` rows a step
    (more grow the buffers); on CUDA the masking kernel is warmed here."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(info.model_dir, local_files_only=True)
    compiler = GrammarCompiler(tokenizer_info(tokenizer, info.vocab_size, info.eos_token_ids))
    matchers = GrammarMatchers(compiler, device=device, max_rows=max_rows)
    matchers.warm_up()
    return matchers


def check_engine() -> None:
    """Compile and match a small schema on a toy vocabulary; GrammarEngineError in one line if that fails."""
    try:
        compiler = GrammarCompiler(raw_tokenizer_info(["<eos>", "{", "}", '"', "a", ":", "1", " "], [0]))
        grammar = compiler.compile(messages.StructuredSpec("json", '{"type": "object", "properties": {"a": {"type": "integer"}}}'))
        matcher = _xgr().GrammarMatcher(grammar)
        if not all(matcher.accept_token(t) for t in (1, 2)):
            raise RuntimeError("the matcher refused '{}' for an object schema")
    except GrammarEngineError:
        raise
    except Exception as err:
        raise GrammarEngineError(f"the grammar engine (xgrammar) is broken: {type(err).__name__}: {err}") from None


class GrammarCompiler:
    """Compiles specs for one vocabulary; the engine caches each distinct spec (LRU, bounded in bytes)."""

    def __init__(self, info: Any, *, max_threads: int = 1, cache_bytes: int = COMPILER_CACHE_BYTES):
        self.info = info
        self.vocab_size = info.vocab_size
        self.compiler = _xgr().GrammarCompiler(info, max_threads=max_threads, cache_enabled=True,
                                               cache_limit_bytes=cache_bytes)

    def compile(self, spec: messages.StructuredSpec) -> Any:
        """The compiled grammar of ``spec``; GrammarError naming the reason when
        it is invalid, or when no output can satisfy it (no token, nor the
        end, may come first: a language with no text, or none this
        vocabulary spells), which sampling would otherwise meet with every
        token masked."""
        # (as our text: the engine's cache keys a grammar by its printed text and compiles that, whose \xHH
        # escapes its own parser misreads before a hex digit, "ü" then "b" as U+FCB)
        compiled = _engine_reasons(spec, lambda: self.compiler.compile_grammar(_text_of(self._grammar(spec))))
        bitmask = _xgr().allocate_token_bitmask(1, self.vocab_size)
        _xgr().GrammarMatcher(compiled).fill_next_token_bitmask(bitmask)
        logits = torch.zeros((1, self.vocab_size))
        _xgr().apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size)
        if not bool((logits[0] == 0).any()):
            raise GrammarError(spec.kind, "no output satisfies it: no token of this model's vocabulary, nor the "
                                          "end of the output, may come first (a pattern no text matches, or only "
                                          "text this vocabulary cannot spell)")
        return compiled

    def check(self, spec: messages.StructuredSpec) -> None:
        """GrammarError where ``compile`` would refuse ``spec``, found from its
        grammar alone (tens of ms for a schema whose compile takes seconds):
        the token masks over the vocabulary are the compile's cost, and the
        ranks pay it beside their steps (``CompileGrammar``)."""
        _engine_reasons(spec, lambda: self._grammar(spec))

    @staticmethod
    def _grammar(spec: messages.StructuredSpec) -> Any:
        """``spec``'s rules, as the engine's grammar (or its text)."""
        match spec.kind:
            case "json":
                return _schema_rules(json.loads(spec.spec), spec.spec)
            case "json_object":
                return _json_grammar_text(ANY_OBJECT_SCHEMA)
            case "json_calls":
                calls = json.loads(spec.spec)
                return _repeated(_schema_rules(calls["schema"]), calls["separator"], calls.get("end", ""))
            case "xml_calls":
                calls = json.loads(spec.spec)
                grammar = _union([_xml_call(f["name"], f["parameters"]) for f in calls["functions"]])
                return _repeated(str(grammar), calls["separator"], calls["end"]) if calls["repeat"] else grammar
            case "tagged_calls":
                return _tagged_calls(json.loads(spec.spec))
            case "regex":
                return _xgr().Grammar.from_regex(_user_regex(spec.spec, "the regex"))
            case "choice":
                return _xgr().Grammar.from_regex("|".join(_escape_regex(c) for c in parse_choices(spec.spec)))
            case "grammar":
                if (problem := _escape_problem(spec.spec, "the grammar")) is not None:
                    raise GrammarError("grammar", problem)
                try:
                    return _xgr().Grammar.from_ebnf(spec.spec)
                except Exception as err:
                    if not _LARK_RULE.search(spec.spec):
                        raise GrammarError("grammar", _reason(err)) from None
                    try:  # a Lark grammar (vLLM reads both)
                        return _xgr().Grammar.from_lark(spec.spec)
                    except Exception as lark_err:
                        raise GrammarError("grammar", _reason(lark_err) + _LARK_HINT) from None
        raise GrammarError(spec.kind, "unknown kind; accepted are json, json_object, regex, choice, grammar, "
                                      "json_calls, xml_calls, tagged_calls")


def _engine_reasons(spec: messages.StructuredSpec, work: Any) -> Any:
    """``work()``, the engine's errors (RuntimeError / ValueError with its reason) as GrammarError."""
    try:
        return work()
    except GrammarError:
        raise
    except Exception as err:
        raise GrammarError(spec.kind, _reason(err)) from None


# JSON Schema keywords the engine drops without a word (its grammar would let
# output through that breaks them): a schema naming one is refused. ``allOf``
# of one branch, ``uniqueItems: false`` and "#..." references are enforced.
UNENFORCED_KEYWORDS = ("not", "if", "then", "else", "dependentRequired", "dependentSchemas", "dependencies",
                       "unevaluatedProperties", "unevaluatedItems", "contains", "minContains", "maxContains",
                       "multipleOf", "$dynamicRef", "$recursiveRef")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")  # name -> schema
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_VALUES = ("items", "additionalProperties", "propertyNames", "additionalItems")


# Keywords that only describe: beside a keyword that replaces the rest of its
# schema ($ref, enum, const, anyOf, oneOf, allOf), the engine dropping them changes nothing.
ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$comment", "deprecated", "readOnly",
                         "writeOnly", "$schema", "$id", "discriminator", "$defs", "definitions"})
_REPLACING = ("$ref", "enum", "const", "anyOf", "oneOf", "allOf")  # the engine reads only these where they stand
_LOOKAROUND = re.compile(r"\(\?<?[=!]")
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")
_TYPE_OF = {"string": str, "boolean": bool, "null": type(None), "object": dict, "array": list}


def unenforced_keyword(schema: Any, where: str = "the schema", root: Any = None, names: bool = False) -> str | None:
    """Why the engine could not enforce ``schema`` (a keyword it would drop,
    named with where it stands), or None when it can. ``names``: a
    ``propertyNames`` schema, which the engine reads as a string's."""
    if not isinstance(schema, dict):
        return None
    root = schema if root is None else root
    problem = _names_problem(schema, where, root) if names else _typeless_problem(schema, where)
    if problem is not None:
        return problem
    if (problem := _own_problem(schema, where, root)) is not None:
        return problem
    for key, sub_where, sub in _subschemas(schema, where):
        if (problem := unenforced_keyword(sub, sub_where, root, names=key == "propertyNames")) is not None:
            return problem
    return None


def _subschemas(schema: dict, where: str) -> Iterator[tuple[str, str, Any]]:
    """(keyword, where, schema) of each schema ``schema`` holds (not its
    enum / const values, which are data)."""
    for key in _SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            for name, sub in schema[key].items():
                yield key, f"{where}'s {key}[{name!r}]", sub
    for key in _SCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            for i, sub in enumerate(schema[key]):
                yield key, f"{where}'s {key}[{i}]", sub
    for key in _SCHEMA_VALUES:
        if key in schema:
            yield key, f"{where}'s {key}", schema[key]


# Keywords of one type's values, the type as a schema names it, and the keywords
# beside which the engine infers that type itself: without a "type" or one of
# those, it applies none of them (any JSON value passes).
_TYPED_KEYWORDS = (
    ('"string"', ("pattern", "format", "minLength", "maxLength"), ()),
    ('"number" or "integer"', ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"), ()),
    ('"array"', ("minItems", "maxItems"), ("items", "prefixItems")),
    ('"object"', ("minProperties", "maxProperties", "patternProperties", "propertyNames"),
     ("properties", "additionalProperties")),
)


def _typeless_problem(schema: dict, where: str) -> str | None:
    if "type" in schema or any(k in schema for k in _REPLACING):
        return None
    for wanted, keys, inferred_from in _TYPED_KEYWORDS:
        found = [k for k in keys if k in schema]
        if found and not any(k in schema for k in inferred_from):
            return (f"{where} has {found[0]!r} but no 'type', which the engine needs to apply it (any JSON value "
                    f"would pass); add \"type\": {wanted}")
    return None


def _names_problem(schema: dict, where: str, root: dict) -> str | None:
    """A ``propertyNames`` schema: the engine writes a key as its own schema
    reads, so each choice it lists (enum, const, anyOf / oneOf / allOf
    branches, a $ref) must be a string's."""
    choices = [schema] if any(k in schema for k in ("enum", "const", "$ref")) else []
    for key in ("anyOf", "oneOf", "allOf"):
        if isinstance(schema.get(key), list):
            choices += schema[key]
    for choice in choices:
        if not _is_string_schema(choice, root):
            return (f"{where} lists {json.dumps(choice)[:80]}, which allows values that are not strings, and a "
                    "property name is one; give each choice \"type\": \"string\" and no other values (or only "
                    "string const / enum values)")
    return None


def _is_string_schema(schema: Any, root: dict) -> bool:
    """Whether ``schema`` (its "#..." reference followed) allows strings alone."""
    schema = _resolve(schema, root)
    if not isinstance(schema, dict):
        return False
    if "const" in schema:
        return isinstance(schema["const"], str)
    if "enum" in schema:
        return isinstance(schema["enum"], list) and all(isinstance(v, str) for v in schema["enum"])
    branches = [b for key in ("anyOf", "oneOf", "allOf") if isinstance(schema.get(key), list) for b in schema[key]]
    if branches:
        return all(_is_string_schema(b, root) for b in branches)
    return schema.get("type") == "string"


def _own_problem(schema: dict, where: str, root: dict) -> str | None:
    """``unenforced_keyword`` of the keywords of ``schema`` itself."""
    for key in UNENFORCED_KEYWORDS:
        if key in schema:
            return (f"{where} uses {key!r}, which is not enforced here; accepted keywords: type, properties, "
                    "required, additionalProperties, items, prefixItems, enum, const, anyOf, oneOf, $ref/$defs, "
                    "pattern, format, lengths, bounds and counts")
    for key in ("anyOf", "oneOf", "allOf", "type", "enum"):
        if schema.get(key) == []:
            return f"{where} has an empty {key!r}: no value satisfies it; list at least one"
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        return (f"{where} uses 'allOf' of {len(schema['allOf'])} schemas, which is not enforced here; "
                "merge them into one")
    if isinstance(schema.get("items"), list):
        return (f"{where} has 'items' as an array (draft 7's tuple form), which is not read here; give "
                "'prefixItems' (and 'items': false for 'additionalItems': false)")
    if schema.get("uniqueItems") is True:
        return f"{where} uses 'uniqueItems', which is not enforced here"
    if schema.get("format") in UNENFORCED_FORMATS:
        return (f"{where} has format {schema['format']!r}, which is not enforced here; enforced formats: "
                f"{', '.join(ENFORCED_FORMATS)} (or give a pattern)")
    ref = schema.get("$ref")
    if isinstance(ref, str) and not (ref == "#" or ref.startswith("#/")):
        return (f"{where} refers to {ref!r}; only JSON-pointer references inside the schema (\"#/$defs/...\") "
                "are resolved here")
    if (problem := _replaced_siblings(schema, where)) is not None:
        return problem
    if isinstance(schema.get("oneOf"), list) and not _exclusive(schema["oneOf"], root):
        return (f"{where} uses 'oneOf' whose branches can match the same value: it is enforced as anyOf here; "
                "use anyOf, or tell the branches apart (each a different type, or a required property whose "
                "const / enum values differ)")
    for key in ("exclusiveMinimum", "exclusiveMaximum"):
        if isinstance(schema.get(key), bool):
            return f"{where} has {key}: {schema[key]} (draft 4's form); give the bound itself, as {key}: <number>"
    for key in _COUNTS:
        value = schema.get(key)
        if key in schema and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            return f"{where} has {key}: {value!r}; expected a non-negative integer"
    if (problem := _pattern_problem(schema, where)) is not None:
        return problem
    if (problem := _count_problem(schema, where)) is not None:
        return problem
    if (problem := _overlap_problem(schema, where)) is not None:
        return problem
    required, properties = schema.get("required"), schema.get("properties")
    if isinstance(required, list) and required and schema.get("patternProperties"):
        return (f"{where} has 'required' beside 'patternProperties', which drops it here; name the required "
                "properties under 'properties'")
    if isinstance(required, list):
        missing = [name for name in required if not isinstance(properties, dict) or name not in properties]
        if missing:
            return f"{where} requires {missing!r}, which its 'properties' does not define; define each required one"
    return None


def _overlap_problem(schema: dict, where: str) -> str | None:
    """A property ``properties`` names whose key ``patternProperties`` or ``propertyNames`` also matches: the
    engine may write that key as one of the pattern's (JSON Schema holds its value to both schemas; the engine
    to the pattern's alone)."""
    properties = schema.get("properties")
    if not isinstance(properties, dict) or not properties:
        return None
    patterns = [(key, p) for key, p in _own_patterns(schema) if key == "patternProperties"]
    names = schema.get("propertyNames")
    if isinstance(names, dict) and isinstance(names.get("pattern"), str) and schema.get("additionalProperties",
                                                                                           True) is not False:
        patterns.append(("propertyNames", names["pattern"]))
    for key, pattern in patterns:
        try:
            compiled = re.compile(pattern)
        except re.error:
            continue  # the engine names it
        if (name := next((n for n in properties if compiled.search(n)), None)) is not None:
            return (f"{where}'s properties[{name!r}] also matches {key} {pattern!r}: the engine may write it as "
                    f"one of those keys, its value held to their schema alone (JSON Schema holds it to both); "
                    f"narrow the pattern to leave out the named properties, or rename them")
    return None


def _count_problem(schema: dict, where: str) -> str | None:
    """Property and item counts the engine cannot keep. It counts the keys it
    writes, and may repeat one it does not name (patternProperties,
    propertyNames, additionalProperties): a maxProperties holds, a
    minProperties past 1 may not. ``additionalProperties`` and ``items`` are
    false unless given (as OpenAI's strict mode), which the engine's own
    refusal of a count past them does not say."""
    minimum = schema.get("minProperties")
    extra = schema.get("additionalProperties", False)
    free_keys = "patternProperties" in schema or "propertyNames" in schema or extra is not False
    if isinstance(minimum, int) and minimum > 1 and free_keys:
        return (f"{where} has minProperties: {minimum} over keys beside 'properties' (patternProperties, "
                "propertyNames or additionalProperties), which may repeat a key here and so is not enforced; "
                "name the properties under 'properties'")
    properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    if isinstance(minimum, int) and minimum > len(properties) and not free_keys:
        return (f"{where} has minProperties: {minimum} but its 'properties' define {len(properties)}, and no "
                "other key is written (additionalProperties is false unless given); define enough properties")
    prefix = schema.get("prefixItems")
    if (isinstance(prefix, list) and "items" not in schema and isinstance(schema.get("minItems"), int)
            and schema["minItems"] > len(prefix)):
        return (f"{where} has minItems: {schema['minItems']} but {len(prefix)} prefixItems and no 'items': items past "
                "prefixItems are not written unless 'items' gives their schema; give one")
    return None


def _replaced_siblings(schema: dict, where: str) -> str | None:
    """A keyword beside one the engine reads alone ($ref, enum, ...), where it would be dropped."""
    replacing = next((k for k in _REPLACING if k in schema), None)
    if replacing is None:
        return None
    dropped = [k for k in schema if k not in _REPLACING and k not in ANNOTATIONS and k != "type"]
    values = (schema["enum"] if isinstance(schema.get("enum"), list) else [schema["const"]] if "const" in schema
              else None)
    if "type" in schema and not (values is not None and all(_has_type(v, schema["type"]) for v in values)):
        dropped.insert(0, "type")  # beside enum / const, a type every value has already changes nothing
    others = [k for k in _REPLACING if k in schema and k != replacing]
    if dropped or others:
        return (f"{where} has {', '.join(repr(k) for k in others + dropped)} beside {replacing!r}, which the engine "
                f"reads alone there (the rest would be dropped); move them into the schema it refers to or lists")
    return None


def _has_type(value: Any, types: Any) -> bool:
    for name in types if isinstance(types, list) else [types]:
        if name in ("integer", "number"):
            if isinstance(value, (int, float)) and not isinstance(value, bool) and (
                    name == "number" or float(value).is_integer()):
                return True
        elif name in _TYPE_OF and isinstance(value, _TYPE_OF[name]):
            return True
    return False


def _own_patterns(schema: dict) -> list[tuple[str, str]]:
    """(keyword, pattern) of ``schema``'s own patterns: its ``pattern``, its ``patternProperties`` keys."""
    patterns = [("pattern", schema["pattern"])] if isinstance(schema.get("pattern"), str) else []
    if isinstance(schema.get("patternProperties"), dict):
        patterns += [("patternProperties", p) for p in schema["patternProperties"]]
    return patterns


def _pattern_problem(schema: dict, where: str) -> str | None:
    for key, pattern in _own_patterns(schema):
        if _LOOKAROUND.search(pattern):
            return f"{where}'s {key} {pattern!r} has a lookaround, which is not enforced here"
        if (problem := _escape_problem(pattern, f"{where}'s {key} {pattern!r}")) is not None:
            return problem
        raw = _writes_raw(pattern)
        if raw == "class" and not pattern.isascii():
            return (f"{where}'s {key} {pattern!r} holds a character outside ASCII beside a class that takes a "
                    "quote, a backslash or a control character ('.', a negated class, \\s): the engine writes "
                    "such a pattern's classes as they are, and the output would not be valid JSON; leave those "
                    "characters out of the class (e.g. [^,] as [^,\"\\\\\\x00-\\x1f]) or the pattern's "
                    "character outside ASCII out")
        if raw is not None:
            return (f"{where}'s {key} {pattern!r} matches only strings with a quote, a backslash or a control "
                    "character of a class, which is not enforced correctly here (the output would not be valid "
                    "JSON); leave them out (a control character outside a class, such as \\n, is enforced)")
    if "pattern" in schema and schema.get("format") in ENFORCED_FORMATS:
        return (f"{where} has a pattern beside format {schema['format']!r}: the format's rule is enforced here "
                "and the pattern dropped; give one of them (a pattern may spell the format's shape too)")
    if ("pattern" in schema or "format" in schema) and ("minLength" in schema or "maxLength" in schema):
        kind = "pattern" if "pattern" in schema else "format"
        return (f"{where} has minLength / maxLength beside {kind!r}, which drops them here; put the lengths in "
                "the pattern")
    return None


@functools.lru_cache(maxsize=256)
def _writes_raw(pattern: str) -> str | None:
    """Where the engine's rules of a JSON string of ``pattern`` may write a quote, a backslash or a class's
    control character as itself: ``"literal"`` (one of its literals holds one), ``"class"`` (one of its
    classes takes one), or None. Its automaton of a pattern leaves them out; a pattern that matches nothing
    without one, or one with a character outside ASCII, is written as rules of its own classes and literals,
    as they are (``_json_grammar_text`` writes a literal's control characters as their escapes)."""
    string = json.dumps({"type": "string", "pattern": pattern})
    try:
        if "Regex(" in str(_xgr().Grammar.from_json_schema(string, any_whitespace=False)):
            return None
        text = str(_xgr().Grammar.from_regex(pattern))
    except RuntimeError:  # a pattern the engine refuses: its own error, where the schema is compiled
        return None
    if any('"' in literal or "\\" in literal for literal in ebnf_text.literals(text)):
        return "literal"
    return "class" if ebnf_text.classes_meet(text, _JSON_ESCAPED) else None


def _exclusive(branches: list, root: dict) -> bool:
    """Whether no value can match two of ``branches``: each a different type, or
    all objects telling themselves apart by a required property's const / enum."""
    resolved = [_resolve(b, root) for b in branches]
    if not all(isinstance(b, dict) for b in resolved):
        return False
    values = [_listed_values(b) for b in resolved]
    if all(v is not None for v in values) and len(set().union(*values)) == sum(len(v) for v in values):
        return True  # each a const or enum, none sharing a value
    types = [b.get("type") for b in resolved]
    distinct = all(isinstance(t, str) for t in types) and len(set(types)) == len(types)
    if distinct and not {"integer", "number"} <= set(types):
        return True
    for name in set.intersection(*(set(b.get("required") or ()) for b in resolved)) if resolved else ():
        seen: set = set()
        for b in resolved:
            keys = _listed_values(_resolve((b.get("properties") or {}).get(name), root))
            if keys is None or keys & seen:
                break
            seen |= keys
        else:
            return True
    return False


def _listed_values(schema: Any) -> set[str] | None:
    """The values a const / enum schema lists (as JSON text; a number as its
    value: 1 and 1.0 are one), or None for any other schema."""
    if not isinstance(schema, dict):
        return None
    values = [schema["const"]] if "const" in schema else schema.get("enum")
    if not isinstance(values, list):
        return None
    return {_value_key(v) for v in values}


def _value_key(value: Any) -> str:
    """A JSON value as a key that JSON Schema's equality keeps: 1, 1.0 and
    -0.0 / 0 alike, in lists and objects too."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (int, float)):  # exact: an integral float as its integer (1.0 is 1, -0.0 is 0)
        return str(int(value)) if isinstance(value, int) or value.is_integer() else repr(value)
    if isinstance(value, list):
        return "[" + ",".join(_value_key(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{json.dumps(k)}:{_value_key(v)}" for k, v in sorted(value.items())) + "}"
    return repr(value)


def _resolve(schema: Any, root: dict) -> Any:
    """``schema``, its "#/..." reference followed (a few times at most)."""
    for _ in range(8):
        if not isinstance(schema, dict) or not isinstance(schema.get("$ref"), str):
            return schema
        node: Any = root
        for part in schema["$ref"].removeprefix("#").strip("/").split("/") if schema["$ref"] != "#" else []:
            part = part.replace("~1", "/").replace("~0", "~")
            node = node.get(part) if isinstance(node, dict) else None
        schema = node
    return schema


# Formats whose engine rule lets through what the format forbids, as patterns:
# the engine's ipv4 takes an octet's leading zeros ("010", read as octal by some).
_OCTET = r"(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
FORMAT_PATTERNS = {"ipv4": rf"^({_OCTET}\.){{3}}{_OCTET}$"}
# JSON Schema's formats the engine lets any string through for (refused, named); a format outside the
# vocabulary is an annotation, as the specification reads it, and passes as one.
ENFORCED_FORMATS = ("date", "time", "date-time", "duration", "email", "hostname", "ipv4", "ipv6", "uuid", "uri",
                    "uri-reference", "uri-template", "json-pointer", "relative-json-pointer")
UNENFORCED_FORMATS = ("idn-email", "idn-hostname", "iri", "iri-reference", "regex")


def _with_format_patterns(schema: Any) -> Any:
    """``schema`` with each ``FORMAT_PATTERNS`` format as its pattern (a copy;
    the rest of the schema as it is)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if out.get("format") in FORMAT_PATTERNS and "pattern" not in out:
        out["pattern"] = FORMAT_PATTERNS[out.pop("format")]
    for key in _SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            out[key] = {name: _with_format_patterns(sub) for name, sub in schema[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            out[key] = [_with_format_patterns(sub) for sub in schema[key]]
    for key in _SCHEMA_VALUES:
        if key in schema:
            out[key] = _with_format_patterns(schema[key])
    return out


@functools.lru_cache(maxsize=MAX_SCHEMA_TEXTS)
def _json_grammar_text(schema: str) -> str:
    """The engine's grammar of ``schema`` (no free whitespace: a small model
    would fill it, formats ``FORMAT_PATTERNS`` names as their patterns), with
    its length-bounded strings made valid JSON, and a pattern's control
    characters written as their escapes (the engine writes a pattern all
    literal, such as ``^a\\nb$``, as its raw characters)."""
    if "ipv4" in schema:
        schema = json.dumps(_with_format_patterns(json.loads(schema)))
    text = _printed(_xgr().Grammar.from_json_schema(schema, any_whitespace=False))
    return ebnf_text.map_literals(text.replace(_LOOSE_STRING_CHAR, _JSON_STRING_CHAR),
                                  lambda t: _CONTROL.sub(lambda m: json.dumps(m[0])[1:-1], t))


_CONTROL = re.compile("[\x00-\x1f]")


def _tagged_calls(calls: dict) -> Any:
    """Any text, but from ``trigger`` on a tag's call to its end (the engine's triggered tags): a JSON
    call's schema (``_json_grammar_text``'s rules, as a forced call's) or an XML call's (``_xml_call``);
    with an ``answer``, that answer's rule or text with at least one call. ``bare`` calls (Llama 3's):
    the reply is its calls, or text that opens with no ``{`` (with an ``answer``, that answer)."""
    if "bare" in calls:
        return _bare_calls(calls)
    tags = []
    for tag in calls["tags"]:
        if "functions" in tag:
            content = str(_union([_xml_call(f["name"], f["parameters"]) for f in tag["functions"]]))
        else:
            content = _schema_rules(tag["schema"])
        tags.append({"type": "tag", "begin": tag["begin"], "end": tag["end"],
                     "content": {"type": "grammar", "grammar": content}})
    answer = calls.get("answer")
    triggered = {"type": "triggered_tags", "triggers": [calls["trigger"]], "tags": tags,
                 "at_least_one": answer is not None, "stop_after_first": calls["one"]}
    if answer is not None:  # the answer's own rule, or text with a call in it (the engine's tags take none first)
        rule = _printed(GrammarCompiler._grammar(messages.StructuredSpec(answer["kind"], answer["spec"])))
        with_calls = {"type": "sequence", "elements": [{"type": "any_text", "excludes": [calls["trigger"]]},
                                                       triggered]}
        triggered = {"type": "or", "elements": [with_calls, {"type": "grammar", "grammar": rule}]}
    return _xgr().Grammar.from_structural_tag(json.dumps({"type": "structural_tag", "format": triggered}))


def _bare_calls(calls: dict) -> Any:
    bare = calls["bare"]
    call = _schema_rules(bare["schema"])
    calls_rule = _xgr().Grammar.concat(
        _xgr().Grammar.from_ebnf(_SPACE), _xgr().Grammar.from_ebnf(call) if calls["one"] else _repeated(
            call, bare["separator"]))
    answer = calls.get("answer")
    other = _printed(GrammarCompiler._grammar(messages.StructuredSpec(answer["kind"], answer["spec"]))) if answer \
        else _text_not_a_call(bare["tag"])
    return _union([calls_rule, _xgr().Grammar.from_ebnf(other)])


_SPACE = r'root ::= [ \t\n\r]*'


@functools.cache
def _python_spaces() -> ebnf_text.Ranges:
    """The characters ``str.isspace`` takes (those ``str.strip`` strips)."""
    return [(c, c) for c in range(0x110000) if chr(c).isspace()]


def _text_not_a_call(tag: str) -> str:
    """A reply Llama 3's reader takes as text (``tool_calls.parse_llama3_calls``): none, or one whose first
    character past its spaces (Python's, as the reader strips them) is no "{", nor ``tag`` then spaces, "{"."""
    spaces = _python_spaces()

    def but(chars: str, also: ebnf_text.Ranges = ()) -> str:  # a character not in ``chars`` (nor ``also``)
        return ebnf_text.class_text(True, [*also, *((ord(c), ord(c)) for c in chars)])

    partial = [f'{ebnf_text.literal(tag[:k])} ("" | {but(tag[k])} rest)' for k in range(1, len(tag))]
    return "\n".join([
        f"root ::= {ebnf_text.class_text(False, spaces)}* (\"\" | {but('{' + tag[0], spaces)} rest | tagged)",
        "rest ::= [\\0-\\U0010ffff]*",
        f"tagged ::= {' | '.join(partial)} | {ebnf_text.literal(tag)} {ebnf_text.class_text(False, spaces)}* "
        f"(\"\" | {but('{', spaces)} rest)"])


def _schema_rules(schema: Any, text: str | None = None) -> str:
    """The engine's rules of a JSON schema (``_json_grammar_text``; ``text``: its JSON as sent), a keyword
    it would drop refused by name first (clearer than the engine's own errors)."""
    problem = unenforced_keyword(schema)
    if problem is not None:
        raise GrammarError("json", problem)
    return _json_grammar_text(json.dumps(schema) if text is None else text)


def _union(grammars: list[Any]) -> Any:
    return grammars[0] if len(grammars) == 1 else _xgr().Grammar.union(*grammars)


def _literal(text: str) -> Any:
    return _xgr().Grammar.from_ebnf(f"root ::= {ebnf_text.literal(text)}")


def _printed(grammar: Any) -> str:
    """An engine grammar's text, to be read back by the engine (``ebnf_text.normalized``)."""
    return ebnf_text.normalized(str(grammar))


def _text_of(grammar: Any) -> str:
    return grammar if isinstance(grammar, str) else _printed(grammar)


def _text_without(word: str) -> str:
    """EBNF of any text in which ``word`` (its first character found nowhere else in it) never occurs: the
    states of a search for it, by how much of it was just read."""
    first, n = word[0], len(word)
    assert first not in word[1:]

    def but(*chars: str) -> str:
        return ebnf_text.class_text(True, [(ord(c), ord(c)) for c in chars])

    literal = ebnf_text.literal
    rules = [f'xt0 ::= "" | {but(first)} xt0 | {literal(first)} xt1']
    for k in range(1, n):
        on = f" | {literal(word[k])} xt{k + 1}" if k + 1 < n else ""  # (all of it: no way on)
        rules.append(f'xt{k} ::= "" | {literal(first)} xt1{on} | {but(first, word[k])} xt0')
    return "root ::= xt0\n" + "\n".join(rules)


# A qwen3_coder value's text: anything its closing tag is not in (a forced call's reader ends a value at it alone)
_XML_TEXT = _text_without(PARAM_CLOSE)
# A JSON string's character inside a value: "<" as its escape (one character of a length-bounded string too)
_XML_JSON_STRING_CHAR = '([^\\0-\\x1f\\"\\\\\\r\\n<] | "\\\\u003c")'
_XML_REF = re.compile(r"^#/(\$defs|definitions)/")
_XML_KEY = re.compile(r"[^\s<>](?:[^<>\n]*[^\s<>])?")  # a key the reader reads back as written
_XML_OBJECT_KEYWORDS = ("minProperties", "maxProperties", "patternProperties", "propertyNames")


def _xml_call(name: str, parameters: Any) -> Any:
    """One ``qwen3_coder`` call of function ``name`` (``frontend.xml_calls``): ``<function=NAME>``, then
    each of its schema's properties in order as ``<parameter=KEY>\\nVALUE\\n</parameter>\\n`` (a required one
    always, the others optional; an object schema of no ``properties`` key, or one whose
    ``additionalProperties`` is given and not false, any number of keys, as the JSON formats' grammar reads it:
    ``"properties": {}`` alone, none), then
    ``</function>``. A value is what the reader types it back to (``xml_calls.read_value``): a string's
    its text (its enum, const, pattern or lengths kept), another type's its schema's JSON; a schema the
    format cannot hold to is refused, named."""
    if not isinstance(parameters, dict):
        parameters = {}
    _schema_rules(parameters)  # the keywords refused and the engine's reading of the schema, as JSON calls get
    refs = set(re.findall(r'"\$ref":\s*"([^"]*)"', json.dumps(parameters)))
    if any(not _XML_REF.match(ref) for ref in refs):
        raise GrammarError("json", "a $ref other than into #/$defs or #/definitions is not enforced in the "
                                   "qwen3_coder format's calls")
    if _lists_closing_tag(parameters):
        raise GrammarError("json", f"an enum or const value holds {PARAM_CLOSE}, which ends a value in the "
                                   f"qwen3_coder format's calls: the value would be read back cut there")
    if (keyword := next((k for k in ("anyOf", "oneOf", "allOf") if k in parameters), None)) is not None:
        raise GrammarError("json", f"a call's {keyword} at the top of its parameters is not enforced in the "
                                   "qwen3_coder format's calls (a call writes its schema's properties): name "
                                   "the properties at the top, a union inside one")
    if (keyword := next((k for k in _XML_OBJECT_KEYWORDS if k in parameters), None)) is not None:
        raise GrammarError("json", f"{keyword} is not enforced in the qwen3_coder format's calls (a call writes "
                                   f"its schema's properties)")
    defs = {key: parameters[key] for key in ("$defs", "definitions") if key in parameters}
    required = set(parameters.get("required") or ())
    properties = parameters.get("properties") or {}
    pieces = [_literal(f"{FUNCTION_OPEN}{name}>\n")]
    for key, schema in properties.items():
        if not _XML_KEY.fullmatch(key):
            raise GrammarError("json", f"properties[{key!r}]: a key with '<', '>', a line break or space at its "
                                       f"ends cannot be written in the qwen3_coder format's calls")
        value = _xml_value(schema if isinstance(schema, dict) else {}, defs, key)
        param = _xgr().Grammar.concat(_literal(f"{PARAM_OPEN}{key}>\n"), value, _literal(f"\n{PARAM_CLOSE}\n"))
        pieces.append(param if key in required else _xgr().Grammar.union(param, _literal("")))
    if not properties and parameters.get("additionalProperties", "properties" not in parameters) is not False:
        any_keys = f'root ::= ("{PARAM_OPEN}" [A-Za-z_] [A-Za-z0-9_.\\-]* ">\\n" text "\\n{PARAM_CLOSE}\\n")*\n'
        pieces.append(_xgr().Grammar.from_ebnf(any_keys + _XML_TEXT.replace("root ::= xt0", "text ::= xt0")))
    pieces.append(_literal(FUNCTION_CLOSE))
    return _xgr().Grammar.concat(*pieces)


def _lists_closing_tag(schema: Any) -> bool:
    """Whether an ``enum`` or ``const`` anywhere in ``schema`` writes ``</parameter>``."""
    if isinstance(schema, list):
        return any(_lists_closing_tag(item) for item in schema)
    if not isinstance(schema, dict):
        return False
    listed = [schema[k] for k in ("enum", "const") if k in schema]
    return PARAM_CLOSE in json.dumps(listed) or any(_lists_closing_tag(v) for k, v in schema.items()
                                                    if k not in ("enum", "const"))


def _xml_value(schema: dict, defs: dict, key: str) -> Any:
    """A parameter's value: a string's text (its choices, pattern, format or lengths), or the JSON of any
    other type's schema (with the tool's definitions); ``null`` beside a string's where the schema takes
    it; a schema of no one type, which the reader reads as text, only where text is its value. References
    and branches are followed as the reader follows them (``xml_calls.resolved``)."""
    schema = resolved(schema, defs)
    kind = value_type(schema)
    if kind is None:
        if any(k not in ANNOTATIONS for k in schema):
            raise GrammarError("json", f"properties[{key!r}]: a value of no one type reads back as its text in the "
                                       f"qwen3_coder format's calls; give its schema one type")
        return _xgr().Grammar.from_ebnf(_XML_TEXT)
    if kind not in ("string", "enum"):
        return _xgr().Grammar.from_ebnf(_xml_json(_json_grammar_text(json.dumps(schema | defs)), schema | defs, key))
    branches = [b for b in schema.get("anyOf") or schema.get("oneOf") or []
                if not (isinstance(b, dict) and b.get("type") == "null")]
    if branches and "type" not in schema and choices(schema) is None:
        values = [_xml_value(b, defs, key) for b in branches]
    else:
        values = [_xml_text(schema, key)]
    return _union(values + [_literal("null")] if nullable(schema) else values)


def _xml_text(schema: dict, key: str) -> Any:
    """A string's text (or its choices') as the reader keeps it."""
    texts = choices(schema)
    if value_type(schema) == "enum":
        return _xgr().Grammar.from_regex("|".join(_escape_regex(t) for t in texts if t is not None))
    pattern = schema.get("pattern", _TEXT_FORMAT_PATTERNS.get(schema.get("format", "")))
    if pattern is not None:
        return _xgr().Grammar.from_ebnf(_xml_pattern(pattern.removeprefix("^").removesuffix("$"), key))
    if schema.get("format") in ENFORCED_FORMATS:
        text = _format_text(schema["format"])
        if text is None:
            raise GrammarError("json", f"properties[{key!r}]: format {schema['format']!r} is not enforced in the "
                                       f"qwen3_coder format's calls (its JSON form escapes characters the text "
                                       f"would write as they are); use a pattern")
        return _xgr().Grammar.from_ebnf(_without(text, _LT, key))
    if "minLength" in schema or "maxLength" in schema:
        low, high = schema.get("minLength", 0), schema.get("maxLength", "")
        return _xgr().Grammar.from_regex(f"[^<]{{{low},{high}}}")
    return _xgr().Grammar.from_ebnf(_XML_TEXT)


# The reader ends a value at its first </parameter>: where a pattern or a format lets a value write "<", it
# writes none (its texts without one, each still the schema's); a pattern that must write one is refused.
# Inside a JSON value, a pattern's string writes no quote, backslash or control character either (the
# engine's rule of a pattern's JSON string escapes them; its text, now ours, would write them raw).
_LT = [(ord("<"), ord("<"))]
_JSON_ESCAPED = [(0, 0x1F), (ord('"'), ord('"')), (ord("\\"), ord("\\"))]


def _xml_pattern(pattern: str, key: str, json_string: bool = False) -> str:
    """The rules of ``pattern``'s texts that write no "<" (GrammarError, named, where it has one of its own);
    as a JSON string's content (``json_string``), its characters escaped or (a class's) left out as JSON needs."""
    text = _without(_printed(_xgr().Grammar.from_regex(pattern)), _LT + _JSON_ESCAPED if json_string else _LT, key)
    if any("<" in literal for literal in ebnf_text.literals(text)):
        raise _must_write(key)
    return ebnf_text.map_literals(text, lambda t: json.dumps(t)[1:-1]) if json_string else text


def _xml_json(text: str, schema: dict, key: str) -> str:
    """A JSON value's rules (``text``, of ``schema``) that write no "<": its strings' as their escape, its
    formats' and patterns' texts without one."""
    for pattern in _patterns(schema):  # (the engine writes some patterns' rules, others as its own call)
        _xml_pattern(pattern, key)
    rules: list[str] = []

    def pattern_rule(args: list[str]) -> str:
        if args[1:] != ["json_string=true"]:
            raise GrammarError("json", f"properties[{key!r}]: a pattern the engine reads outside a string")
        prefix = f"xml_pattern_{len(rules)}_"
        rules.append(ebnf_text.renamed(_xml_pattern(ebnf_text.literal_text(args[0]), key, json_string=True), prefix))
        return prefix + "root"

    text = ebnf_text.map_calls(text.replace(_JSON_STRING_CHAR, _XML_JSON_STRING_CHAR), "Regex", pattern_rule)
    return _without("\n".join([text, *rules]), _LT, key)


def _patterns(schema: Any) -> Iterator[str]:
    """Every pattern in ``schema`` and the schemas it holds (``_own_patterns``)."""
    if isinstance(schema, dict):
        yield from (pattern for _, pattern in _own_patterns(schema))
        for _, _, sub in _subschemas(schema, ""):
            yield from _patterns(sub)


def _without(text: str, taken: ebnf_text.Ranges, key: str) -> str:
    try:
        return ebnf_text.without_chars(text, taken)
    except ebnf_text.ClassEmptied:
        raise _must_write(key) from None


def _must_write(key: str) -> GrammarError:
    return GrammarError("json", f"properties[{key!r}]: a pattern in its schema has a '<' of its own, which the "
                                f"qwen3_coder format's calls cannot hold to (a value ends at its first {PARAM_CLOSE}, "
                                f"and a pattern's characters are written as they are); give a pattern without one")


# A format's text where the engine's JSON rule escapes: an email's local part unquoted (the dot-atom form)
_DOT_ATOM = r"[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+"
_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?"
_TEXT_FORMAT_PATTERNS = FORMAT_PATTERNS | {"email": rf"{_DOT_ATOM}(\.{_DOT_ATOM})*@{_LABEL}(\.{_LABEL})*"}
_QUOTED_ROOT = 'root ::= (("\\"" root_1 "\\""))'


@functools.lru_cache(maxsize=len(ENFORCED_FORMATS))
def _format_text(name: str) -> str | None:
    """EBNF of the text of a string of format ``name`` (the engine's rule for its JSON string, less the
    quotes), or None where that rule writes an escape (its text and its JSON form would differ)."""
    text = str(_xgr().Grammar.from_json_schema(json.dumps({"type": "string", "format": name}),
                                               any_whitespace=False))
    own = [line for line in text.splitlines() if not line.startswith("basic_")]
    if own[0] != _QUOTED_ROOT or any("\\\\" in line or '\\"' in line for line in own[1:]):
        return None
    return text.replace(_QUOTED_ROOT, "root ::= root_1", 1)


def _repeated(grammar: str, separator: str, end: str = "") -> Any:
    """``grammar``'s language one or more times, ``separator`` between and
    ``end`` optional after the last: a new rule repeating its root, made the
    grammar's root (no rule renamed: the text's string literals may hold any
    word)."""
    tail = f" {json.dumps(end)}?" if end else ""
    text = f"{grammar}\n{_REPEATED_ROOT} ::= root ({json.dumps(separator)} root)*{tail}\n"
    return _xgr().Grammar.from_ebnf(text, root_rule_name=_REPEATED_ROOT)


_REPEATED_ROOT = "repeated_root"
# a Lark rule (``start: ...``, ``?expr: ...``), which the engine's EBNF does not read
_LARK_RULE = re.compile(r"^\s*[?!]?[A-Za-z_][A-Za-z0-9_.]*\s*:(?!:=)", re.MULTILINE)
_LARK_HINT = ('; read as a Lark grammar ("name: ..."); an EBNF (GBNF) one writes its rules "name ::= ...", '
              'the start rule named root, e.g. root ::= "yes" | "no"')


def _reason(err: Exception) -> str:
    lines = str(err).strip().splitlines()
    return _ENGINE_PREFIX.sub("", lines[0]) if lines else type(err).__name__


def parse_choices(text: str) -> list[str]:
    choices = json.loads(text)
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise GrammarError("choice", "expected a non-empty list of non-empty strings")
    return choices


# an escape of a code point in a regex or EBNF text (its backslash not itself escaped: an odd run of them)
_CODE_ESCAPE = re.compile(r"(?<!\\)((?:\\\\)*)\\(x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8}|0(?![0-7]))")


def _escape_problem(text: str, what: str) -> str | None:
    """Why the engine would not hold ``text`` (a regex or EBNF) to what it writes: a NUL (it drops one, or
    ends a literal there), or a UTF-16 surrogate escape (half of a character: it writes its invalid bytes)."""
    for match in _CODE_ESCAPE.finditer(text):
        escape = match[2]
        code = 0 if escape == "0" else int(escape[1:], 16)
        ends_range = text[match.end(1) - 1:match.end(1)] == "-" or text[match.end():match.end() + 1] == "-"
        if code == 0 and not ends_range:  # (a range from NUL is a class's bound, not a NUL written)
            return f"{what} holds \\{escape}, a NUL character, which is not enforced here (the engine drops it)"
        if 0xD800 <= code <= 0xDFFF:
            return (f"{what} holds \\{escape}, half of a UTF-16 surrogate pair, which is no character; write the "
                    f"character itself or its \\U escape (\\U0001F600)")
    return None


def _user_regex(regex: str, what: str) -> str:
    """A client's regex as the engine reads what the client meant: a code point's escape (``\\xHH``,
    ``\\uHHHH``, ``\\UHHHHHHHH``) is its character, as Python, JavaScript and the engine's own JSON-schema
    patterns read it (its regex reader takes every hex digit after the x, and after the u in a class: "\\xe9b"
    was U+0E9B); GrammarError for a NUL or a surrogate escape (``_escape_problem``)."""
    if (problem := _escape_problem(regex, what)) is not None:
        raise GrammarError("regex", problem)

    def character(match: re.Match) -> str:  # (a NUL left is a class's bound: the engine reads its escape)
        code = 0 if match[2] == "0" else int(match[2][1:], 16)
        return match[0] if code == 0 else match[1] + _escape_regex(chr(code))

    return _CODE_ESCAPE.sub(character, regex)


def _escape_regex(text: str) -> str:
    """``text`` matched as written, in a class too (where "-" would make a range)."""
    return "".join("\\" + c if c in r"\^$.|?*+()[]{}/-" else c for c in text)


class GrammarMatchers:
    """One rank's matchers, by request id, and the step's token bitmask.

    ``mask`` fills the bitmask of every constrained row in one engine call
    (no per-token Python) and applies it to the logits in place, outside any
    captured graph: the graphs return their logits, and masking them after
    keeps one set of graphs for constrained and unconstrained steps.
    """

    def __init__(self, compiler: GrammarCompiler, *, max_threads: int = 1, device: torch.device | str = "cpu",
                 max_rows: int = 1):
        self.compiler = compiler
        self.matchers: dict[str, Any] = {}
        self.refused: set[str] = set()  # rows whose sampled token their grammar refused: only EOS from then on
        # rows whose grammar waits for their reasoning: "start" (may open <think> first), "thinking" (free until
        # </think>)
        self.waiting: dict[str, tuple[str, tuple[int, ...]]] = {}
        self._open_rows: dict[int, torch.Tensor] = {}  # <think> id -> a bitmask row allowing it alone
        self._tails: dict[str, bytes] = {}  # a thinking row's last output bytes: a </think> spelled in pieces
        self._vocab: list[bytes] | None = None  # each token's bytes, once a reasoning row needs them
        self.batch = _xgr().BatchGrammarMatcher(max_threads=max_threads)
        self.device = torch.device(device)
        self._allocate(max_rows)
        self.stop_row = _row_allowing(self.bitmask[0], compiler.info.stop_token_ids)  # a terminated grammar's mask

    def _allocate(self, num_rows: int) -> None:
        """The host bitmask (pinned on CUDA, so its copy is asynchronous) and its device twin."""
        host = _xgr().allocate_token_bitmask(num_rows, self.compiler.vocab_size)
        is_cuda = self.device.type == "cuda"
        self.bitmask = host.pin_memory() if is_cuda else host
        self.device_bitmask = torch.empty_like(host, device=self.device) if is_cuda else None

    def warm_up(self) -> None:
        """Run the masking kernel once for each power-of-two row count up to the
        buffers' (on CUDA its first use compiles it: not in a request's step)."""
        if self.device.type != "cuda":
            return
        with torch.cuda.device(self.device):  # this may be a thread whose current device is another rank's
            n = 1
            while n <= self.bitmask.shape[0]:
                logits = torch.zeros(n, self.compiler.vocab_size, device=self.device)
                _xgr().apply_token_bitmask_inplace(logits, self.device_bitmask[:n], vocab_size=self.compiler.vocab_size,
                                                   indices=list(range(n)))
                n *= 2
            torch.cuda.synchronize(self.device)

    def __len__(self) -> int:
        return len(self.matchers)

    def start(self, request_id: str, spec: messages.StructuredSpec | None, output_token_ids: list[int]) -> None:
        """A matcher for a new (or restarted) sequence, fed the outputs it already has."""
        self.forget(request_id)
        if spec is None:
            return
        matcher = _xgr().GrammarMatcher(self.compiler.compile(spec))
        self.matchers[request_id] = matcher
        if spec.reasoning:
            self.waiting[request_id] = ("thinking" if spec.opened else "start", spec.reasoning)
        for token in output_token_ids:
            self._feed(request_id, matcher, token)

    def refuses(self, request_id: str, row: int, token_id: int) -> bool:
        """Whether the grammar that holds row ``row`` of the last ``mask`` (its reasoning over, or none to wait
        for) refuses ``token_id`` next."""
        if request_id not in self.matchers or request_id in self.waiting:
            return False
        return not (int(self.bitmask[row, token_id // 32]) >> (token_id % 32)) & 1

    def forget(self, request_id: str) -> None:
        self.matchers.pop(request_id, None)
        self.refused.discard(request_id)
        self.waiting.pop(request_id, None)
        self._tails.pop(request_id, None)

    def mask(self, logits: torch.Tensor, sample_ids: list[str]) -> list[int]:
        """Mask disallowed tokens of the constrained rows of ``logits``
        [len(sample_ids), vocab] in place. Returns the rows whose grammar
        allows no token, not even the end (a pattern that cannot be completed
        from here, such as ``a[^\\s\\S]``): their request fails (each is given its
        stop tokens, so the draw is defined; the token stands in)."""
        rows = [i for i, rid in enumerate(sample_ids)
                if rid in self.matchers and self.waiting.get(rid, ("",))[0] != "thinking"]
        if not rows:
            return []
        if self.bitmask.shape[0] < len(sample_ids):
            self._allocate(len(sample_ids))
        bitmask = self.bitmask[: len(sample_ids)]
        live = [i for i in rows if not self._is_done(sample_ids[i])]
        dead = []
        if live:
            self.batch.batch_fill_next_token_bitmask([self.matchers[sample_ids[i]] for i in live], bitmask, indices=live)
            for i in live:
                if sample_ids[i] in self.waiting:  # "start": its first token may open the reasoning
                    bitmask[i] |= self._open_row(self.waiting[sample_ids[i]][1][0])
            empty = (bitmask[live] == 0).all(dim=1).tolist()
            dead = [i for i, is_empty in zip(live, empty) if is_empty]
        for i in set(rows).difference(live).union(dead):
            bitmask[i] = self.stop_row
        if self.device_bitmask is not None and logits.device.type == "cuda":
            # The pinned copy is not overwritten before it lands: the next fill follows this step's sampling.
            on_device = self.device_bitmask[: len(sample_ids)]
            on_device.copy_(bitmask, non_blocking=True)
        else:
            on_device = bitmask.to(logits.device)
        _xgr().apply_token_bitmask_inplace(logits, on_device, vocab_size=self.compiler.vocab_size, indices=rows)
        return dead

    def advance(self, sampled: list[messages.SampledToken]) -> None:
        """Feed each constrained row its sampled token."""
        for token in sampled:
            matcher = self.matchers.get(token.request_id)
            if matcher is not None:
                self._feed(token.request_id, matcher, token.token_id)

    def _open_row(self, token_id: int) -> torch.Tensor:
        row = self._open_rows.get(token_id)
        if row is None:
            row = self._open_rows[token_id] = _row_allowing(self.bitmask[0], [token_id])
        return row

    def _closes(self, request_id: str, token_id: int, think_close: int) -> bool:
        """Whether a thinking row's token ends its reasoning: the ``</think>`` token, or the last piece of
        its text written in several tokens (the reply's text reads the reasoning as ended there too)."""
        if token_id == think_close:
            return True
        if self._vocab is None:
            self._vocab = self.compiler.info.decoded_vocab
        tag = self._vocab[think_close]
        tail = self._tails.get(request_id, b"") + (self._vocab[token_id] if token_id < len(self._vocab) else b"")
        if tag in tail:
            return True
        self._tails[request_id] = tail[-len(tag):]
        return False

    def _feed(self, request_id: str, matcher: Any, token_id: int) -> None:
        """One output token: the reasoning's while the grammar waits for it to end, else the grammar's."""
        waiting = self.waiting.get(request_id)
        if waiting is not None:
            state, (think_open, think_close) = waiting
            if state == "thinking":
                if self._closes(request_id, token_id, think_close):
                    del self.waiting[request_id]  # the grammar holds from the next token
                    self._tails.pop(request_id, None)
                return
            del self.waiting[request_id]
            if token_id == think_open:
                self.waiting[request_id] = ("thinking", waiting[1])
                return
        self._accept(request_id, matcher, token_id)

    def _is_done(self, request_id: str) -> bool:
        return request_id in self.refused or self.matchers[request_id].is_terminated()

    def _accept(self, request_id: str, matcher: Any, token_id: int) -> None:
        # A complete grammar allows only EOS; with ignore_eos the request may sample
        # it again after the matcher terminated, which changes nothing.
        if self._is_done(request_id):
            return
        if not matcher.accept_token(token_id):
            # Only when a later logits filter removed every token the grammar allows.
            # The step is sampled on every rank: raising now would fail all its rows,
            # so the row ends instead (only EOS is allowed from here), on every rank alike.
            log.warning("request %r: token %d is outside its grammar; the request ends here", request_id, token_id)
            self.refused.add(request_id)


def _row_allowing(row: torch.Tensor, token_ids: Iterable[int]) -> torch.Tensor:
    """A bitmask row (int32 words, bit ``t % 32`` of word ``t // 32``) allowing only ``token_ids``."""
    words = [0] * row.numel()
    for token in token_ids:
        words[token // 32] |= 1 << (token % 32)
    return torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)
