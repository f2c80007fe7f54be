"""Tool calling: the request's ``tools`` / ``tool_choice``, the history's tool
messages, and the calls read back from the output. Pure: no I/O, no tokenizer.

A parser per format the served families' chat templates ask for:

- ``hermes`` (Qwen2, Qwen2.5, Qwen3, Hermes): ``<tool_call>\\n{"name": ...,
  "arguments": {...}}\\n</tool_call>``, any number of them, text around them.
- ``llama3_json`` (Llama 3.1 / 3.2): the whole reply is ``{"name": ...,
  "parameters": {...}}`` (several joined by ``;``), possibly after
  ``<|python_tag|>`` (a special token the detokenizer already drops).
- ``qwen3_coder`` (Qwen3.5, Qwen3-Coder): ``<tool_call>\n<function=NAME>\n
  <parameter=KEY>\nVALUE\n</parameter>\n...</function>\n</tool_call>``
  (``xml_calls``).

``tool_choice: "required"`` or a named function is forced: the assistant turn
starts with the format's opening (``assistant_prefix``) and the output is
constrained to the call's JSON by structured outputs, so the reader starts
inside a call. A model whose template names no format serves forced calls
only, as a bare JSON object read as Llama 3's. ``tool_choice: "none"`` still renders the tools, as vLLM does
by default (its ``exclude_tools_when_tool_choice_none`` is off), and reads no
calls.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from mstar_actors.frontend import xml_calls
from mstar_actors.frontend.xml_calls import FUNCTION_CLOSE, FUNCTION_OPEN, PARAM_CLOSE, PARAM_OPEN, resolved
from mstar_actors.messages import ChatMessage, ToolCall

HERMES = "hermes"
LLAMA3_JSON = "llama3_json"
QWEN3_CODER = "qwen3_coder"
PARSERS = (HERMES, LLAMA3_JSON, QWEN3_CODER)
TOOL_CHOICES = ("none", "auto", "required")
MAX_TOOLS = 128
NAME_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")  # (whole: fullmatch) OpenAI's rule for function names

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
# What a forced call's assistant turn starts with, per format.
FORCED_PREFIX = {HERMES: HERMES_OPEN + "\n", LLAMA3_JSON: "", QWEN3_CODER: HERMES_OPEN + "\n"}
# The key the format names the arguments by.
ARGUMENTS_KEY = {HERMES: "arguments", LLAMA3_JSON: "parameters"}  # the JSON formats' key of a call's arguments
# What the format writes between two calls of one reply (the readers read it back).
CALL_SEPARATOR = {HERMES: f"\n{HERMES_CLOSE}\n{HERMES_OPEN}\n", LLAMA3_JSON: "; ",
                  QWEN3_CODER: f"\n{HERMES_CLOSE}\n{HERMES_OPEN}\n"}
# what may close the last of several forced calls (the separator's start, so a model that writes it may stop there)
CALLS_END = {HERMES: f"\n{HERMES_CLOSE}", LLAMA3_JSON: "", QWEN3_CODER: f"\n{HERMES_CLOSE}"}


class ToolError(ValueError):
    """A request's tool field is wrong; ``param`` names it (the frontend's 400)."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param
        self.message = message


# --------------------------------------------------------------------------
# The format, from the chat template
# --------------------------------------------------------------------------


def choose_parser(chat_template: Any, setting: str = "auto") -> str | None:
    """The tool-call format of a model: ``setting`` unless "auto", else the one
    its chat template asks for; None when the template names none."""
    if setting != "auto":
        return setting
    if isinstance(chat_template, dict):  # named templates: any of them
        chat_template = "\n".join(str(t) for t in chat_template.values())
    text = (chat_template or "").replace('\\"', '"')
    if HERMES_OPEN in text and FUNCTION_OPEN in text:  # Qwen3.5's calls of XML tags
        return QWEN3_CODER
    if HERMES_OPEN in text:
        return HERMES
    if PYTHON_TAG in text or '"parameters"' in text:
        return LLAMA3_JSON
    return None


def marker_problem(parser: str | None, special_tokens: set[str]) -> str | None:
    """Why calls of ``parser`` would not be seen in this tokenizer's output, or
    None. The frontend decodes without special tokens, so a ``<tool_call>``
    that is one would vanish (Qwen's are plain added tokens; Llama's
    ``<|python_tag|>`` is special, and the reader does without it)."""
    if parser in (HERMES, QWEN3_CODER) and HERMES_OPEN in special_tokens:
        return f"{HERMES_OPEN} is a special token of this tokenizer, dropped when decoding: tool calls won't be read"
    return None


# --------------------------------------------------------------------------
# The request: tools and tool_choice
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolRequest:
    """A request's validated tools. ``choice`` is "none", "auto", "required" or
    "function" (then ``function`` names it); ``parser`` is the model's format."""

    tools: list[dict]
    choice: str
    parser: str
    function: str | None = None
    max_calls: int | None = None  # 1 for ``parallel_tool_calls: false``; None: any number
    # a forced reply's text before the call's opening: what ends (or skips) a reasoning model's thinking
    reasoning_end: str = ""

    @property
    def is_forced(self) -> bool:
        return self.choice in ("required", "function")

    @property
    def reads_calls(self) -> bool:
        return self.choice != "none"

    @property
    def assistant_prefix(self) -> str:
        return self.reasoning_end + FORCED_PREFIX[self.parser] if self.is_forced else ""

    @property
    def is_strict(self) -> bool:
        """A tool asks for its calls' arguments held to its schema (OpenAI's ``strict``)."""
        return any(t["function"].get("strict") is True for t in self.tools)


def parse_tool_request(tools: Any, tool_choice: Any, parser: str | None,
                       parallel_tool_calls: Any = None) -> ToolRequest | None:
    """Validate ``tools``, ``tool_choice`` and ``parallel_tool_calls`` (raises
    ToolError); None: no tools."""
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise ToolError("parallel_tool_calls", "expected true or false")
    if tools is None or tools == []:
        if tool_choice not in (None, "none", "auto"):
            raise ToolError("tool_choice", "requires a non-empty tools list")
        return None
    specs = _parse_tools(tools)
    choice, function = _parse_tool_choice(tool_choice, {s["function"]["name"] for s in specs})
    if parser is None and choice == "auto":
        raise ToolError("tool_choice", "this model's chat template asks for no tool-call format the server reads "
                                       f"({' or '.join(PARSERS)}), so calls can't be told from text: set "
                                       'model.tool_call_parser, or send tool_choice "required" or a named function')
    # A forced call of a model with no format is a bare JSON object (vLLM's way), read as Llama 3's.
    return ToolRequest(tools=specs, choice=choice, parser=parser or LLAMA3_JSON, function=function,
                       max_calls=1 if parallel_tool_calls is False else None)


def _parse_tools(tools: Any) -> list[dict]:
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise ToolError("tools", f"expected a list of at most {MAX_TOOLS} tools like "
                                 '{"type": "function", "function": {"name": ..., "parameters": {...}}}')
    specs = [_parse_tool(f"tools[{i}]", tool) for i, tool in enumerate(tools)]
    names = [s["function"]["name"] for s in specs]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate is not None:
        raise ToolError("tools", f"the function name {duplicate!r} is given twice; names must be unique")
    return specs


# A tool's parameters nested deeper are refused: every reader of them (the template's tojson, the call's
# schema, the grammar) is bounded by the interpreter's recursion limit, a 500 past it.
MAX_SCHEMA_NESTING = 256


def _nested_past(schema: Any, limit: int) -> bool:
    """Whether ``schema`` holds objects or arrays more than ``limit`` deep (a walk, not recursion)."""
    todo = [(schema, 1)]
    while todo:
        node, depth = todo.pop()
        if depth > limit:
            return True
        children = node.values() if isinstance(node, dict) else node
        todo.extend((v, depth + 1) for v in children if isinstance(v, (dict, list)))
    return False


def _parse_tool(where: str, tool: Any) -> dict:
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise ToolError(f"{where}.type", 'expected a tool of type "function"')
    function = tool.get("function")
    if not isinstance(function, dict):
        raise ToolError(f"{where}.function", 'expected an object like {"name": ..., "parameters": {...}}')
    name = function.get("name")
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise ToolError(f"{where}.function.name", "expected 1 to 64 letters, digits, '_' or '-'")
    if function.get("description") is not None and not isinstance(function["description"], str):
        raise ToolError(f"{where}.function.description", "expected a string")
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise ToolError(f"{where}.function.parameters", "expected a JSON schema object")
    if parameters is not None and _nested_past(parameters, MAX_SCHEMA_NESTING):
        raise ToolError(f"{where}.function.parameters", f"nested more than {MAX_SCHEMA_NESTING} levels deep "
                                                        "(objects and arrays inside each other); flatten it, or "
                                                        "name a repeated part once in $defs and $ref it")
    held = call_parameters(function) if parameters is not None else {}  # (a $ref followed; one leading nowhere is
    for path, kind in _kinds(held):                                       # the grammar check's to name)
        if kind != "object":
            got = "one of no type (any JSON)" if kind is None else repr(kind)
            raise ToolError(f"{where}.function.parameters{path}", "a call's arguments are a JSON object: expected "
                                                                  f'a schema of "type": "object", got {got}')
    if function.get("strict") is not None and not isinstance(function["strict"], bool):
        raise ToolError(f"{where}.function.strict", f"expected true or false, got {function['strict']!r}")
    # The template sees the function as the client sent it (its keys and their order, strict among them), as a
    # template applied to the client's tools renders them; without parameters, a schema of none (a template
    # reading parameters.properties finds it).
    return {"type": "function", "function": function if parameters is not None else
            function | {"parameters": {"type": "object", "properties": {}}}}


_BRANCHING = ("anyOf", "oneOf", "allOf")


def call_parameters(function: dict) -> dict:
    """The schema a call of ``function`` (a parsed tool's) holds its arguments to: its parameters', an
    object (a schema without a type, {} or none, takes any JSON; the arguments are an object all the same).
    A schema that is a ``$ref`` into its own definitions (pydantic's recursive models) is that definition,
    its definitions beside it; one that leads nowhere is left for the grammar's check to name. A union at
    the top (``anyOf`` / ``oneOf`` / ``allOf``, no type) stays as it is: its branches are the objects
    (``_kinds``), and a type beside it would be a keyword the grammar cannot read there."""
    parameters = function.get("parameters") or {"properties": {}}
    if "$ref" in parameters:
        parameters = resolved(parameters, parameters)
        if "$ref" in parameters:
            return parameters
    if "type" not in parameters and any(k in parameters for k in _BRANCHING):
        return parameters
    return {"type": "object"} | parameters


def _kinds(held: dict) -> list[tuple[str, Any]]:
    """``(path, type)`` of what a call's arguments must be under ``held`` (``call_parameters``'): its own
    type, or each branch's of a union at its top (references followed; one leading nowhere left for the
    grammar to name), a branch of ``anyOf`` / ``oneOf`` of no type none (it takes any JSON); ``allOf``'s
    branches that name one, one at least."""
    if "type" in held or not any(k in held for k in _BRANCHING):
        return [("", held.get("type", "object"))]
    kinds = []
    for key in _BRANCHING:
        branches = held.get(key)
        named, nowhere = [], False
        for i, branch in enumerate(branches if isinstance(branches, list) else []):
            branch = resolved(branch, held) if isinstance(branch, dict) else branch
            if isinstance(branch, dict) and "$ref" in branch:
                nowhere = True
                continue
            kind = branch.get("type") if isinstance(branch, dict) else None
            if kind is not None or key != "allOf":
                named.append((f".{key}[{i}]", kind))
        kinds += named or ([(f".{key}", None)] if isinstance(branches, list) and branches and not nowhere else [])
    return kinds


def _parse_tool_choice(value: Any, names: set[str]) -> tuple[str, str | None]:
    if value is None:
        return "auto", None
    if isinstance(value, str):
        if value not in TOOL_CHOICES:
            raise ToolError("tool_choice", f'expected "none", "auto", "required" or '
                                           f'{{"type": "function", "function": {{"name": ...}}}}, got {value!r}')
        return value, None
    function = value.get("function") if isinstance(value, dict) and value.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise ToolError("tool_choice", 'expected {"type": "function", "function": {"name": ...}}')
    if name not in names:
        raise ToolError("tool_choice.function.name", f"{name!r} is not among the tools ({', '.join(sorted(names))})")
    return "function", name


def forced_calls_spec(request: ToolRequest) -> tuple[str, str]:
    """``(kind, spec)`` of a forced reply's ``StructuredSpec``: one call of
    ``forced_call_schema``, or with ``tool_choice: "required"`` and parallel
    calls allowed one or more, joined as the format joins them ("json_calls"),
    as vLLM's required choice takes a list of calls; the last may be closed
    as the format closes a call (hermes' ``</tool_call>``: without it a model
    that writes the separator's first newline would be held to another
    call)."""
    repeat = request.choice == "required" and request.max_calls != 1
    if request.parser == QWEN3_CODER:  # its own calls of XML tags (``xml_calls``), not JSON
        functions = [{"name": f["name"], "parameters": call_parameters(f)} for f in _forced_functions(request)]
        return "xml_calls", json.dumps({"functions": functions, "separator": CALL_SEPARATOR[QWEN3_CODER],
                                        "end": CALLS_END[QWEN3_CODER], "repeat": repeat})
    schema = forced_call_schema(request)
    if not repeat:
        return "json", schema
    return "json_calls", json.dumps({"schema": json.loads(schema), "separator": CALL_SEPARATOR[request.parser],
                                     "end": CALLS_END[request.parser]})


def strict_calls_spec(request: ToolRequest, answer: dict | None = None) -> tuple[str, str] | None:
    """``(kind, spec)`` of an ``auto`` reply with a strict tool ("tagged_calls"): free text, but a call,
    from the format's opening on, held to the format and its tool's schema (a tool not strict: to any
    object of arguments) to its end; None where no tool is strict (or the choice is not auto). With
    ``parallel_tool_calls: false`` the reply ends with its first call. ``answer`` (another constraint's
    ``{"kind", "spec", "param"}``: ``response_format``'s): the reply is that answer, or text with a call.
    ``spec``: ``{"trigger": the text that opens a call, "tags": [{"begin", "end", and "schema" (a JSON
    call's) or "functions" (an XML call's, ``xml_calls``')}], "one": ..., "answer": ...}``; Llama 3's
    bare calls, which its reader takes only as a whole reply (``parse_llama3_calls``), ``{"bare": {"schema":
    a call's, "separator", "tag": the one the reader skips}, "one", "answer"}``: the reply is its calls, or
    text that does not open with one (that answer, with ``answer``)."""
    if request.choice != "auto" or not request.is_strict:
        return None
    functions = [f | {"parameters": call_parameters(f) if f.get("strict") is True else {"type": "object"}}
                 for f in (t["function"] for t in request.tools)]
    if request.parser == QWEN3_CODER:
        tags = [{"begin": FORCED_PREFIX[QWEN3_CODER], "end": CALLS_END[QWEN3_CODER],
                 "functions": [{"name": f["name"], "parameters": f["parameters"]} for f in functions]}]
        trigger = HERMES_OPEN
    elif request.parser == HERMES:
        tags = [{"begin": FORCED_PREFIX[HERMES], "end": CALLS_END[HERMES],
                 "schema": json.loads(_call_schema(functions, ARGUMENTS_KEY[HERMES]))}]
        trigger = HERMES_OPEN
    else:  # bare objects, the whole reply (however spaced: the reader reads any object that opens it)
        bare = {"schema": json.loads(_call_schema(functions, ARGUMENTS_KEY[LLAMA3_JSON])),
                "separator": CALL_SEPARATOR[LLAMA3_JSON], "tag": PYTHON_TAG}
        return "tagged_calls", json.dumps({"bare": bare, "one": request.max_calls == 1}
                                          | ({"answer": answer} if answer else {}))
    return "tagged_calls", json.dumps({"trigger": trigger, "tags": tags, "one": request.max_calls == 1}
                                      | ({"answer": answer} if answer else {}))


def forced_call_schema(request: ToolRequest) -> str:
    """The JSON schema of a forced call's text: the format's object whose
    name is one of the allowed functions and whose arguments match that
    function's parameter schema (one ``anyOf`` branch per function)."""
    return _call_schema([f | {"parameters": call_parameters(f)} for f in _forced_functions(request)],
                        ARGUMENTS_KEY[request.parser])


def _call_schema(functions: list[dict], key: str) -> str:
    """The JSON schema of a call of one of ``functions`` (each's ``parameters`` its arguments')."""
    defs: dict = {}
    branches = []
    for i, f in enumerate(functions):
        parameters = f["parameters"]
        if _has_ref(parameters):  # its "#..." references point into it: it moves to the root's $defs, where they reach
            defs[f"call{i}"] = _rebase_refs(parameters, f"#/$defs/call{i}")
            parameters = {"$ref": f"#/$defs/call{i}"}
        branches.append({"type": "object", "properties": {"name": {"enum": [f["name"]]}, key: parameters},
                         "required": ["name", key], "additionalProperties": False})
    schema = branches[0] if len(branches) == 1 else {"anyOf": branches}
    return json.dumps(schema | {"$defs": defs} if defs else schema)


def _forced_functions(request: ToolRequest) -> list[dict]:
    """The functions a forced reply may call: every tool's (``required``) or the named one's."""
    return [f for f in (t["function"] for t in request.tools)
            if request.choice == "required" or f["name"] == request.function]


def _has_ref(schema: Any) -> bool:
    """Whether a "$ref" string is anywhere in ``schema`` (a walk, not recursion: a schema as deep as a body
    may be was a RecursionError, a 500)."""
    todo = [schema]
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            if isinstance(node.get("$ref"), str):
                return True
            todo.extend(node.values())
        elif isinstance(node, list):
            todo.extend(node)
    return False


def _rebase_refs(schema: Any, base: str) -> Any:
    """``schema`` with each reference inside it ("#", "#/...") made to point at
    the same place under ``base`` (a copy, built by a walk as ``_has_ref``'s)."""
    root: list = [schema]
    todo = [(root, 0)]  # (container, key) of a node of the copy still to copy in place
    while todo:
        parent, key = todo.pop()
        node = parent[key]
        if isinstance(node, dict):
            parent[key] = copy = dict(node)
            for k, v in node.items():
                if k == "$ref" and isinstance(v, str) and v.startswith("#"):
                    copy[k] = base + v[1:]
                else:
                    todo.append((copy, k))
        elif isinstance(node, list):
            parent[key] = copy = list(node)
            todo.extend((copy, i) for i in range(len(copy)))
    return root[0]


# --------------------------------------------------------------------------
# The history: assistant tool_calls and tool messages
# --------------------------------------------------------------------------


def parse_message_tool_fields(where: str, role: str, message: dict) -> dict:
    """ChatMessage's tool fields of one history message (raises ToolError):
    an assistant's ``tool_calls``, a tool message's ``tool_call_id``."""
    fields: dict = {}
    if role == "assistant" and message.get("tool_calls") is not None:
        calls = message["tool_calls"]
        if not isinstance(calls, list):
            raise ToolError(f"{where}.tool_calls", "expected a list of calls")
        fields["tool_calls"] = tuple(_parse_history_call(f"{where}.tool_calls[{j}]", c) for j, c in enumerate(calls))
    if role == "tool" and message.get("tool_call_id") is not None:
        if not isinstance(message["tool_call_id"], str):
            raise ToolError(f"{where}.tool_call_id", "expected a string")
        fields["tool_call_id"] = message["tool_call_id"]
    return fields


def _parse_history_call(where: str, call: Any) -> ToolCall:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ToolError(where, 'expected {"id": ..., "type": "function", '
                               '"function": {"name": ..., "arguments": "{...}"}}')
    arguments = function.get("arguments") or "{}"  # vLLM's: none, null or "" (a call cut at its name) are {}
    if isinstance(arguments, dict):  # vLLM takes the decoded object too
        arguments = json.dumps(arguments, ensure_ascii=False)
    if not isinstance(arguments, str) or not isinstance(_loads_or_none(arguments), dict):
        raise ToolError(f"{where}.function.arguments", "expected a JSON object as a string, like "
                        "'{\"city\": \"Paris\"}' (an empty string or null reads as {})")
    call_id = call.get("id")
    if call_id is not None and not isinstance(call_id, str):
        raise ToolError(f"{where}.id", f"expected the call's id as a string, got {type(call_id).__name__}")
    if call.get("type") not in (None, "function"):
        raise ToolError(f"{where}.type", 'expected "function", the only type of call')
    return ToolCall(id=call_id if call_id is not None else new_call_id(), name=function["name"], arguments=arguments)


def template_tool_fields(message: ChatMessage) -> dict:
    """A message's tool fields as Hugging Face chat templates read them:
    ``tool_calls`` with ``arguments`` decoded to a dict (templates ``tojson``
    it; OpenAI sends a JSON string), ``tool_call_id``, ``name`` and an
    assistant's reasoning as ``reasoning_content`` (Qwen3's template reads
    it) and ``reasoning`` (others', as vLLM passes both). Absent fields are
    left out: templates test ``message.tool_calls`` for presence."""
    fields: dict = {}
    if message.tool_calls:
        fields["tool_calls"] = [
            {"id": call.id, "type": "function",
             "function": {"name": call.name, "arguments": json.loads(call.arguments)}}
            for call in message.tool_calls
        ]
    if message.tool_call_id is not None:
        fields["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        fields["name"] = message.name
    if message.reasoning_content is not None:
        fields["reasoning_content"] = fields["reasoning"] = message.reasoning_content
    return fields


# --------------------------------------------------------------------------
# Templates that write no tools: llama.cpp's polyfills
# --------------------------------------------------------------------------

_PROBE = "probe7d3e1a"  # a name no template writes unless it renders the field holding it
_PROBE_ID = "a1b2c3d4e"  # nine letters and digits: Mistral's templates refuse other call ids
TOOLS_PREAMBLE = "You can call these tools:\n{tools}\nTo call one, reply with only: {call}"


@dataclass(frozen=True)
class TemplateToolCaps:
    """Which tool fields a chat template writes (``template_tool_caps``), and
    whether it takes a system message."""

    tools: bool
    tool_calls: bool
    system: bool


def template_tool_caps(render: Any) -> TemplateToolCaps:
    """Probe a template once: ``render(conversation, tools) -> text``. Only a
    render that leaves a probe out counts as not writing it: one that raises
    (a template checking what it is given) is left as it is."""
    def writes(conversation: list[dict], tools: list[dict] | None = None, raised: bool = True) -> bool:
        try:
            return _PROBE in render(conversation, tools)
        except Exception:
            return raised

    user = {"role": "user", "content": "hi"}
    system = {"role": "system", "content": _PROBE}
    tool = {"type": "function", "function": {"name": _PROBE, "description": "", "parameters": {"type": "object"}}}
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"id": _PROBE_ID, "type": "function", "function": {"name": _PROBE, "arguments": {}}}]}
    beside_system = writes([{**system, "content": "s"}, user], [tool], raised=False)  # some write them only there
    return TemplateToolCaps(tools=writes([user], [tool]) or beside_system,
                            tool_calls=writes([user, call, user]), system=writes([system, user], raised=False))


def with_tool_polyfills(conversation: list[dict], tools: list[dict] | None, caps: TemplateToolCaps,
                        parser: str = LLAMA3_JSON) -> tuple[list[dict], list[dict] | None]:
    """``(conversation, tools)`` for a template that would drop what it does
    not write (as llama.cpp polyfills them): the tools described in the
    system message (the first user message's start where the template takes
    no system message), an assistant's calls written into its content, in the
    format calls are read back in (``parser``). Without this the model would
    see neither, and a client's history would silently lose its calls."""
    if tools and not caps.tools:
        listed = json.dumps([t["function"] for t in tools], ensure_ascii=False)
        example = _written_calls(parser, [("<the tool's name>", "<its arguments as an object>")], quoted=False)
        conversation = _with_preamble(conversation, TOOLS_PREAMBLE.format(tools=listed, call=example), caps.system)
        tools = None
    if not caps.tool_calls:
        conversation = [_calls_as_content(m, parser) if m.get("tool_calls") else m for m in conversation]
    return conversation, tools


def _with_preamble(conversation: list[dict], text: str, system: bool) -> list[dict]:
    if system and conversation and conversation[0]["role"] == "system":
        return [_with_text(conversation[0], text, after=True), *conversation[1:]]
    if system:
        return [{"role": "system", "content": text}, *conversation]
    first = next((i for i, m in enumerate(conversation) if m["role"] == "user"), None)
    if first is None:
        return conversation
    return [*conversation[:first], _with_text(conversation[first], text, after=False), *conversation[first + 1:]]


def _calls_as_content(message: dict, parser: str) -> dict:
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
    return _with_text({k: v for k, v in message.items() if k != "tool_calls"}, _written_calls(parser, calls),
                      after=True, sep="\n")


def _written_calls(parser: str, calls: list[tuple[str, Any]], quoted: bool = True) -> str:
    """``calls`` (name, arguments) as a reply of ``parser``'s format writes them."""
    if parser == QWEN3_CODER:
        return xml_calls.written_calls(calls) if quoted else xml_calls.written_example()
    key = ARGUMENTS_KEY[parser]
    objects = [json.dumps({"name": name, key: arguments}, ensure_ascii=False) if quoted
               else f'{{"name": {name}, "{key}": {arguments}}}' for name, arguments in calls]
    if parser == HERMES:
        return "\n".join(f"{HERMES_OPEN}\n{o}\n{HERMES_CLOSE}" for o in objects)
    return CALL_SEPARATOR[LLAMA3_JSON].join(objects)


def _with_text(message: dict, text: str, after: bool, sep: str = "\n\n") -> dict:
    """``message`` with ``text`` after (or before) its content (a string, or a list of parts)."""
    content = message.get("content")
    if isinstance(content, list):
        part = {"type": "text", "text": text}
        return message | {"content": [*content, part] if after else [part, *content]}
    if not content:
        return message | {"content": text}
    return message | {"content": f"{content}{sep}{text}" if after else f"{text}{sep}{content}"}


# --------------------------------------------------------------------------
# The output: calls read back
# --------------------------------------------------------------------------


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass(frozen=True)
class ParsedCall:
    """One call read from the output; ``arguments`` is JSON text (OpenAI's shape)."""

    name: str
    arguments: str
    id: str = field(default_factory=new_call_id)

    def as_dict(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}

    def as_deltas(self, index: int) -> list[dict]:
        """A streamed call as OpenAI's and vLLM's streams send it: its id, type and
        name with empty arguments first, then its arguments (two chunks' deltas)."""
        head = {"index": index, "id": self.id, "type": "function", "function": {"name": self.name, "arguments": ""}}
        return [head, {"index": index, "function": {"arguments": self.arguments}}]


def parse_call(text: str) -> ParsedCall | None:
    """The call in ``text`` (one JSON object), or None when it is not one."""
    return _call_of(_loads_or_none(text.strip()), text)


def _call_of(obj: Any, text: str, untagged: bool = False) -> ParsedCall | None:
    """The call ``obj`` is (``text``: the JSON it was read from). Its
    arguments as written: the object after its name (``_written_arguments``,
    as a stream sends it) or the JSON text of a string; else re-encoded.
    ``untagged`` (a format whose calls are bare JSON, Llama 3's): an object
    without its arguments' key is no call (a JSON answer with a "name" key is
    content, as vLLM's parser reads it), where a tag says a call begins."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if untagged and "arguments" not in obj and "parameters" not in obj:
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):
        return ParsedCall(obj["name"], arguments) if isinstance(_loads_or_none(arguments), dict) else None
    if not isinstance(arguments, dict):
        return None
    written = _written_arguments(text)
    if written is not None:
        return ParsedCall(obj["name"], written)
    try:  # a number past a double's range reads as inf, which JSON cannot write back
        return ParsedCall(obj["name"], json.dumps(arguments, ensure_ascii=False, allow_nan=False))
    except ValueError:
        return None


def _written_arguments(text: str) -> str | None:
    """The arguments object of a call's JSON ``text`` as written, where the
    name comes first (as the formats and the grammar write a call), else None."""
    head = next((m for parser in ARGUMENTS_KEY if (m := _head_pattern(parser, r"(?=\{)").match(text))), None)
    if head is None:
        return None
    value, _, ended = _ValueEnd().take(text[head.end():])
    return value if ended else None


def _loads_or_none(text: str) -> Any:
    """JSON, or None: NaN and Infinity are no JSON (Python reads them). A
    number past a double's range is JSON (it reads as inf): a call keeps
    its arguments as written."""
    try:
        return json.loads(text, parse_constant=_refuse_constant)
    except ValueError:
        return None


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _less_cut_close(text: str) -> str:
    """``text`` less a ``</tool_call>`` that ``max_tokens`` cut short at its end."""
    return text[: len(text) - _partial_suffix(text, HERMES_CLOSE)]


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0


def _object_end(text: str) -> int | None:
    """Where the JSON object ``text`` starts with (after space) ends, if it does."""
    body = text.lstrip()
    if not body.startswith("{"):
        return None
    _, rest, ended = _ValueEnd().take(body)
    return len(text) - len(rest) if ended else None


class _BlockEnd:
    """Where a hermes block's closing tag is, in its text (past its opening
    tag) as it streams in: a block that starts with a JSON object ends at
    the first ``</tool_call>`` past the object (a tag inside its strings is
    the object's), or, where a ``<tool_call>`` comes first, there, untagged
    (``tagged`` False: a call whose block was never closed); any other
    block, or, once the reply has ended, one whose object never closed, at
    its first tag. Each character is read once."""

    def __init__(self) -> None:
        self._value = _ValueEnd()  # the block's object, where it has one
        self._mode = "start"  # -> "object" | "after": past the object | "plain": no object
        self._at = 0  # what is read of the text: the object's, or where the tag search goes on
        self.tagged = True  # the end found is a closing tag (else the next block's opening)

    def find(self, text: str, final: bool) -> int | None:
        """The tag's index in ``text`` (the block's text so far, only ever
        growing), or None while the block goes on."""
        if self._mode == "start":
            body = text.lstrip()
            if not body:
                return None
            self._mode, self._at = ("object", len(text) - len(body)) if body[0] == "{" else ("plain", 0)
        if self._mode == "object":
            _, rest, ended = self._value.take(text[self._at:])
            self._at = len(text) - len(rest)
            if ended:
                self._mode = "after"
            elif not final:
                return None
            else:
                self._mode, self._at = "plain", 0  # never closed: its first tag ends it
        at = text.find(HERMES_CLOSE, self._at)
        if self._mode == "after" and 0 <= (opening := text.find(HERMES_OPEN, self._at)) and (at < 0 or opening < at):
            self.tagged = False
            return opening
        if at < 0:
            self._at = max(self._at, len(text) - len(HERMES_CLOSE) + 1)
            return None
        return at


def _read_block(body: str, tagged: bool) -> tuple[ParsedCall | None, str]:
    """A block's (call, text after it): its whole text a call; or the call
    its object makes and the text after that object (content, as a stream
    sends it), less a closing tag ``max_tokens`` cut short where the block
    was never closed (``tagged`` False)."""
    call = parse_call(body)
    if call is not None:
        return call, ""
    end = _object_end(body)
    if end is not None and (call := parse_call(body[:end])) is not None:
        rest = body[end:]
        return call, rest if tagged else _less_cut_close(rest)
    return None, ""


class Llama3JsonReader:
    """Llama 3's format: a reply that starts with ``{`` (after whitespace and an
    optional ``<|python_tag|>``) is read as calls once it ends; any other
    reply is content, streamed as it comes. A reply that starts like a call
    but does not parse as calls is given back whole as content."""

    def __init__(self, max_calls: int | None = None):
        self.max_calls = max_calls
        self._mode = "undecided"  # -> "call" | "content"
        self._held = ""
        self.num_calls = 0

    def feed(self, text: str) -> tuple[str, list[ParsedCall]]:
        if self._mode == "content":
            return text, []
        self._held += text
        if self._mode == "undecided":
            head = self._held.lstrip().removeprefix(PYTHON_TAG).lstrip()
            if not head or PYTHON_TAG.startswith(head):
                return "", []
            self._mode = "call" if head.startswith("{") else "content"
        if self._mode == "content":
            held, self._held = self._held, ""
            return held, []
        return "", []

    def flush(self) -> tuple[str, list[ParsedCall]]:
        held, self._held = self._held, ""
        calls = parse_llama3_calls(held) if self._mode == "call" else None
        if not calls:
            return held, []
        self.num_calls += len(calls)
        return "", _within(calls, self.num_calls, self.max_calls)


def parse_llama3_calls(text: str) -> list[ParsedCall] | None:
    """Every call of ``text`` (JSON objects joined by ``;``), or None unless
    the whole text is calls."""
    text = text.strip().removeprefix(PYTHON_TAG)
    decoder = json.JSONDecoder(parse_constant=_refuse_constant)
    calls, at = [], 0
    while True:
        while at < len(text) and (text[at].isspace() or (text[at] == ";" and calls)):
            at += 1
        if at == len(text):
            return calls or None
        try:
            obj, end = decoder.raw_decode(text, at)
        except ValueError:
            return None
        call, at = _call_of(obj, text[at:end], untagged=True), end
        if call is None:
            return None
        calls.append(call)


def _within(calls: list[ParsedCall], num_read: int, max_calls: int | None) -> list[ParsedCall]:
    """The calls of ``calls`` (the last of ``num_read`` read so far) that are
    within ``max_calls``: later ones are dropped, as vLLM does."""
    if max_calls is None:
        return calls
    first = num_read - len(calls)
    return calls[: max(0, max_calls - first)]


def _past_separator(text: str) -> str:
    """``text`` past the whitespace, ``;`` and hermes tags between two calls."""
    while True:
        rest = text.lstrip(" \n;").removeprefix(HERMES_CLOSE).removeprefix(HERMES_OPEN)
        if rest == text:
            return rest
        text = rest


class _ValueEnd:
    """A JSON object or array streamed in pieces: where it ends (its nesting,
    strings and escapes followed across pieces). With ``tags``, one of them
    outside a string ends it too, cut (a model that left a brace out: the
    block's closing tag is not the value's); text that may begin one waits."""

    def __init__(self, depth: int = -1, tags: tuple[str, ...] = ()) -> None:
        self._depth = depth  # -1: its opening not read yet; 1: read from inside it (past its opening)
        self._in_string = self._escaped = False
        self._tags = tags
        self.is_closed = False  # ended at its closing bracket (not cut at a tag)

    def take(self, text: str) -> tuple[str, str, bool]:
        """(the value's part of ``text``, the text after its end, whether it
        ended); space before its opening is not the value's."""
        if self._depth < 0:
            text = text.lstrip()
        for i, char in enumerate(text):
            if self._in_string:
                self._escaped, self._in_string = (False, True) if self._escaped else (char == "\\", char != '"')
                continue
            if char == "<" and self._tags:
                if any(text.startswith(tag, i) for tag in self._tags):
                    return text[:i], text[i:], True
                if any(tag.startswith(text[i:]) for tag in self._tags):
                    return text[:i], text[i:], False  # (may be a tag: waits for the next piece)
            if char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth = 1 if self._depth < 0 else self._depth + 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self.is_closed = True
                    return text[: i + 1], text[i + 1:], True
        return text, "", False


# A call's opening through its name (the first group, a JSON string's text: a name that would not decode is none).
_NAME_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*)"')


def _head_pattern(parser: str, lookahead: str = "") -> re.Pattern:
    """A call's head as the grammar and the formats write it: ``{"name":
    "...", KEY: `` (the name the first group, a JSON string's text: a name
    that would not decode is no head)."""
    return re.compile(_NAME_HEAD.pattern + r'\s*,\s*"' + re.escape(ARGUMENTS_KEY[parser]) + r'"\s*:\s*' + lookahead)


def _name_in(head: re.Match) -> str:
    """The name a matched head (``_NAME_HEAD``, ``_head_pattern``) wrote, decoded."""
    return json.loads(f'"{head.group(1)}"')


def _head_delta(index: int, name: str) -> dict:
    """A streamed call's first entry: its id, type and name, arguments ""."""
    return {"index": index, "id": new_call_id(), "type": "function", "function": {"name": name, "arguments": ""}}


class ForcedCallStream:
    """A forced reply's calls streamed as they are written, as OpenAI's and
    vLLM's streams send them: a call's id, type and name (arguments "") once
    its name is complete, then its arguments in pieces as they come. The
    grammar holds the reply to ``{"name": ..., KEY: {...}}`` calls joined by
    the format's separator, so each piece is known to be the arguments'.
    Concatenated, a call's pieces are the arguments' JSON as the model wrote
    it, which ``read_calls`` (a response) reads through this same class."""

    def __init__(self, request: ToolRequest):
        self._head = _head_pattern(request.parser)
        self._function = request.function  # a named tool_choice's: the call's name whatever was written
        self._held = ""  # text not yet read: a head being written, or what follows a call
        self._value: _ValueEnd | None = None  # inside a call's arguments
        self._closing = False  # a call's arguments ended: its own closing brace next
        self.num_calls = 0

    def feed(self, text: str) -> list[dict]:
        """The ``delta.tool_calls`` entries ``text`` completes."""
        self._held += text
        deltas: list[dict] = []
        while self._held:
            if self._value is not None:
                piece, self._held, ended = self._value.take(self._held)
                if piece:
                    deltas.append({"index": self.num_calls - 1, "function": {"arguments": piece}})
                if ended:
                    self._value, self._closing = None, True
                continue
            if self._closing:
                rest = self._held.lstrip()
                self._held, self._closing = (rest[1:], False) if rest else ("", True)
                continue
            rest = _past_separator(self._held)
            match = self._head.match(rest)
            if match is None:
                break  # a head or a separator still being written (or a cut reply's end)
            self._held = rest[match.end():]
            self.num_calls += 1  # as many as the grammar lets through (one without parallel calls)
            deltas.append(_head_delta(self.num_calls - 1, _name_in(match)))
            self._value = _ValueEnd()
        return deltas

    def flush(self) -> list[dict]:
        """The end of the reply: what is held is a call's closing and
        separators, or a head ``max_tokens`` cut. A cut head whose name was
        written (or a named tool_choice's, never yet read) is a call of empty
        arguments, as vLLM's named call; the rest is the format's markup,
        never content."""
        held, self._held = self._held, ""
        if self._value is not None or self._closing:
            return []
        written = _NAME_HEAD.match(_past_separator(held))
        name = _name_in(written) if written else self._function if not self.num_calls else None
        if name is None:
            return []
        self.num_calls += 1
        return [_head_delta(self.num_calls - 1, name)]


_TAGS = (HERMES_OPEN, HERMES_CLOSE)  # where a call's object ends at the latest, its closing brace left out


class HermesCallStream:
    """A streamed reply of the ``hermes`` format (``tool_choice: "auto"``):
    chunk deltas of content and calls in the order they are written, each
    call's arguments as they come (as vLLM's hermes parser streams them).

    Outside ``<tool_call>`` blocks text that may open one is held, whitespace
    between calls is dropped, whitespace goes out only with text (calls with
    whitespace alone around them: no content). A block whose text starts
    with a call's head and an object (``{"name": "...", "arguments": {``) is
    a call at once: its id, type and name, then its arguments' JSON in
    pieces as written, the rest of its object (its closing brace, any tag
    inside its strings) read, then text up to ``</tool_call>`` content (in a
    block that never closes, at the reply's end, less a closing tag cut
    short). Any other block is held to its end (``_BlockEnd``: the tag past
    its JSON object) and read whole (``_read_block``): a call (head and
    arguments in two deltas), or content with its markup. A whole reply is
    read by this reader too (``read_calls``), so a response and a stream give
    the same calls where their arguments are valid JSON: a block cut by
    max_tokens inside its arguments, or one that began as a call's head and
    object and closes without valid JSON, streams as a call of the arguments
    as written (as vLLM's hermes parser streams it), and a whole reply with
    such a call is content (as vLLM's reads it: ``read_calls``). Calls past
    ``max_calls`` are read and dropped."""

    def __init__(self, max_calls: int | None = None):
        self.max_calls = max_calls
        self._head = _head_pattern(HERMES, r"(?=\{)")
        self._held = ""
        # "out" | "block": a block's head not read | "arguments" | "rest": the call's object past its arguments
        # | "tag": to the block's closing tag
        self._state = "out"
        self._value = _ValueEnd()  # a call's arguments
        self._rest = ""  # read past a call's arguments, its object not closed yet
        self._end = _BlockEnd()  # where a block read whole ends
        self._final = False  # the reply ended
        self._shown = False  # the block's call is within max_calls
        # whitespace not sent yet: content once text follows, else it only separates (``_content``)
        self._space = ""
        self._lead = ""  # whitespace before the first call with nothing before it: content only if text follows
        self._said = False  # content with text in it since the last call (or the reply's start)
        self.num_calls = 0  # calls read, those past max_calls included

    def feed(self, text: str) -> list[dict]:
        """The chunk deltas (``{"content": ...}`` / ``{"tool_calls": [...]}``) ``text`` completes."""
        self._held += text
        deltas: list[dict] = []
        while self._step(deltas):
            pass
        return _joined(deltas)

    def flush(self) -> list[dict]:
        """The end of the reply: held content, or an unclosed block read whole
        (a model may stop at EOS before ``</tool_call>``)."""
        self._final = True
        deltas = self.feed("")
        held, self._held = self._held, ""
        state, self._state = self._state, "out"
        if state in ("out", "tag"):  # ("tag": text after a call whose block never closed is content)
            last = []
            if state == "tag":  # less its closing tag, cut short
                held = _less_cut_close(held)
            self._content(held, last)
            if self._space and (self._said or not self.num_calls):  # after text, or a reply of whitespace alone
                last.append({"content": self._lead + self._space})
            self._space = self._lead = ""
        elif state == "block":
            last = self._whole_block(held.removesuffix(HERMES_CLOSE), closed=False)
        elif state == "rest":  # the call's object never closed: what followed its arguments is text
            last = []
            self._content(_less_cut_close(self._rest + held), last)
            if self._space and self._said:
                last.append({"content": self._space})
            self._space = ""
        else:
            last = []  # a call's arguments, cut: as far as they went
        return _joined(deltas + last)

    def _step(self, deltas: list[dict]) -> bool:
        """Read one piece of the held text; False when the rest must wait."""
        if self._state == "out":
            at = self._held.find(HERMES_OPEN)
            if at >= 0:
                self._content(self._held[:at], deltas)
                if self._said and self._space:  # after text: that text's
                    deltas.append({"content": self._space})
                elif not self.num_calls:  # before the first call: content, if any text follows
                    self._lead += self._space
                self._space = ""  # (between calls, it only separates them)
                self._held, self._state, self._end = self._held[at + len(HERMES_OPEN):], "block", _BlockEnd()
                return True
            emit = self._held[: len(self._held) - _partial_suffix(self._held, HERMES_OPEN)]
            self._content(emit, deltas)
            self._held = self._held[len(emit):]
            return False
        if self._state == "block":
            match = self._head.match(self._held)
            if match is not None:
                self.num_calls += 1
                self._said = False
                self._shown = self.max_calls is None or self.num_calls <= self.max_calls
                if self._shown:
                    deltas.append({"tool_calls": [_head_delta(self.num_calls - 1, _name_in(match))]})
                self._held, self._state, self._value = self._held[match.end():], "arguments", _ValueEnd(tags=_TAGS)
                return True
            return self._block_to_its_end(deltas)
        if self._state == "arguments":
            piece, self._held, ended = self._value.take(self._held)
            if piece and self._shown:
                deltas.append({"tool_calls": [{"index": self.num_calls - 1, "function": {"arguments": piece}}]})
            if ended:  # (cut at a tag: the block's end is next)
                cut = not self._value.is_closed
                self._state, self._value = ("tag" if cut else "rest"), _ValueEnd(depth=1, tags=_TAGS)
                self._rest = ""
            return ended
        if self._state == "rest":  # more keys, its closing brace: the call's, not output
            taken, self._held, ended = self._value.take(self._held)
            self._rest += taken
            if ended:
                self._state = "tag"
                if not self._value.is_closed and self._rest.strip():  # the object never closed: text after
                    self._content(self._rest, deltas)                  # its arguments is content
            return ended
        at = self._held.find(HERMES_CLOSE)  # "tag"
        opening = self._held.find(HERMES_OPEN)
        if opening >= 0 and (at < 0 or opening < at):  # the next block: this one was never closed, text between
            self._content(self._held[:opening], deltas)
            self._held, self._state = self._held[opening:], "out"
            return True
        if at < 0:
            return False  # (held: content if the block never closes)
        if self._held[:at].strip():  # text after the call in its block: content, as a response reads it
            self._content(self._held[:at], deltas)
        self._held, self._state = self._held[at + len(HERMES_CLOSE):], "out"
        return True

    def _block_to_its_end(self, deltas: list[dict]) -> bool:
        """A block read whole once its end is written (``_whole_block``); False while it goes on."""
        at = self._end.find(self._held, self._final)
        if at is None:
            return False
        tagged = self._end.tagged
        body, self._state = self._held[:at], "out"
        self._held = self._held[at + (len(HERMES_CLOSE) if tagged else 0):]
        deltas += self._whole_block(body, closed=tagged)
        return True

    def _content(self, text: str, deltas: list[dict]) -> None:
        """``text`` as content, the whitespace before it with it; whitespace
        alone waits (``_space``): a reply's calls with only whitespace around
        them have no content, as ``read_calls`` reads them."""
        if not text.strip():
            self._space += text
            return
        deltas.append({"content": self._lead + self._space + text})
        self._lead = self._space = ""
        self._said = True

    def _whole_block(self, body: str, closed: bool) -> list[dict]:
        call, rest = _read_block(body, closed)
        deltas: list[dict] = []
        if call is None:
            self._content(HERMES_OPEN + body + (HERMES_CLOSE if closed else ""), deltas)
            return deltas
        self.num_calls += 1
        self._said = False
        if self.max_calls is None or self.num_calls <= self.max_calls:
            deltas += [{"tool_calls": [part]} for part in call.as_deltas(self.num_calls - 1)]
        self._content(rest, deltas)
        return deltas


class XmlCallStream(HermesCallStream):
    """A ``qwen3_coder`` reply (``xml_calls``), streamed in the deltas
    ``HermesCallStream`` sends: a call's id and name once ``<function=NAME>``
    is written, then its arguments' JSON a parameter at a time; a whole
    reply is read through it (``read_calls``). States past
    ``HermesCallStream``'s: "block" waits for ``<function=NAME>`` (a block
    that opens otherwise is read whole at its end: content with its markup),
    "params" reads the call's parameters to ``</function>`` (or, left out,
    to the block's end or the next call), then "tag" as hermes reads to
    ``</tool_call>``, another ``<function=`` in the block a call too.
    ``forced``: the reply starts inside a block (its prompt ended with the
    opening) and no text is content. A key written twice keeps its first
    value (the arguments stay one JSON object as they stream)."""

    def __init__(self, request: ToolRequest, forced: bool = False):
        super().__init__(request.max_calls)
        self._schemas = {t["function"]["name"]: call_parameters(t["function"]) for t in request.tools}  # as held
        self._forced = forced
        self._value_end = xml_calls.FORCED_VALUE_END if forced else xml_calls.VALUE_END
        self._function = request.function  # a named tool_choice's: its call whatever was written
        self._name = ""  # the call being read
        self._keys: set[str] = set()  # its parameters read
        if forced:
            self._state = "block"

    def flush(self) -> list[dict]:
        if self._state == "params":  # cut: the parameters as far as they went, a value cut as far as written
            self._final = True
            deltas = self.feed("")
            held = self._held.lstrip()
            if self._state == "params" and held.startswith(PARAM_OPEN) and ">" in held:
                name, _, value = held[len(PARAM_OPEN):].partition(">")
                deltas += self._parameter(name, value[: len(value) - _partial_suffix(value, PARAM_CLOSE)])
            if self._state == "params":
                self._held, self._state = "", "out"
                deltas += self._arguments(self._close())
            return _joined(deltas + super().flush())
        if self._forced and self.num_calls == 0 and self._function is not None:  # nothing read: the named call
            self._held, self.num_calls = "", 1
            return [{"tool_calls": [_head_delta(0, self._function)]}, {"tool_calls": [self._piece("{}")]}]
        return super().flush()

    def _step(self, deltas: list[dict]) -> bool:
        if self._state == "block":
            return self._block(deltas)
        if self._state == "params":
            return self._params(deltas)
        if self._state == "tag":  # another call in the same block
            body = self._held.lstrip()
            if body.startswith(FUNCTION_OPEN):
                self._held, self._state = body, "block"
                return True
            if body and FUNCTION_OPEN.startswith(body) and not self._final:
                return False
        return super()._step(deltas)

    def _block(self, deltas: list[dict]) -> bool:
        """A block's start: ``<function=NAME>`` is a call; any other opening, the block read whole."""
        body = self._held.lstrip()
        if body.startswith(FUNCTION_OPEN) and ">" in body:
            name, _, self._held = body[len(FUNCTION_OPEN):].partition(">")
            self.num_calls += 1
            self._said = False
            self._shown = self.max_calls is None or self.num_calls <= self.max_calls
            self._name, self._keys, self._state = name.strip(), set(), "params"
            if self._shown:
                deltas.append({"tool_calls": [_head_delta(self.num_calls - 1, self._name)]})
            return True
        if FUNCTION_OPEN.startswith(body[: len(FUNCTION_OPEN)]) and not self._final:
            return False  # its opening still being written
        if self._forced:  # (the grammar writes the opening: only a cut reply gets here)
            self._held = ""
            return False
        return self._block_to_its_end(deltas)  # no call: to its end, then content with its markup

    def _whole_block(self, body: str, closed: bool) -> list[dict]:
        """A block that holds no call (hermes JSON included: not this format's), as content."""
        deltas: list[dict] = []
        self._content(HERMES_OPEN + body + (HERMES_CLOSE if closed else ""), deltas)
        return deltas

    def _params(self, deltas: list[dict]) -> bool:
        body = self._held.lstrip()
        ends = ((FUNCTION_CLOSE, "tag", True), (HERMES_CLOSE, "out", True), (HERMES_OPEN, "out", False),
                (FUNCTION_OPEN, "block", False))  # the call's end as written, or its closing tags left out
        for tag, state, consumed in ends:
            if body.startswith(tag):
                self._held, self._state = body[len(tag):] if consumed else body, state
                deltas += self._arguments(self._close())
                return True
        if body.startswith(PARAM_OPEN) and ">" in body:
            name, _, rest = body[len(PARAM_OPEN):].partition(">")
            end = self._value_end.search(rest)
            if end is None:
                return False  # its value still being written
            self._held = rest[end.end() if end.group() == PARAM_CLOSE else end.start():]
            deltas += self._parameter(name, rest[: end.start()])
            return True
        if any(tag.startswith(body[: len(tag)]) for tag in (PARAM_OPEN, *(t for t, _, _ in ends))) \
                and not self._final:
            return False  # a tag still being written
        at = body.find("<", 1)  # text between parameters is none of the call's
        if at < 0:
            self._held = ""
            return False
        self._held = body[at:]
        return True

    def _parameter(self, name: str, raw: str) -> list[dict]:
        key = name.strip()
        if key in self._keys:
            return []
        schema = self._schemas.get(self._name, {})
        properties = schema.get("properties") if isinstance(schema, dict) else None
        named = (properties or {}).get(key)  # (None: a key the schema does not name)
        value = xml_calls.read_value(raw, xml_calls.resolved(named, schema))
        self._keys.add(key)
        piece = ("{" if len(self._keys) == 1 else ", ") + json.dumps(key, ensure_ascii=False) + ": "
        return self._arguments(piece + json.dumps(value, ensure_ascii=False))

    def _close(self) -> str:
        return "}" if self._keys else "{}"

    def _arguments(self, piece: str) -> list[dict]:
        return [{"tool_calls": [self._piece(piece)]}] if self._shown else []

    def _piece(self, text: str) -> dict:
        return {"index": self.num_calls - 1, "function": {"arguments": text}}

    def _content(self, text: str, deltas: list[dict]) -> None:
        if not self._forced:
            super()._content(text, deltas)


def _joined(deltas: list[dict]) -> list[dict]:
    """Adjacent content deltas as one."""
    out: list[dict] = []
    for delta in deltas:
        if "content" in delta and out and "content" in out[-1]:
            out[-1] = {"content": out[-1]["content"] + delta["content"]}
        elif delta.get("content", True):
            out.append(delta)
    return out


def stream_reader(request: ToolRequest) -> ForcedCallStream | HermesCallStream | Llama3JsonReader:
    """A streamed reply's reader: a forced call's arguments and a hermes
    reply's calls as they are written; Llama 3's calls once the reply ends
    (a reply is calls only if all of it parses as calls)."""
    if request.parser == QWEN3_CODER:
        return XmlCallStream(request, forced=request.is_forced)
    if request.is_forced:
        return ForcedCallStream(request)
    if request.parser == HERMES:
        return HermesCallStream(request.max_calls)
    return Llama3JsonReader(max_calls=request.max_calls)


def read_calls(request: ToolRequest, text: str) -> tuple[str | None, list[ParsedCall]]:
    """A whole reply's (content or None, calls), read as a stream reads it.
    A forced reply's calls are ``ForcedCallStream``'s: each call's
    arguments as written, and a reply cut by ``max_tokens`` still a call
    whose arguments go as far as they were written (as vLLM's named call: a
    named tool_choice's call whatever was written, a required one's once its
    name is; the format's markup is never content). A ``hermes`` reply of
    ``"auto"`` whose calls' arguments are not all valid JSON (a block the
    model closed, or ended, inside its object; NaN) is all content, markup
    and all, as vLLM's hermes parser reads a whole reply: its stream sent
    the calls as they were written."""
    if request.is_forced and request.parser != QWEN3_CODER:
        forced = ForcedCallStream(request)
        return None, _calls_of(forced.feed(text) + forced.flush())
    if request.parser == LLAMA3_JSON:
        reader = Llama3JsonReader(max_calls=request.max_calls)
        content, calls = reader.feed(text)
        tail, more = reader.flush()
        content, calls = content + tail, calls + more
        return (None if calls and not content.strip() else content), calls
    stream = stream_reader(request)  # hermes and qwen3_coder: the reply read as it streams
    deltas = stream.feed(text) + stream.flush()
    content = "".join(d.get("content", "") for d in deltas)
    calls = _calls_of([entry for d in deltas for entry in d.get("tool_calls", [])])
    if request.parser == HERMES and not request.is_forced and any(
            _loads_or_none(call.arguments) is None for call in calls):
        return text, []  # a block of no valid JSON: the reply is content as written, as vLLM's hermes reads one
    return (None if request.is_forced or (calls and not content.strip()) else content), calls


def _calls_of(entries: list[dict]) -> list[ParsedCall]:
    """The calls that streamed ``delta.tool_calls`` entries make, joined."""
    calls: list[ParsedCall] = []
    for entry in entries:
        if "id" in entry:
            calls.append(ParsedCall(entry["function"]["name"], "", entry["id"]))
        else:
            call = calls[entry["index"]]
            calls[entry["index"]] = ParsedCall(call.name, call.arguments + entry["function"]["arguments"], call.id)
    return calls


def finish_reason(request: ToolRequest, engine_reason: str | None, num_calls: int,
                  stop_reason: str | int | None = None) -> str | None:
    """``tool_calls`` when a reply that ended by itself made calls, as vLLM's:
    an ``"auto"`` or ``"required"`` one (a named function's keeps the engine's
    reason, as vLLM's and OpenAI's); a cut one stays ``length``, and one a
    client's stop string or token ended stays ``stop`` (``stop_reason``: its
    last call may be cut short)."""
    ended = num_calls and engine_reason == "stop" and stop_reason is None
    return "tool_calls" if ended and request.choice != "function" else engine_reason
