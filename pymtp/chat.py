"""Chat messages to one prompt, with the GGUF's own Jinja chat template (``Model.chat``
and the server's chat completions both use it).

Templates come from model files, so they are rendered in Jinja's immutable sandbox: a
template can loop and format, but cannot reach Python internals or mutate what it is
given. The variables are the ones the Hugging Face ecosystem passes (``messages``,
``add_generation_prompt``, ``bos_token``, ``eos_token``, ``tools``, plus the helpers
``raise_exception`` and ``strftime_now``), so templates written for ``transformers``
render the same here. A GGUF without a template gets plain ChatML, and says so.
"""

from __future__ import annotations

import functools
import json
import re
import secrets
from datetime import datetime
from typing import Any, Callable

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Our own rendering of ChatML, the format Qwen models are trained on. With ``tools`` the
# system turn lists them and says how to call them, an assistant's calls are rendered as
# <tool_call> blocks and tool results as <tool_response> blocks of a user turn (Qwen's
# Hermes-style format, pymtp/tools.py); without tools it is plain ChatML. No newline
# follows a block tag: the environment trims those (trim_blocks).
FALLBACK_CHATML = (
    "{% set skip_system = tools and messages and messages[0].role == 'system' %}"
    "{% if tools %}"
    "<|im_start|>system\n"
    "{% if skip_system %}{{ messages[0].content }}{{ '\n\n' }}{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}{{ '\n' }}{{ tool | tojson }}{% endfor %}"
    "{{ '\n' }}</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "{% endif %}"
    "{% for message in messages %}"
    "{% if loop.first and skip_system %}"
    "{% elif message.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\n' }}<tool_response>\n{{ message.content }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}"
    "{% for call in message.tool_calls or [] %}"
    "{% if message.content or not loop.first %}{{ '\n' }}{% endif %}"
    '<tool_call>\n{"name": "{{ call.function.name }}", "arguments": '
    "{% if call.function.arguments is string %}{{ call.function.arguments }}"
    "{% else %}{{ call.function.arguments | tojson }}{% endif %}}\n</tool_call>"
    "{% endfor %}"
    "<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHATML_END = "<|im_end|>"

SOURCE_GGUF = "gguf"
SOURCE_FALLBACK = "fallback-chatml"

# Variables the server sets; chat_template_kwargs from a request may not replace these.
_RESERVED = frozenset({"messages", "bos_token", "eos_token", "raise_exception", "strftime_now"})


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, indent: int | None = None) -> str:
    # Jinja's built-in tojson escapes HTML characters; chat templates want plain JSON.
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


class ChatTemplate:
    """A compiled chat template; ``render`` raises ValueError when it cannot render a request."""

    def __init__(self, text: str | None, *, bos_token: str = "", eos_token: str = "", adds_bos: bool = False,
                 adds_eos: bool = False) -> None:
        self.source = SOURCE_GGUF if text else SOURCE_FALLBACK
        self.text = text or FALLBACK_CHATML      # what renders: the GGUF's, or the fallback
        # a reasoning model's template: it writes or opens <think> blocks (llama-server
        # splits a reply's thinking off only for such templates)
        self.thinks = "<think>" in self.text or "</think>" in self.text
        # a template that writes tool calls in the XML form (Qwen3.5's): a forced call's
        # grammar writes them so too (tools.xml_call_grammar)
        self.xml_calls = "<function=" in self.text and "<parameter=" in self.text
        self.bos_token = bos_token
        self.eos_token = eos_token
        # the vocabulary adds BOS/EOS to the prompt it tokenizes: the template's own (Llama 3's,
        # Gemma's "{{ bos_token }}") is dropped from the text's start/end, as llama.cpp
        # drops it; the prompt began with two BOS tokens
        self.adds_bos, self.adds_eos = adds_bos, adds_eos
        try:
            self._template = _environment().from_string(self.text)
        except jinja2.TemplateSyntaxError as exc:
            raise ValueError(f"the model's chat template does not compile: {exc}") from exc

    @functools.cached_property
    def parts_separator(self) -> str | None:
        """What this template puts between a message's text parts, where it reads them
        itself (Qwen3.5's joins them with nothing); None where it takes text only."""
        a, b = "\ue000a", "\ue000b"
        try:
            text = self.render([{"role": "user", "content": [{"type": "text", "text": a}, {"type": "text", "text": b}]}],
                               add_generation_prompt=False)
        except ValueError:
            return None
        i, j = text.find(a), text.find(b)
        if i < 0 or j < i or "'type'" in text or '"type"' in text:
            return None
        return text[i + len(a):j]

    def text_of(self, content: str | list[str] | None) -> str:
        """A message's text from its text parts, as llama-server hands them to a template:
        joined as the template would join them, else with a newline between non-empty
        text (llama.cpp's common/chat.cpp)."""
        content = _text_content(content)
        if not _text_parts(content):
            return content or ""
        if self.parts_separator is not None:
            return self.parts_separator.join(content)
        text = ""
        for part in content:
            text += ("\n" if text else "") + part
        return text

    @property
    def is_fallback(self) -> bool:
        return self.source == SOURCE_FALLBACK

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """Text that ends a turn when the model's vocabulary may not know ChatML's markers.

        With the GGUF's template the end-of-turn token is an end-of-generation token, so
        the engine stops on it; the fallback cannot count on that.
        """
        return (CHATML_END,) if self.is_fallback else ()

    def turn_ends(self, *, constrained: bool, ignore_eos: bool) -> tuple[str, ...]:
        """The stop strings a chat reply gets from the template (``stop_strings``): none
        where a grammar of pymtp's ends the reply itself (``constrained``: the text may be
        inside its JSON), nor under ``ignore_eos``, which writes past the end of turn, as
        llama-server does."""
        return () if constrained or ignore_eos else self.stop_strings

    def render(self, messages: list[dict], *, add_generation_prompt: bool = True,
               extra: dict[str, Any] | None = None) -> str:
        variables: dict[str, Any] = {"tools": None, "add_generation_prompt": add_generation_prompt}
        variables.update({k: v for k, v in (extra or {}).items() if k not in _RESERVED})
        variables.update(messages=messages, bos_token=self.bos_token, eos_token=self.eos_token)
        try:
            text = self._template.render(**variables)
        except Exception as exc:
            # raise_exception(), a sandbox refusal, or a template that trips over these
            # messages (None + str, a missing key): all caused by the request, none a crash.
            raise ValueError(f"the chat template could not render these messages: "
                             f"{type(exc).__name__}: {exc}") from exc
        if self.adds_bos and self.bos_token and text.startswith(self.bos_token):
            text = text[len(self.bos_token):]
        if self.adds_eos and self.eos_token and text.endswith(self.eos_token):
            text = text[:len(text) - len(self.eos_token)]
        return text

    def render_pieces(self, messages: list[dict], split_special: Callable[[str], list[str]], *,
                      extra: dict[str, Any] | None = None, add_generation_prompt: bool = True,
                      continue_final: bool = False) -> list[tuple[str, bool]]:
        """Render as (text, plain) pieces, ``plain`` for the spellings of special tokens in
        message content, which ``split_special`` finds (plain, spelling, plain, ...).

        The prompt is tokenized with special-token parsing, which the template's markers
        need; content that spells a special token (``<|im_end|>``) would become one and
        could forge a turn. Each such spelling goes through the template as a marker, the
        rest of the content as itself (so the template's trims and splits still act on it),
        and comes back as its own piece, to be tokenized as text.

        ``continue_final``: the prompt ends with the last message's content, as the
        template renders that message (its turn left open, for the model to go on with):
        the rendering of all the messages, cut after that content, as vLLM cuts it.
        """
        messages = [{**m, "content": self.text_of(m.get("content"))} for m in messages]
        if continue_final and not messages[-1].get("content"):     # nothing to go on with: a new turn
            messages, continue_final, add_generation_prompt = messages[:-1], False, True
        nonce = secrets.randbelow(10**12)       # digits: a template's |upper leaves a marker whole
        spelled: list[str] = []

        def mark(text: str) -> str:
            spelled.append(text)
            return f"\ue000{nonce}:{len(spelled) - 1}\ue001"

        def marked(content: str) -> str:
            return "".join(mark(p) if i % 2 else p for i, p in enumerate(split_special(content)))

        final = None
        subst = []
        for i, m in enumerate(messages):
            if isinstance(m.get("content"), str) and m["content"]:
                if continue_final and i == len(messages) - 1:
                    final = mark(m["content"])      # found again below, to cut the turn after it
                    m = {**m, "content": final}
                else:
                    m = {**m, "content": marked(m["content"])}
            subst.append(m)
        text = self.render(subst, extra=extra, add_generation_prompt=add_generation_prompt and not continue_final)
        if continue_final:
            if final is None or final not in text:
                raise ValueError("the chat template does not render the final message's content, so the "
                                 "reply cannot continue it; end the messages with a user message")
            # tokenized with the template's text before it, as llama-server does
            text = text[:text.rindex(final)] + marked(messages[-1]["content"])
        if not spelled:
            return [(text, False)]
        parts = re.split(f"\ue000{nonce}:(\\d+)\ue001", text)
        # re.split with a group alternates: template text, marker index, template text, ...
        return [(spelled[int(p)], True) if i % 2 else (p, False) for i, p in enumerate(parts) if p]


def template_for(model) -> ChatTemplate:
    """The model's own template (or the ChatML fallback) with its BOS/EOS text filled in."""
    return ChatTemplate(model.chat_template, bos_token=model.bos_token, eos_token=model.eos_token,
                        adds_bos=model.adds_bos, adds_eos=model.adds_eos)


def chat_ids(model, template: ChatTemplate, messages: list[dict], *,
             extra: dict[str, Any] | None = None) -> list[int]:
    """``chat_prompt``'s token ids alone."""
    return chat_prompt(model, template, messages, extra=extra)[0]


def chat_prompt(model, template: ChatTemplate, messages: list[dict], *,
                extra: dict[str, Any] | None = None, add_generation_prompt: bool = True,
                continue_final: bool = False, fit_context: bool = True) -> tuple[list[int], str]:
    """The prompt of a chat as token ids: the template's own text with special tokens
    parsed, message content that spells a special token as plain text (render_pieces);
    and the prompt's last piece of template text (the whole prompt where no message
    content was set apart), which ends in the generation prompt and so may open the
    reply's thinking (reasoning.opened_by reads only its end). A content piece that
    cannot fit the context raises ``ParamError`` (not with ``fit_context`` off: a count of
    the tokens, whatever their number); one the template cannot render, ``ValueError``."""
    def split_special(text: str) -> list[str]:
        if not (model.may_parse_special(text) and
                model.tokenize(text, special=True, add_special=False, fit_context=fit_context) !=
                model.tokenize(text, special=False, add_special=False, fit_context=fit_context)):
            return [text]
        parts = model.split_special(text)
        return parts if len(parts) > 1 else ["", text, ""]      # (a spelling no str holds whole) all as text

    pieces = template.render_pieces(messages, split_special, extra=extra, add_generation_prompt=add_generation_prompt,
                                    continue_final=continue_final)
    ids = [t for i, (piece, plain) in enumerate(pieces)
           for t in model.tokenize(piece, special=not plain, add_special=i == 0, fit_context=fit_context)]
    if not pieces[-1][1]:
        return ids, pieces[-1][0]
    # a content piece last: a continued message spelling a special token, after the template's text
    return ids, (pieces[-2][0] if len(pieces) > 1 and not pieces[-2][1] else "") + pieces[-1][0]


def continuation(messages: list[dict], add_generation_prompt: bool | None = None,
                 continue_final_message: bool | str | None = None, constrained: bool = False) -> tuple[bool, bool]:
    """(add_generation_prompt, continue_final) of a chat, as llama-server reads its fields:
    a chat that ends with an assistant message continues it (its prefill) unless
    ``continue_final_message`` is False; True (or "content") asks for it and needs
    ``add_generation_prompt`` False, as llama-server and vLLM require. A ``constrained``
    reply (a grammar, a schema, a forced call) would have its constraint start over after
    the continued text: such a chat gets a new turn, and asking to continue is refused.
    Refusals are ``ParamError`` naming the field."""
    from .config import ParamError

    field = "continue_final_message"
    cont = continue_final_message
    if not (cont is None or type(cont) is bool or cont == "content"):
        raise ParamError(field, 'continue_final_message must be a boolean or "content" (continuing the thinking, '
                         f'"reasoning_content", is not served), got {cont!r}')
    if not (add_generation_prompt is None or type(add_generation_prompt) is bool):     # "no" is true to Python
        raise ParamError("add_generation_prompt", "add_generation_prompt must be true or false (None: as the "
                         f"last message asks), got {add_generation_prompt!r}")
    add, last = add_generation_prompt, messages[-1]
    if cont is None:
        if last["role"] != "assistant" or constrained:
            return (True if add is None else add), False
        if len(messages) > 1 and messages[-2]["role"] == "assistant":
            raise ParamError("messages", "Cannot have 2 or more assistant messages at the end of the list: the "
                             "last is continued")
        if last.get("tool_calls"):      # not a continuation the client asked for
            raise ParamError("messages", f"messages[{len(messages) - 1}] (assistant) makes tool calls and nothing "
                             'answers them: send each call\'s result after it, as a "tool" message with its '
                             "tool_call_id")
        cont, add = True, False
    if not cont:
        return (True if add is None else add), False
    if add in (None, True):
        raise ParamError(field, "Cannot set both add_generation_prompt and continue_final_message to true: send "
                         '"add_generation_prompt": false to continue the last message')
    if last["role"] != "assistant":
        raise ParamError(field, f"continue_final_message continues an assistant message; the last message is "
                         f"{last['role']!r}")
    if last.get("tool_calls"):
        raise ParamError(field, "Cannot continue an assistant message that contains tool calls")
    if not last.get("content") and last.get("reasoning_content"):
        raise ParamError(field, "continuing a message's thinking (an assistant message with reasoning_content and "
                         "no content) is not served; send the thinking as content, or end with a user message")
    if constrained:
        raise ParamError(field, "continue_final_message cannot be combined with grammar, response_format or a "
                         "forced tool_choice: the constraint would start over after the continued text")
    return False, True


def _text_content(content: Any) -> Any:
    """A message's content as chat_messages reads it, wherever it comes from: None (an
    assistant turn of tool calls) is no text, OpenAI's text part objects are their texts;
    other content goes to the template as it is."""
    if content is None:
        return ""
    if isinstance(content, list) and content and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
        return [p["text"] for p in content]
    return content


def _text_parts(content: Any) -> bool:
    """Whether a message's content is text parts as the server reads them (a list of str);
    other lists (OpenAI's part objects, from Python callers) go to the template as they are."""
    return isinstance(content, list) and all(isinstance(p, str) for p in content)
