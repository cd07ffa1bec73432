"""Chat templates render in a sandbox with the variables the ecosystem passes."""

from __future__ import annotations

import re

import pytest

from pymtp.chat import ChatTemplate

MSGS = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]

# A Qwen-style template: namespace, reversed loop, raise_exception, tojson, tools, bos/eos.
QWEN_LIKE = """{%- if tools %}{{ tools | tojson }}{% endif -%}
{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor -%}
{%- for m in messages -%}
{%- if m.role == 'system' and not loop.first %}{{ raise_exception('System message must be first') }}{% endif -%}
<|im_start|>{{ m.role }}
{{ m.content }}{% if loop.index0 == ns.last_user %} [last]{% endif %}<|im_end|>
{% endfor -%}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% endif %}{% endif %}{{ eos_token if not add_generation_prompt else '' }}"""


def test_qwen_like_template():
    t = ChatTemplate(QWEN_LIKE, bos_token="<s>", eos_token="<|endoftext|>")
    assert t.source == "gguf" and t.stop_strings == ()
    out = t.render(MSGS)
    assert out == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU [last]<|im_end|>\n<|im_start|>assistant\n"
    no_think = t.render(MSGS, extra={"enable_thinking": False})
    assert no_think.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    closed = t.render(MSGS, add_generation_prompt=False)
    assert closed.endswith("<|im_end|>\n<|endoftext|>")


def test_template_refusal_is_a_value_error():
    t = ChatTemplate(QWEN_LIKE)
    with pytest.raises(ValueError, match="System message must be first"):
        t.render([{"role": "user", "content": "U"}, {"role": "system", "content": "S"}])


def test_request_kwargs_cannot_replace_messages():
    t = ChatTemplate("{{ messages | length }} {{ bos_token }}", bos_token="B")
    assert t.render(MSGS, extra={"messages": [], "bos_token": "X"}) == "2 B"


def test_tojson_is_plain_json():
    t = ChatTemplate("{{ messages[0] | tojson }}")
    assert t.render([{"role": "user", "content": "<a & 'b'> é"}]) == \
        '{"role": "user", "content": "<a & \'b\'> é"}'


def test_sandbox_blocks_python_internals():
    t = ChatTemplate("{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ValueError, match="could not render"):
        t.render(MSGS)
    t = ChatTemplate("{% set _ = messages.append(1) %}{{ messages | length }}")
    with pytest.raises(ValueError):
        t.render(MSGS)


def test_fallback_is_chatml_and_stops_on_im_end():
    t = ChatTemplate(None)
    assert t.is_fallback and t.stop_strings == ("<|im_end|>",)
    assert t.render(MSGS) == ("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"
                              "<|im_start|>assistant\n")


def test_broken_template_fails_at_load():
    with pytest.raises(ValueError, match="does not compile"):
        ChatTemplate("{% for %}")


def test_render_pieces_keeps_marked_content_apart():
    t = ChatTemplate(QWEN_LIKE)
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "a<|im_end|>b"}]
    pieces = t.render_pieces(msgs, lambda text: re.split("(<[|][a-z_]+[|]>)", text))
    assert pieces == [("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\na", False), ("<|im_end|>", True),
                      ("b [last]<|im_end|>\n<|im_start|>assistant\n", False)]
    assert "".join(p for p, _ in pieces) == t.render(msgs)
    assert t.render_pieces(msgs, lambda text: [text]) == [(t.render(msgs), False)]


def test_a_spelled_special_token_leaves_the_rest_of_its_content_to_the_template():
    """The template's trims and splits act on content that spells a special token as on
    any other: only the spelling is set apart (before, the whole content was, so the
    template trimmed and split a marker, and the prompt held what it drops)."""
    t = ChatTemplate("{% for m in messages %}<{{ m.role }}>{{ (m.content.split('</think>')|last)|trim }}"
                     "</{{ m.role }}>{% endfor %}")
    msgs = [{"role": "user", "content": "  Hi <|endoftext|> there  \n"},
            {"role": "assistant", "content": "old <|x|> reasoning</think>\n\n<|endoftext|>Answer"}]
    split = lambda text: re.split("(<[|][a-z]+[|]>)", text)     # noqa: E731
    assert t.render_pieces(msgs, split) == [
        ("<user>Hi ", False), ("<|endoftext|>", True), (" there</user><assistant>", False),
        ("<|endoftext|>", True), ("Answer</assistant>", False)]
