"""The request fields that name a structured output, and what the engine
makes of each spec: pure, no server."""

from __future__ import annotations

import json
import re

import pytest

from mstar_actors.frontend.openai_api import ApiError, parse_chat, parse_completion
from mstar_actors.messages import StructuredSpec
from mstar_actors.runner.grammar import GrammarCompiler, GrammarEngineError, GrammarError, check_engine, raw_tokenizer_info

MESSAGES = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def chat(**fields):
    return parse_chat(json.dumps({"messages": MESSAGES, **fields}).encode()).sampling.structured


def refusal(parse=chat, **fields) -> ApiError:
    with pytest.raises(ApiError) as err:
        parse(**fields)
    assert err.value.status == 400
    return err.value


@pytest.mark.parametrize(("fields", "expected"), [
    ({}, None),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, StructuredSpec("json_object", "", "response_format")),
    ({"response_format": {"type": "json_object", "schema": SCHEMA}},  # llama.cpp's server's form
     StructuredSpec("json", json.dumps(SCHEMA, separators=(",", ":")), "response_format.schema")),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA, "strict": True}}},
     StructuredSpec("json", json.dumps(SCHEMA, separators=(",", ":")), "response_format.json_schema.schema")),
    ({"structured_outputs": {"json": SCHEMA}}, StructuredSpec("json", json.dumps(SCHEMA, separators=(",", ":")), "structured_outputs.json")),
    ({"structured_outputs": {"json": '{"type": "string"}'}}, StructuredSpec("json", '{"type": "string"}', "structured_outputs.json")),
    ({"structured_outputs": {"regex": "a+", "disable_fallback": True}}, StructuredSpec("regex", "a+", "structured_outputs.regex")),
    ({"structured_outputs": {"choice": ["x", "y"]}}, StructuredSpec("choice", '["x","y"]', "structured_outputs.choice")),
    ({"structured_outputs": {"grammar": 'root ::= "a"'}}, StructuredSpec("grammar", 'root ::= "a"', "structured_outputs.grammar")),
    ({"structured_outputs": {"json_object": True}}, StructuredSpec("json_object", "", "structured_outputs.json_object")),
    ({"guided_json": SCHEMA}, StructuredSpec("json", json.dumps(SCHEMA, separators=(",", ":")), "guided_json")),
    ({"guided_regex": "b"}, StructuredSpec("regex", "b", "guided_regex")),
    ({"guided_choice": ["x"]}, StructuredSpec("choice", '["x"]', "guided_choice")),
    ({"guided_grammar": 'root ::= "a"', "guided_decoding_backend": "xgrammar"}, StructuredSpec("grammar", 'root ::= "a"', "guided_grammar")),
])
def test_each_field_maps_to_one_spec(fields, expected):
    assert chat(**fields) == expected


def test_completions_take_the_same_fields():
    body = {"prompt": "x", "structured_outputs": {"choice": ["a", "b"]}}
    assert parse_completion(json.dumps(body).encode()).sampling.structured == StructuredSpec("choice", '["a","b"]', "structured_outputs.choice")


@pytest.mark.parametrize(("fields", "param"), [
    ({"response_format": "json"}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": 3, "schema": SCHEMA}}}, "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA, "strict": "yes"}}}, "response_format.json_schema.strict"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}}, "response_format.json_schema.schema"),
    # a key the type does not read would be dropped
    ({"response_format": {"type": "json_object", "shema": SCHEMA}}, "response_format.shema"),
    ({"response_format": {"type": "text", "json_schema": {"schema": SCHEMA}}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA, "strcit": True}}},
     "response_format.json_schema.strcit"),
    ({"structured_outputs": ["regex"]}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
    ({"structured_outputs": {"regex": 5}}, "structured_outputs.regex"),
    ({"structured_outputs": {"choice": ["a", 1]}}, "structured_outputs.choice"),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    # vLLM's backend names change nothing here; anything else is the client's error
    ({"guided_regex": "a", "guided_decoding_backend": [1]}, "guided_decoding_backend"),
    ({"guided_regex": "a", "guided_decoding_backend": "no-such-backend"}, "guided_decoding_backend"),
])
def test_a_bad_shape_is_a_400_naming_the_field(fields, param):
    err = refusal(**fields)
    assert err.param == param and err.message.startswith(param)


def test_a_bad_value_is_named_in_the_message():
    """A schema as text that is no JSON schema, a choice that is no string: named, not the parser's words alone."""
    err = refusal(guided_json="hello")
    assert err.param == "guided_json" and "a schema given as text must be JSON text of a schema object" in err.message
    assert "JSON text of a schema object, got \"[1]\"" in refusal(structured_outputs={"json": "[1]"}).message
    assert "structured_outputs.choice[1] is \"\"" in refusal(structured_outputs={"choice": ["a", ""]}).message


def test_two_constraints_are_a_400_naming_both():
    err = refusal(response_format={"type": "json_object"}, structured_outputs={"regex": "a", "choice": ["b"]})
    assert err.param == "response_format"
    assert "response_format and structured_outputs.regex and structured_outputs.choice" in err.message


# ---------------------------------------------------------------- the engine

VOCAB = ["<eos>", "{", "}", "[", "]", '"', ":", ",", " ", "a", "b", "1", "2", "\x08", "a.b", "(x)", ".", "0"]


@pytest.fixture(scope="module")
def compiler():
    return GrammarCompiler(raw_tokenizer_info(VOCAB, [0]))


def accepts(compiler, spec: StructuredSpec, tokens: list[str]) -> bool:
    import xgrammar

    matcher = xgrammar.GrammarMatcher(compiler.compile(spec))
    return all(matcher.accept_token(VOCAB.index(t)) for t in tokens) and matcher.accept_token(0)


def test_a_lark_grammar_is_read_as_well(compiler):
    """vLLM takes Lark grammars beside EBNF ones."""
    spec = StructuredSpec("grammar", 'start: "a" | pair\npair: "b" "1"')
    assert accepts(compiler, spec, ["a"]) and accepts(compiler, spec, ["b", "1"])
    assert not accepts(compiler, spec, ["b"])


def test_json_object_takes_objects_only(compiler):
    spec = StructuredSpec("json_object")
    assert accepts(compiler, spec, ["{", '"', "a", '"', ":", " ", "1", "}"])
    assert not accepts(compiler, spec, ["[", "]"])


def test_a_length_bounded_string_stays_valid_json(compiler):
    """The engine's own class for such strings lets raw control characters through; ours does not."""
    spec = StructuredSpec("json", '{"type": "string", "maxLength": 3}')
    assert accepts(compiler, spec, ['"', "a", "b", '"'])
    assert not accepts(compiler, spec, ['"', "\x08", '"'])
    assert not accepts(compiler, spec, ['"', "a", "a", "a", "a", '"'])


def test_a_literal_pattern_s_control_character_is_written_as_its_escape():
    """The engine writes a pattern of literals alone as its raw characters: a raw line break is no JSON."""
    import xgrammar

    every_char = GrammarCompiler(raw_tokenizer_info(["<eos>"] + [chr(c) for c in range(1, 127)], [0]))
    matcher = xgrammar.GrammarMatcher(every_char.compile(StructuredSpec("json", json.dumps(
        {"type": "object", "properties": {"s": {"type": "string", "pattern": "^a\\nb$"}}, "required": ["s"]}))))
    for text, valid in (('{"s": "a\\nb"}', True), ('{"s": "a\nb"}', False)):
        matcher.reset()
        assert (matcher.accept_string(text) and matcher.accept_token(0)) is valid, text
    assert json.loads('{"s": "a\\nb"}') == {"s": "a\nb"}


@pytest.mark.parametrize("pattern,value", [('^[^"]+$', "a b"), ("^[ -~]+$", "x y"), ('^[^\\\\]*"?$', "ab"),
                                           ("^a\\tb$", "a\tb")])
def test_a_pattern_that_mentions_a_quote_or_a_backslash_is_held_as_json(pattern, value):
    """A pattern that matches without a quote, a backslash or a raw control character is the engine's
    automaton, which leaves those out (or, of a literal's control character, its escape): taken, and every
    string it allows is JSON."""
    import xgrammar

    every_char = GrammarCompiler(raw_tokenizer_info(["<eos>"] + [chr(c) for c in range(1, 127)], [0]))
    matcher = xgrammar.GrammarMatcher(every_char.compile(StructuredSpec("json", json.dumps(
        {"type": "object", "properties": {"s": {"type": "string", "pattern": pattern}}, "required": ["s"]}))))
    assert matcher.accept_string(json.dumps({"s": value})) and matcher.accept_token(0)
    for raw in ('"', "\\", "\t"):
        matcher.reset()
        assert not (matcher.accept_string('{"s": "a' + raw + 'b"}') and matcher.accept_token(0)), raw


def test_an_ipv4_format_takes_no_leading_zero(compiler):
    """The engine's own ipv4 rule writes octets like 010 (which JSON Schema's
    format refuses, as some read them as octal); the format is its pattern here."""
    spec = StructuredSpec("json", '{"type": "array", "items": {"type": "string", "format": "ipv4"}}')
    dotted = ["[", '"'] + [*"1.2.1.2"] + ['"', "]"]
    assert accepts(compiler, spec, dotted)
    assert not accepts(compiler, spec, ["[", '"'] + [*"1.2.1.012"] + ['"', "]"])
    assert not accepts(compiler, spec, ["[", '"'] + [*"1.2.1"] + ['"', "]"])


def test_choices_are_literal_strings(compiler):
    spec = StructuredSpec("choice", json.dumps(["a.b", "(x)"]))
    assert accepts(compiler, spec, ["a.b"]) and accepts(compiler, spec, ["(x)"])
    assert not accepts(compiler, spec, ["a", "a", "b"])


@pytest.mark.parametrize(("spec", "reason"), [
    (StructuredSpec("json", "{not json"), "Expecting property name"),
    (StructuredSpec("json", '{"type": "wat"}'), 'Unsupported type "wat"'),
    (StructuredSpec("regex", "(a"), "parenthesis"),
    (StructuredSpec("grammar", "root ::= undefined_rule"), "undefined_rule"),
    (StructuredSpec("choice", "[]"), "non-empty list"),
    (StructuredSpec("regex", "[^\\x00-\\U0010FFFF]"), "no output satisfies it"),  # no text at all
    (StructuredSpec("grammar", 'root ::= "zz"'), "no output satisfies it"),  # text the vocabulary can't spell
    (StructuredSpec("grammar", 'start: "a" | ('), "expected ')' after group; read as a Lark grammar"),
    (StructuredSpec("grammar", "start: /[a-/\n"), "regular expression: Regex parsing error at position 4"),
])
def test_an_invalid_spec_names_the_engines_reason(compiler, spec, reason):
    """The engine's reason alone: none of its log's "[hh:mm:ss] file.cc:94: " prefixes, first or quoted."""
    with pytest.raises(GrammarError) as err:
        compiler.compile(spec)
    assert err.value.kind == spec.kind and reason in err.value.reason and ".cc:" not in err.value.reason


def test_the_start_check_passes_and_a_missing_engine_is_one_line(monkeypatch):
    check_engine()
    import sys

    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import fails as if not installed
    with pytest.raises(GrammarEngineError) as err:
        check_engine()
    assert "xgrammar" in str(err.value) and "\n" not in str(err.value)


def test_the_server_refuses_to_start_without_the_engine_in_one_line(monkeypatch, capsys):
    import sys

    from mstar_actors.config import parse_config
    from mstar_actors.launcher import serve

    monkeypatch.setitem(sys.modules, "xgrammar", None)
    assert serve(parse_config({"model": {"path": "unused"}}), None) == 2  # before anything is spawned
    err = capsys.readouterr().err
    assert err.startswith("error: structured outputs need xgrammar") and err.count("\n") == 1


OBJ = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize(("schema", "reason"), [
    ({"allOf": [OBJ, {"type": "object", "properties": {"b": {"type": "string"}}}]}, "'allOf' of 2 schemas"),
    ({"type": "object", "properties": {"m": {"type": "integer", "multipleOf": 5}}},
     "the schema's properties['m'] uses 'multipleOf'"),
    ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 7}}, "uses 'contains'"),
    ({"type": "array", "items": {"enum": [1, 2]}, "uniqueItems": True}, "uses 'uniqueItems'"),
    ({"if": {"const": "a"}, "then": {"const": "b"}, "else": {"const": "c"}}, "uses 'if'"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "zzz"]}, "requires ['zzz']"),
    ({"$ref": "http://example.com/s.json"}, "only JSON-pointer references inside the schema"),
    ({"$defs": {"n": {"$anchor": "num", "type": "integer"}}, "$ref": "#num"}, "only JSON-pointer references"),
    # beside a keyword the engine reads alone, a keyword is dropped
    ({"$defs": {"n": {"type": "integer"}}, "$ref": "#/$defs/n", "minimum": 1000}, "'minimum' beside '$ref'"),
    ({"anyOf": [{"type": "integer"}], "minimum": 1000}, "'minimum' beside 'anyOf'"),
    ({"enum": ["a", "b", "cc"], "minLength": 2}, "'minLength' beside 'enum'"),
    ({"const": 1, "type": "string"}, "'type' beside 'const'"),
    ({"allOf": [OBJ], "properties": {"b": {"type": "string"}}, "required": ["b"]}, "beside 'allOf'"),
    # oneOf is anyOf here: refused where branches can overlap
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "'oneOf' whose branches can match the same value"),
    ({"oneOf": [OBJ, OBJ]}, "'oneOf' whose branches"),
    ({"oneOf": [{"enum": [1, "a"]}, {"const": 1.0}]}, "'oneOf' whose branches"),  # 1 and 1.0 are one value
    ({"oneOf": [{"const": [0, {"a": 1}]}, {"const": [-0.0, {"a": 1.0}]}]}, "'oneOf' whose branches"),
    # strings: lengths beside a pattern or format, lookarounds, quotes and backslashes
    ({"type": "string", "pattern": "^[a-z]+$", "maxLength": 2}, "minLength / maxLength beside 'pattern'"),
    ({"type": "string", "format": "email", "maxLength": 20}, "minLength / maxLength beside 'format'"),
    # a pattern beside a format: the format's rule alone was written
    ({"type": "string", "format": "date", "pattern": "^[0-9]{4}$"}, "a pattern beside format 'date'"),
    # a named property a pattern's keys also take: written as one of those, held to their schema alone
    ({"type": "object", "properties": {"name": {"type": "boolean"}},
      "patternProperties": {"^[a-z]+$": {"type": "integer"}}, "additionalProperties": False},
     "properties['name'] also matches patternProperties '^[a-z]+$'"),
    ({"type": "object", "properties": {"name": {"type": "boolean"}},
      "propertyNames": {"type": "string", "pattern": "^[a-z]+$"}, "additionalProperties": {"type": "integer"}},
     "properties['name'] also matches propertyNames"),
    ({"type": "array", "items": [{"type": "integer"}], "additionalItems": False}, "draft 7's tuple form"),
    # a format of the vocabulary the engine passes any string for
    ({"type": "string", "format": "idn-email"}, "has format 'idn-email', which is not enforced here; enforced"),
    ({"type": "object", "properties": {"r": {"type": "string", "format": "regex"}}}, "properties['r'] has format"),
    ({"type": "string", "pattern": "^(?!abc)[a-c]{3}$"}, "has a lookaround"),
    # a pattern only a quote, a backslash or a class's control character matches: written raw, not JSON
    ({"type": "string", "pattern": '^say "hi"$'}, "matches only strings with a quote, a backslash"),
    ({"type": "string", "pattern": "^a\\\\b$"}, "matches only strings with a quote, a backslash"),
    ({"type": "string", "pattern": "^a\\u0022b$"}, "matches only strings with a quote, a backslash"),
    ({"type": "string", "pattern": "^a[\\x22]b$"}, "matches only strings with a quote, a backslash"),
    ({"type": "string", "pattern": "^[\\t\\n]+$"}, "matches only strings with a quote, a backslash"),
    # beside a character outside ASCII the engine writes the pattern's classes raw: '.', [^,], \\s take a quote
    ({"type": "string", "pattern": "^.\u00e9$"}, "holds a character outside ASCII beside a class"),
    ({"type": "string", "pattern": "^[^,]{1,8} caf\u00e9$"}, "holds a character outside ASCII beside a class"),
    ({"type": "string", "pattern": "^\\d{2}\\s?\u00e9$"}, "holds a character outside ASCII beside a class"),
    ({"type": "string", "pattern": '^\u00e9"$'}, "matches only strings with a quote, a backslash"),  # its literal
    ({"type": "object", "patternProperties": {"^[a\\t]\\t$": {"type": "integer"}}}, "patternProperties '^[a\\\\t]"),
    ({"type": "object", "patternProperties": {"^x": {"type": "integer"}}, "required": ["xa"]},
     "'required' beside 'patternProperties'"),
    ({"type": "number", "minimum": 0, "exclusiveMinimum": True}, "exclusiveMinimum: True (draft 4's form)"),
    ({"type": "array", "minItems": -1}, "minItems: -1; expected a non-negative integer"),
    ({"type": "object", "properties": {"x": {"anyOf": [{"not": {"type": "null"}}]}}},
     "the schema's properties['x']'s anyOf[0] uses 'not'"),
    ({"type": "object", "$defs": {"D": {"type": "object", "dependentRequired": {"a": ["b"]}}}},
     "$defs['D'] uses 'dependentRequired'"),
    # no value satisfies an empty list of branches or types (the engine let the empty output through)
    ({"anyOf": []}, "has an empty 'anyOf'"),
    ({"type": "object", "properties": {"a": {"oneOf": []}}, "required": ["a"]}, "properties['a'] has an empty 'oneOf'"),
    ({"allOf": [{"anyOf": []}]}, "allOf[0] has an empty 'anyOf'"),
    ({"type": []}, "has an empty 'type'"),
    # counts of keys the engine may repeat, or more than it generates
    ({"type": "object", "patternProperties": {"^[ab]$": {"type": "integer"}}, "additionalProperties": False,
      "minProperties": 3}, "minProperties: 3 over keys beside 'properties'"),
    ({"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 2}, "may repeat a key"),
    ({"type": "object", "minProperties": 2}, "minProperties: 2 but its 'properties' define 0"),
    ({"type": "array", "prefixItems": [{"type": "integer"}], "minItems": 2}, "unless 'items' gives their schema"),
    # a type's keywords without a type: the engine lets any value through
    ({"minimum": 5, "maximum": 6}, "has 'minimum' but no 'type'"),
    ({"type": "object", "properties": {"n": {"minLength": 2}}}, "properties['n'] has 'minLength' but no 'type'"),
    ({"maxItems": 1}, "has 'maxItems' but no 'type'"),
    ({"patternProperties": {"^a": {"type": "integer"}}}, "has 'patternProperties' but no 'type'"),
    # a property name is a string: each choice of propertyNames must be one (the engine wrote {true: true})
    ({"type": "object", "propertyNames": {"anyOf": [{"const": "a"}, {"pattern": "^z[0-9]$"}]}},
     "propertyNames lists {\"pattern\": \"^z[0-9]$\"}, which allows values that are not strings"),
    ({"type": "object", "propertyNames": {"anyOf": [{"const": "a"}, {}]}}, "lists {}, which allows values"),
    ({"type": "object", "propertyNames": {"enum": ["a", 1]}}, "which allows values that are not strings"),
    ({"$defs": {"n": {"$dynamicAnchor": "x", "type": "boolean"}}, "$dynamicRef": "#x"}, "uses '$dynamicRef'"),
    ({"$recursiveRef": "#"}, "uses '$recursiveRef'"),
])
def test_a_keyword_the_engine_would_drop_is_refused_naming_it(compiler, schema, reason):
    """The engine ignores these without a word: its output would break them."""
    with pytest.raises(GrammarError) as err:
        compiler.compile(StructuredSpec("json", json.dumps(schema)))
    assert reason in err.value.reason, err.value.reason


@pytest.mark.parametrize("schema", [
    {"allOf": [OBJ]},
    {"type": "array", "items": {"type": "integer"}, "uniqueItems": False},
    {"type": "object", "properties": {"not": {"type": "string"}, "if": {"type": "integer"}}, "required": ["not"]},
    {"$defs": {"O": OBJ}, "$ref": "#/$defs/O"},
    {"type": "string", "enum": ["a", "b"], "title": "Letter", "description": "d"},  # a type every value has
    {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None, "title": "Optional"},
    {"oneOf": [{"type": "string"}, {"type": "integer"}]},  # different types: exclusive
    {"$defs": {"Cat": {"type": "object", "properties": {"kind": {"const": "cat"}}, "required": ["kind"]},
               "Dog": {"type": "object", "properties": {"kind": {"enum": ["dog"]}}, "required": ["kind"]}},
     "oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}], "discriminator": {"propertyName": "kind"}},
    {"type": "string", "pattern": "^\\d{3}-[a-z]+$"},
    {"type": "string", "pattern": '^[^,"\\\\\\x00-\\x1f]{1,8} caf\u00e9$'},  # the class naming what it leaves out
    {"type": "string", "format": "password"},  # outside the vocabulary: an annotation (pydantic's SecretStr)
    {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "minProperties": 1,
     "maxProperties": 2, "additionalProperties": False},
    # a count of keys the engine writes holds though it may repeat one: pydantic's dict[str, int] with lengths
    {"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 1, "maxProperties": 3},
    {"type": "object", "propertyNames": {"enum": ["a", "b"]}, "maxProperties": 2},
    {"type": "array", "prefixItems": [{"type": "integer"}], "items": {"type": "string"}, "minItems": 2},
    {"properties": {"a": {"type": "integer"}}, "required": ["a"]},  # an object: the engine infers it
    {"oneOf": [{"const": "a"}, {"enum": ["b", 1]}, {"const": True}]},  # no value listed twice: exclusive
    {"items": {"type": "integer"}, "minItems": 1},  # an array: the engine infers it
    {"type": "object", "propertyNames": {"anyOf": [{"anyOf": [{"const": "a"}]}, {"$ref": "#/$defs/k"}]},
     "$defs": {"k": {"type": "string", "pattern": "^k$"}}},
    {"type": "object", "propertyNames": {"pattern": "^[ab]$"}},  # read as a string's
    {"type": "object", "propertyNames": {"anyOf": [{"const": "a"}, {"type": "string", "pattern": "^b$"}]}},
])
def test_what_the_engine_enforces_still_compiles(compiler, schema):
    compiler.compile(StructuredSpec("json", json.dumps(schema)))  # properties named like keywords are names


def test_a_forced_calls_parameters_keep_their_own_references():
    """Parameters with $defs and a "#" reference (pydantic's recursive models) are
    forced as they read: their references point into them, not at the call's
    wrapper (a 400 "Cannot find field '$defs'", and "#" took the whole call)."""
    import xgrammar

    from mstar_actors.frontend import tool_calls as tc

    parameters = {"type": "object", "$defs": {"When": {"type": "string", "enum": ["now", "later"]}},
                  "properties": {"when": {"$ref": "#/$defs/When"}, "child": {"anyOf": [{"type": "null"}, {"$ref": "#"}]}},
                  "required": ["when", "child"]}
    tools = [{"type": "function", "function": {"name": "f", "parameters": parameters}}]
    spec = StructuredSpec("json", tc.forced_call_schema(tc.parse_tool_request(tools, "required", "hermes")))
    chars = GrammarCompiler(raw_tokenizer_info(["<eos>"] + [chr(c) for c in range(32, 127)], [0]))
    matcher = xgrammar.GrammarMatcher(chars.compile(spec))

    def accepted(arguments) -> bool:
        matcher.reset()
        return matcher.accept_string(json.dumps({"name": "f", "arguments": arguments}))

    assert accepted({"when": "now", "child": {"when": "later", "child": None}})
    assert not accepted({"when": "soon", "child": None})
    assert not accepted({"when": "now", "child": {"name": "f", "arguments": {"when": "now", "child": None}}})


@pytest.mark.parametrize("parser", ["hermes", "llama3_json"])
def test_required_takes_one_or_more_calls_joined_as_the_format_joins_them(parser):
    """vLLM's required choice is a list of calls: the grammar repeats the
    call (recursive references included) with the format's separator, which
    the reader reads back; parallel_tool_calls false and a named function
    keep one."""
    import xgrammar

    from mstar_actors.frontend import tool_calls as tc

    key = tc.ARGUMENTS_KEY[parser]
    parameters = {"type": "object", "properties": {"n": {"type": "integer"},
                                                   "next": {"anyOf": [{"type": "null"}, {"$ref": "#"}]}},
                  "required": ["n", "next"]}
    root = {"type": "object", "properties": {"user": {"enum": ["root", "guest"]}}, "required": ["user"]}
    tools = [{"type": "function", "function": {"name": "f", "parameters": parameters}},
             {"type": "function", "function": {"name": "g"}},
             {"type": "function", "function": {"name": "root", "parameters": root}}]  # the grammar's word, as text
    request = tc.parse_tool_request(tools, "required", parser)
    spec = StructuredSpec(*tc.forced_calls_spec(request))
    chars = GrammarCompiler(raw_tokenizer_info(["<eos>"] + [chr(c) for c in range(10, 127)], [0]))
    matcher = xgrammar.GrammarMatcher(chars.compile(spec))
    calls = [json.dumps({"name": "f", key: {"n": 1, "next": {"n": 2, "next": None}}}),
             json.dumps({"name": "g", key: {}}), json.dumps({"name": "root", key: {"user": "root"}})]

    def accepted(text: str) -> bool:
        matcher.reset()
        return matcher.accept_string(text) and matcher.is_terminated() is False and matcher.accept_token(0)

    separator = tc.CALL_SEPARATOR[parser]
    assert accepted(calls[0]) and accepted(separator.join(calls)) and accepted(separator.join(calls * 2))
    assert not accepted(calls[0] + separator) and not accepted(json.dumps({"name": "h", key: {}}))
    assert [c.name for c in tc.read_calls(request, separator.join(calls))[1]] == ["f", "g", "root"]
    end = tc.CALLS_END[parser]  # the last call closed as the format closes one: a stop may follow
    assert accepted(separator.join(calls) + end) and (not end or not accepted(separator.join(calls) + end + end))
    assert [c.name for c in tc.read_calls(request, separator.join(calls) + end)[1]] == ["f", "g", "root"]
    stream = tc.stream_reader(request)
    deltas = [d for piece in (separator.join(calls[:2]), end) for d in stream.feed(piece)] + stream.flush()
    assert [d["function"]["name"] for d in deltas if "id" in d] == ["f", "g"]
    single = tc.parse_tool_request(tools, "required", parser, parallel_tool_calls=False)
    assert tc.forced_calls_spec(single)[0] == "json"
    named = tc.parse_tool_request(tools, {"type": "function", "function": {"name": "f"}}, parser)
    assert tc.forced_calls_spec(named)[0] == "json"


@pytest.mark.parametrize("parser", ["json", "hermes", "llama3_json", "qwen3_coder"])
def test_latin_letters_before_a_hex_digit_are_held_as_written(parser):
    """The engine prints a character up to U+00FF as \\xHH and its parser reads every hex digit after the x
    ("ü" then "b" read as U+FCB): an enum of "über" took "\\u0fcber" and refused itself, in a schema's rules read
    back and in every grammar its compile cache keys by its printed text."""
    import xgrammar

    from mstar_actors.frontend import tool_calls as tc

    letters = ["ü", "é", "\u0fcb", "\u0e9e"]
    every_char = GrammarCompiler(raw_tokenizer_info(["<eos>"] + [chr(c) for c in range(1, 127)] + letters, [0]))
    schema = {"type": "object", "properties": {"w": {"type": "string", "enum": ["über", "née"]}}, "required": ["w"],
              "additionalProperties": False}
    if parser == "json":
        spec, write = StructuredSpec("json", json.dumps(schema)), lambda w: json.dumps({"w": w}, ensure_ascii=False)
    else:
        tool = {"type": "function", "function": {"name": "f", "strict": True, "parameters": schema}}
        spec = StructuredSpec(*tc.strict_calls_spec(tc.parse_tool_request([tool], "auto", parser)))
        write = {"hermes": lambda w: '<tool_call>\n{"name": "f", "arguments": %s}\n</tool_call>' % json.dumps(
                     {"w": w}, ensure_ascii=False),
                 "llama3_json": lambda w: '{"name": "f", "parameters": %s}' % json.dumps({"w": w}, ensure_ascii=False),
                 "qwen3_coder": lambda w: f"<tool_call>\n<function=f>\n<parameter=w>\n{w}\n</parameter>\n</function>\n"
                                          "</tool_call>"}[parser]
    matcher = xgrammar.GrammarMatcher(every_char.compile(spec))
    for value, taken in (("über", True), ("née", True), ("\u0fcber", False), ("n\u0e9e", False)):
        matcher.reset()
        assert (matcher.accept_string(write(value)) and matcher.accept_token(0)) is taken, value


@pytest.mark.parametrize("regex,value", [(r"\xe9b", "éb"), (r"[\xe9b]{2}", "bé"), (r"[\u00e9b]+", "béé"),
                                         (r"[\x41-\x43]+", "CAB"), (r"a\x2db", "a-b"), (r"\x5d\x5c", "]\\"),
                                         (r"\\xe9", "\\xe9")])
def test_a_regex_s_code_point_escape_is_its_character(regex, value):
    """The engine's regex reader takes every hex digit after \\x (and after \\u in a class): "\\xe9b" held the
    output to U+0E9B, where Python, JavaScript and a JSON schema's pattern read "éb"."""
    import xgrammar

    vocab = ["<eos>"] + [chr(c) for c in range(1, 127)] + ["é", "\u0e9b"]
    matcher = xgrammar.GrammarMatcher(GrammarCompiler(raw_tokenizer_info(vocab, [0])).compile(
        StructuredSpec("regex", regex)))
    assert matcher.accept_string(value) and matcher.accept_token(0)


@pytest.mark.parametrize("kind,text,shown", [
    ("regex", r"nul\x00x", r"\x00, a NUL character"), ("regex", r"a\0b", r"\0, a NUL character"),
    ("grammar", 'root ::= "nul\\x00x"', r"\x00, a NUL character"),
    ("regex", r"\ud83d\ude00", r"\ud83d, half of a UTF-16 surrogate pair"),
    ("grammar", 'root ::= "\\ud83d\\ude00"', r"\ud83d, half of a UTF-16 surrogate pair"),
    ("json", json.dumps({"type": "string", "pattern": "^\\ud83d\\ude00$"}), r"\ud83d, half of a UTF-16"),
])
def test_a_nul_or_a_surrogate_escape_is_refused_by_name(compiler, kind, text, shown):
    """The engine drops a NUL (or ends a literal at it) and writes a surrogate's invalid bytes: served, the
    output broke the constraint with finish_reason stop (mojibake, or "nulx")."""
    with pytest.raises(GrammarError, match=re.escape(shown)):
        compiler.compile(StructuredSpec(kind, text))
