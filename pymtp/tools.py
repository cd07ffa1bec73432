"""Tool calls: OpenAI ``tools`` and ``tool_choice`` into a prompt and a grammar, and the
model's text back into ``tool_calls``.

The format is Qwen's (and Hermes'): the system turn lists the functions as JSON inside
``<tools></tools>``, and the model answers a call as

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Results come back as ``tool`` messages, which the template renders inside
``<tool_response></tool_response>``. The GGUF's own template renders all of this where it
has a tools section; ChatML without one uses ``chat.FALLBACK_CHATML``'s. Qwen3.5's
templates ask for the XML form (``<function=name><parameter=p>value</parameter>``),
which ``tool_reply.parse_tool_calls`` reads too, and which a forced call's grammar writes where the
template asks for it (``tool_call_grammar``'s ``xml``).

``tool_choice``: "auto" lets the model choose (its text is parsed for calls), "none"
keeps the tools in the prompt but reads no call from the reply (as llama-server and vLLM:
the prompt stays that of the turns before, which the prompt cache holds, and the model
knows what it cannot call now), "required" and a named function constrain the reply
with a grammar (constraint.py) to one call (or several, with ``parallel_tool_calls``) of
the allowed functions, each with arguments under its ``parameters`` schema. A format
beside tools (a grammar, a JSON schema) is the text reply's, as in OpenAI's API: under
"auto" the reply is calls or that format (``reply_constraint``). Under "auto" with a
``strict`` function (and no format) the reply is any text, then calls that follow the
schemas (``auto_call_grammar``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from typing import Any

from .config import ParamError
from .constraint import constraint_for, either_grammar, json_schema_grammar, strict_strings, text_until
from .schema_refs import RefError, flat_refs
from .stops import Stops
from .tool_reply import CALL_CLOSE, CALL_OPEN, ToolCallStream, in_value, parse_tool_calls, value_types

@dataclass(frozen=True)
class ToolChoice:
    """What a request allows: "auto", "none", "required", or "function" with its ``name``;
    ``allowed`` (OpenAI's ``allowed_tools``) narrows the functions "auto" and "required"
    may call, all of them still in the prompt (which the prompt cache keeps)."""

    mode: str
    name: str | None = None
    allowed: tuple[str, ...] | None = None

    @property
    def forced(self) -> bool:
        """The reply must be a call: a grammar constrains it."""
        return self.mode in ("required", "function")

    def callable(self, tools: list[dict]) -> list[dict]:
        """The functions of ``tools`` a call may name."""
        names = {self.name} if self.mode == "function" else set(self.allowed) if self.allowed is not None else None
        return [t for t in tools if names is None or t["function"]["name"] in names]

    def widened(self) -> ToolChoice:
        """This choice with a call forced, among the same functions."""
        return self if self.forced else replace(self, mode="required")


# --- the request's fields --------------------------------------------------------------

def check_tools(tools: Any, param: str = "tools") -> list[dict]:
    """OpenAI's ``tools``: a list of {"type": "function", "function": {"name", "description"?,
    "parameters"?}}, names unique; returns it with every ``parameters`` an object schema."""
    if not isinstance(tools, list):
        raise ParamError(param, f"{param} must be a list of {{\"type\": \"function\", \"function\": {{...}}}} objects")
    out, seen = [], set()
    for i, tool in enumerate(tools):
        where = f"{param}[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise ParamError(param, f'{where} must be {{"type": "function", "function": {{"name": ..., '
                             f'"parameters": {{...}}}}}}; only function tools are supported')
        fn = tool["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
            raise ParamError(param, f"{where}.function.name must be 1-64 letters, digits, '_', '.' or '-', "
                             f"got {name!r}")
        if name in seen:
            raise ParamError(param, f"{where}.function.name {name!r} is given twice; names must be unique")
        seen.add(name)
        params = fn.get("parameters")
        if params is None:       # absent or null: a function of no parameters
            params = {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise ParamError(param, f"{where}.function.parameters must be a JSON schema object")
        for key, kind, what in (("description", str, "a string"), ("strict", bool, "true or false")):
            if fn.get(key) is not None and not isinstance(fn[key], kind):
                raise ParamError(param, f"{where}.function.{key} must be {what}, got {fn[key]!r}")
        out.append({"type": "function", "function": {**fn, "parameters": params}})
    return out


def check_tool_choice(choice: Any, tools: list[dict], param: str = "tool_choice") -> ToolChoice:
    """"auto" (the default with tools), "none", "required", or {"type": "function",
    "function": {"name": N}} naming one of ``tools``."""
    names = [t["function"]["name"] for t in tools]
    if choice is None:
        return ToolChoice("auto" if tools else "none")
    if choice in ("auto", "none", "required"):
        if choice == "required" and not tools:
            raise ParamError(param, 'tool_choice "required" needs tools; give the functions in tools')
        return ToolChoice(choice)
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in names:
            have = ", ".join(map(repr, names)) or "none"
            raise ParamError(param, f"tool_choice names function {name!r}, which tools does not hold "
                             f"(tools has: {have}); name one of those or add it to tools")
        return ToolChoice("function", name)
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        return _allowed_tools(choice.get("allowed_tools"), names, f"{param}.allowed_tools")
    raise ParamError(param, 'tool_choice must be "auto", "none", "required", {"type": "function", '
                     f'"function": {{"name": ...}}}} or {{"type": "allowed_tools", ...}}, got {choice!r}')


def _allowed_tools(spec: Any, names: list[str], param: str) -> ToolChoice:
    """OpenAI's {"mode": "auto" | "required", "tools": [{"type": "function", "function":
    {"name": N}}, ...]}: the functions a call may name, among ``names``."""
    if not isinstance(spec, dict) or spec.get("mode") not in ("auto", "required") \
            or not isinstance(spec.get("tools"), list) or not spec["tools"]:
        raise ParamError(param, f'{param} must be {{"mode": "auto" or "required", "tools": [{{"type": "function", '
                         f'"function": {{"name": ...}}}}, ...]}}, got {spec!r}')
    allowed = []
    for i, tool in enumerate(spec["tools"]):
        fn = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if name not in names:
            have = ", ".join(map(repr, names)) or "none"
            raise ParamError(f"{param}.tools[{i}]", f"{param}.tools[{i}] must name a function of tools as "
                             f'{{"type": "function", "function": {{"name": ...}}}} (tools has: {have}), got {tool!r}')
        allowed.append(name)
    return ToolChoice(spec["mode"], allowed=tuple(allowed))


def template_messages(messages: list[dict]) -> list[dict]:
    """Messages as chat templates read them: an assistant's tool call arguments as objects
    (OpenAI sends them as JSON text; Qwen's templates iterate or dump them)."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            m = {**m, "tool_calls": [_call_for_template(c) for c in calls]}
        out.append(m)
    return out


def _call_for_template(call: dict) -> dict:
    fn = call.get("function", {})
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            parsed = json.loads(args)
        except json.JSONDecodeError:
            parsed = None
        if isinstance(parsed, dict):
            args = parsed
    return {**call, "function": {**fn, "arguments": args}}


@dataclass(frozen=True)
class ToolPlan:
    """A chat request's tools, checked: what the template gets, the grammar a forced
    reply follows, and how the reply is read back."""

    tools: list[dict]
    choice: ToolChoice
    parallel: bool = True
    grammar: str | None = None
    # the reply is calls or a format (``beside``): calls only where it starts with one, so
    # the format's text (a JSON string holding a call's markup) is never read as a call
    calls_lead: bool = False

    @classmethod
    def of(cls, tools: Any, tool_choice: Any = None, parallel_tool_calls: Any = True) -> ToolPlan | None:
        """None for a request without tools (and no tool_choice beyond "none"/"auto").
        A None ``parallel_tool_calls`` is its default, as JSON's null is elsewhere."""
        if parallel_tool_calls is None:
            parallel_tool_calls = True
        if not isinstance(parallel_tool_calls, bool):
            raise ParamError("parallel_tool_calls", f"parallel_tool_calls must be true or false, "
                             f"got {parallel_tool_calls!r}")
        if tools is None or tools == []:
            check_tool_choice(tool_choice if tool_choice != "auto" else None, [])
            return None
        try:
            tools = check_tools(tools)
            choice = check_tool_choice(tool_choice, tools)
            grammar = tool_call_grammar(tools, choice, parallel_tool_calls)
            if grammar is None or len(choice.callable(tools)) < len(tools):
                # the same tools are refused or taken whatever tool_choice says (OpenAI
                # checks every schema): where no grammar holds them all, one, unused, of
                # every function refuses them as a forced call's would (~0.3 ms a function)
                tool_call_grammar(tools, ToolChoice("required"), parallel_tool_calls)
            return cls(tools, choice, parallel_tool_calls, grammar)
        except RecursionError:      # the schema walks recurse once per level: this was a 500
            raise _too_deep() from None

    def beside(self, formatted: bool) -> ToolPlan:
        """This plan where the request has a format too (a grammar, a JSON schema): under
        "auto" the reply is calls or that format (``reply_constraint``), known by its start."""
        return replace(self, calls_lead=True) if formatted and self.choice.mode == "auto" else self

    @property
    def strict(self) -> bool:
        """A function asks for ``strict`` arguments: under "auto" the calls follow the
        schemas as a forced call's do (``auto_call_grammar``)."""
        return any(t["function"].get("strict") is True for t in self.choice.callable(self.tools))

    @property
    def template_tools(self) -> list[dict]:
        """What the template's ``tools`` is: all of them, under "none" too."""
        return self.tools

    @property
    def parses(self) -> bool:
        return self.choice.mode != "none"

    @property
    def schemas(self) -> dict[str, dict]:
        """Each function's ``parameters`` by its name: the calls a reply may make."""
        return {t["function"]["name"]: t["function"]["parameters"] for t in self.choice.callable(self.tools)}

    def stream(self) -> ToolCallStream:
        """A reader of the reply as it streams (``ToolCallStream``) for these tools."""
        return ToolCallStream(self.calls_lead, self.schemas)

    def uncut(self, text: str) -> str:
        """A whole reply that max_tokens cut, less the call it cut (``ToolCallStream.finish``),
        as a stream of it hands it out."""
        if not self.parses:
            return text
        stream = self.stream()
        stream.feed(text)
        stream.finish(cut=True)
        return text[:len(text) - stream.dropped]

    def stops(self, strings: list[str], thinking: bool | None = None) -> Stops | list[str]:
        """A reply's stop strings: where it is read for calls, not inside a call's block
        (its JSON or markup may hold them: a cut call is neither a call nor text).
        ``thinking``: where the reply's thinking is read apart (reasoning.reply_split),
        whose block holds no calls."""
        return Stops(tuple(strings), (CALL_OPEN, CALL_CLOSE), in_value, thinking) if self.parses else strings

    def read(self, text: str) -> tuple[str, list[dict]]:
        """A whole reply as (content, calls); without ``parallel`` the first call only."""
        content, calls = parse_tool_calls(text, self.calls_lead, self.schemas) if self.parses else (text, [])
        return content, calls if self.parallel else calls[:1]


# --- the grammar of a forced call ------------------------------------------------------

def tool_call_grammar(tools: list[dict], choice: ToolChoice, parallel: bool = True, xml: bool = False) -> str | None:
    """The GBNF grammar a forced reply follows: ``<tool_call>`` blocks of the allowed
    functions, JSON arguments under each one's schema (schema_grammar.py's converter),
    one block or, with ``parallel``, one or more. None where the model chooses. ``xml``:
    the calls in the XML form the template asks for (Qwen3.5's, ``xml_call_grammar``)."""
    if not choice.forced:
        return None
    from .schema_grammar import SchemaGrammar

    allowed = [t["function"] for t in choice.callable(tools)]
    if xml:
        return xml_call_grammar(allowed, parallel)
    defs: dict[str, Any] = {}
    bodies = [{"type": "object", "properties": {"name": {"const": fn["name"]},
                                                "arguments": _rooted(fn, f"tool{i}", defs)},
               "required": ["name", "arguments"], "additionalProperties": False} for i, fn in enumerate(allowed)]
    schema = bodies[0] if len(bodies) == 1 else {"anyOf": bodies}
    if defs:
        schema = {**schema, "$defs": defs}
    try:
        conv = SchemaGrammar(prop_order={"name": 0, "arguments": 1})
        conv.visit(conv.resolve_refs(schema, ""), "call-body")
        rules = conv.format_grammar()
    except Exception as exc:
        raise _unconvertible(exc, allowed) from None
    return (strict_strings(rules) + f'\nroot ::= {_calls(parallel)}\n'
            f'call ::= "{CALL_OPEN}\\n" call-body "\\n{CALL_CLOSE}"\n')


def xml_call_grammar(functions: list[dict], parallel: bool) -> str:
    """A forced reply's grammar in the XML form Qwen3.5's template writes calls in:

        <tool_call>
        <function=NAME>
        <parameter=P>
        VALUE
        </parameter>
        </function>
        </tool_call>

    the parameters in their schema's order, the required ones always; a value is text up
    to its closing tag where the parameter may be a string (``parse_call`` reads it so),
    else JSON under its schema. A function whose parameters are not an object of named
    properties (a ``$ref`` or ``anyOf`` at their root), or whose names the form cannot
    hold, is called in the JSON form."""
    from .schema_grammar import SchemaGrammar

    conv = SchemaGrammar()
    defs: dict[str, Any] = {}
    roots = [_rooted(fn, f"tool{i}", defs) for i, fn in enumerate(functions)]
    ours: list[str] = []
    bodies = []
    try:
        conv.resolve_refs({"$defs": defs, "anyOf": roots}, "")
        for i, (fn, root) in enumerate(zip(functions, roots)):
            props = root.get("properties", {}) if root.get("type", "object") == "object" else None
            # parse_call reads a name up to ">" or white space
            plain = isinstance(props, dict) and all(re.fullmatch(r"[^>\s]+", n) for n in [fn["name"], *props])
            if not plain or {"$ref", "anyOf", "oneOf", "allOf"} & root.keys():
                bodies.append(f"xcall{i}-json")
                body = conv.visit({"type": "object", "properties": {"name": {"const": fn["name"]}, "arguments": root},
                                   "required": ["name", "arguments"], "additionalProperties": False}, f"xcall{i}-body")
                ours.append(f'xcall{i}-json ::= {body} "\\n"')
                continue
            bodies.append(f"xcall{i}")
            ours.append(f"xcall{i} ::= {_literal('<function=' + fn['name'] + '>' + chr(10))} xcall{i}-r0")
            required = set(root["required"]) if isinstance(root.get("required"), list) else set()
            names = list(props) or [None]      # no properties: any parameters, as text
            for j, name in enumerate(names):
                here, after = f"xcall{i}-r{j}", f"xcall{i}-r{j + 1}" if j + 1 < len(names) else f"xcall{i}-end"
                if name is None:
                    ours.append(f'{here} ::= "<parameter=" [^>\\n\\t ]+ ">\\n" {here}-t0 | {after}')
                    ours += text_until(f"{here}-t", _PARAM_CLOSE, here)
                    continue
                kinds = value_types(props[name], {"$defs": defs})      # its refs point there
                words = _words(props[name])
                if words:      # an enum of strings: one of them, as text
                    value = f"({' | '.join(map(_literal, words))}) {_literal(_PARAM_CLOSE)} {after}"
                elif kinds is None or "string" in kinds:
                    value = f"{here}-t0"
                    ours += text_until(f"{here}-t", _PARAM_CLOSE, after)
                else:
                    value = f"{conv.visit(props[name], f'xcall{i}-v{j}')} {_literal(_PARAM_CLOSE)} {after}"
                skip = "" if name in required else f" | {after}"
                ours.append(f'{here} ::= {_literal("<parameter=" + name + ">" + chr(10))} {value}{skip}')
            ours.append(f'xcall{i}-end ::= "</function>\\n"')
        rules = conv.format_grammar()
    except Exception as exc:
        raise _unconvertible(exc, functions) from None
    return (strict_strings(rules) + f"\nroot ::= {_calls(parallel)}\n"
            f'call ::= "{CALL_OPEN}\\n" ( {" | ".join(bodies)} ) "{CALL_CLOSE}"\n' + "\n".join(ours) + "\n")


def auto_call_grammar(tools: list[dict], parallel: bool = True, xml: bool = False,
                      choice: ToolChoice = ToolChoice("auto")) -> str:
    """The reply under "auto" with ``strict`` functions, as OpenAI's strict mode holds a
    call to its schema whether or not one was forced: any text up to a call's opening tag
    (it may end there, a reply without calls), then the calls of the forced grammar
    (``tool_call_grammar``), the first one's tag already read."""
    from .constraint import rule_names

    forced = tool_call_grammar(tools, choice.widened(), parallel, xml)
    head = f'call ::= "{CALL_OPEN}\\n" '
    rules = [line for line in forced.splitlines() if not line.startswith("root ::=")]
    first = next(line for line in rules if line.startswith(head))     # the call's rule, after its tag
    prefix = "free"
    while any(name.startswith(prefix) for name in rule_names(forced)):
        prefix += "x"
    rules.append(f'{prefix}-call ::= "\\n" {first[len(head):]}' + (' ("\\n" call)*' if parallel else "") + ' "\\n"?')
    rules += text_until(f"{prefix}-t", CALL_OPEN, f"{prefix}-call", may_end=True)
    return "\n".join(rules) + f"\nroot ::= {prefix}-t0\n"


def _calls(parallel: bool) -> str:
    """The root of a forced reply: one call or, ``parallel``, calls one per line; then the
    line's end a model writes after its last call may come. Without it, a model that
    ended its call's line could only go on with another call: under ``parallel`` (the
    API's default) it called the same function again and again to max_tokens."""
    return ('call ("\\n" call)*' if parallel else "call") + ' "\\n"?'


def _words(schema: Any) -> list[str]:
    """The strings an ``enum`` or ``const`` of strings only allows (none otherwise)."""
    if not isinstance(schema, dict):
        return []
    values = schema["enum"] if isinstance(schema.get("enum"), list) else [schema["const"]] if "const" in schema else []
    return values if values and all(isinstance(v, str) and "\n</parameter>" not in v for v in values) else []


def _unconvertible(exc: Exception, functions: list[dict]) -> ParamError:
    """The converter's error (ValueError, KeyError, TypeError ...) as the refusal of
    ``tools``, naming the first function whose parameters fail on their own: the grammar
    converts every function at once, and a client with many tools needs to know which."""
    from .schema_grammar import refusal_place, schema_gbnf

    whose, at = "a function's parameters are", ""
    for fn in functions:
        defs: dict[str, Any] = {}
        origins: dict[str, str] = {}
        root = _rooted(fn, "tool0", defs, origins)
        try:
            schema_gbnf({**root, "$defs": defs} if defs else root)
        except Exception as own:
            exc = own       # this function's own refusal, which names where in its parameters
            whose = f"function {fn['name']!r} has parameters that are"
            at = refusal_place(own, " of its parameters", origins)
            break
    return ParamError("tools", f"{whose} not a JSON schema the converter understands ({type(exc).__name__}: "
                      f"{exc}){at}")


# what ends a value of the XML form
_PARAM_CLOSE = "\n</parameter>\n"


def _literal(text: str) -> str:
    """``text`` as a GBNF string literal (JSON's escapes, which llama.cpp's grammar reads)."""
    return json.dumps(text, ensure_ascii=False)


def _rooted(fn: dict, key: str, defs: dict[str, Any], origins: dict[str, str] | None = None) -> dict:
    """A function's ``parameters`` as the call's schema holds it, below the arguments of a
    wrapper whose root the converter resolves every ``$ref`` from: its refs point into
    ``defs`` under names that start with ``key`` (schema_refs.flat_refs), apart from
    other functions' of the same name. Parameters without refs come back as they are; a
    ref that cannot be read is refused naming the function and where."""
    from .schema_grammar import is_any

    params = fn["parameters"]
    if is_any(params):          # no keyword says what it allows: the arguments are an object still
        return {"type": "object"}
    for section in ("definitions", "$defs"):
        found = params.get(section, {})
        if not isinstance(found, dict):
            raise ParamError("tools", f"a function's parameters hold {section} that is not an object of "
                             f"schemas (got {type(found).__name__}); send {section} as {{\"Name\": {{...}}}}")
    try:
        return flat_refs(params, key, defs, origins)
    except RefError as exc:
        at = f" (at {exc.schema_at} of them)" if exc.schema_at else ""
        raise ParamError("tools", f"function {fn['name']!r} has parameters that are not a JSON schema pymtp "
                         f"can read{at}: {exc}") from None


def reply_constraint(plan: ToolPlan | None, grammar: str | None, json_schema: Any,
                     param: str = "json_schema", xml: bool = False) -> tuple[str | None, Any]:
    """The (grammar, json_schema) a chat reply follows, its tools considered, as OpenAI's
    API takes tools beside a format: a forced call's grammar (the format is for a later
    turn's text); under "auto", calls or the format (``either_grammar``); without tools
    that may be called, the format as it is. ``xml``: the template writes calls in the XML
    form (``ChatTemplate.xml_calls``). A schema the converter cannot take raises
    ``ParamError`` naming ``param``."""
    if plan is None or not plan.parses:
        return grammar, json_schema
    if plan.grammar is not None:
        return (tool_call_grammar(plan.tools, plan.choice, plan.parallel, xml=True) if xml else plan.grammar), None
    if grammar is None and json_schema is None:
        return (auto_call_grammar(plan.tools, plan.parallel, xml, plan.choice) if plan.strict else None), None
    fmt = grammar if grammar is not None else json_schema_grammar(json_schema, param)
    return either_grammar(tool_call_grammar(plan.tools, plan.choice.widened(), plan.parallel, xml=xml), fmt), None


def _too_deep() -> ParamError:
    return ParamError("tools", "a function's parameters nest too deeply to read (Python's recursion limit); "
                      "flatten them, or name the repeated part once in $defs and $ref it")


def compiled_reply_constraint(model: Any, plan: ToolPlan | None, grammar: str | None, json_schema: Any,
                              param: str = "json_schema", xml: bool = False) -> tuple[str | None, Any]:
    """``reply_constraint``, its grammar compiled on ``model`` (a NativeModel; the run's own
    check then finds it in ``constraint_for``'s cache): one that llama.cpp refuses and the
    tools made raises ``ParamError`` naming ``tools`` (it named ``grammar``, a field the
    client never sent). Beside the calls, the format is compiled alone first, so that a
    refusal of its own names its field."""
    try:
        out = reply_constraint(plan, grammar, json_schema, param, xml)
    except RecursionError:
        raise _too_deep() from None
    if out[0] is None or out[0] == grammar:
        return out
    if plan.grammar is None:       # calls or the format
        constraint_for(model, grammar, json_schema)
    try:
        constraint_for(model, out[0], None)
    except ParamError as exc:
        raise ParamError("tools", f"the functions' parameters make a grammar llama.cpp refuses: {exc}") from None
    return out
