"""A chat's prompt ids: message content is tokenized twice (with and without special-token
parsing) only when it may spell a special token, and the shortcut never changes the ids."""

from __future__ import annotations

import random
from pathlib import Path

from conftest import _load, bos_adding_copy

import pymtp
from pymtp.chat import chat_ids, template_for

DEMO = next((Path(__file__).resolve().parent.parent / "pymtp" / "data").glob("*.gguf"))
PARTS = ["<|endoftext|>", "<|endoftext", "endoftext|>", "<|", "|>", "<|im_end|>", "hello ", "é", "\n", "  ",
         "def f():", "<think>", "</s>"]


def test_the_shortcut_says_no_only_where_both_tokenizations_agree():
    model = _load(DEMO)
    rng = random.Random(7)
    texts = ["".join(rng.choice(PARTS) for _ in range(rng.randint(1, 6))) for _ in range(400)]
    said_no = 0
    for text in texts:
        same = model.tokenize(text, special=True, add_special=False) == \
            model.tokenize(text, special=False, add_special=False)
        if not model.may_parse_special(text):
            said_no += 1
            assert same, text
    assert model.may_parse_special("x<|endoftext|>y") and not model.may_parse_special("x<|endoftext y")
    assert 50 < said_no < 400      # both answers were exercised


def test_content_spelling_a_special_token_stays_plain_text():
    model = _load(DEMO)
    template = template_for(model)
    plain = [{"role": "user", "content": "a <|endoftext|> b"}]
    ids = chat_ids(model, template, plain)
    eot = model.tokenize("<|endoftext|>", special=True, add_special=False)
    assert len(eot) == 1 and eot[0] not in ids
    assert model.tokenize("a <|endoftext|> b", special=False, add_special=False)[0] in ids


def test_python_callers_messages_render_as_the_servers():
    """A Python caller's messages as OpenAI's clients write them: an assistant turn of tool
    calls with content None, text part objects. They render as the server reads them (None
    is no text, parts are their texts), not as "None" or a Python repr the model copies."""
    model = _load(DEMO)
    tmpl = template_for(model)
    call = {"id": "1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}
    messages = [{"role": "user", "content": [{"type": "text", "text": "Weather"}, {"type": "text", "text": "in Paris?"}]},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "1", "content": "sunny"}]
    ids = chat_ids(model, tmpl, messages)
    text = model.detokenize(ids)
    assert "None" not in text and "'type'" not in text and "Weather\nin Paris?" in text, text
    as_server = [{**messages[0], "content": ["Weather", "in Paris?"]}, {**messages[1], "content": ""}, messages[2]]
    assert chat_ids(model, tmpl, as_server) == ids


def test_a_templates_bos_is_dropped_where_the_vocabulary_adds_one(tmp_path):
    """Llama 3's and Gemma's templates start with ``{{ bos_token }}``: on a vocabulary that
    adds BOS the prompt began with two, as llama.cpp drops the template's (one more
    prompt token than llama-server, and /apply-template showed the BOS text)."""
    from pymtp.chat import ChatTemplate

    model = _load(bos_adding_copy(DEMO, tmp_path))
    assert model.adds_bos and not model.adds_eos and not _load(DEMO).adds_bos
    bos = model.tokenize("", add_special=True)
    messages = [{"role": "user", "content": "Hi"}]
    template = template_for(model)
    with_bos = ChatTemplate("{{ bos_token }}" + template.text, bos_token=model.bos_token, adds_bos=True)
    ids = chat_ids(model, with_bos, messages)
    assert len(bos) == 1 and ids[0] == bos[0] and ids[1] != bos[0]
    assert ids == chat_ids(model, template, messages)
    assert with_bos.render(messages) == template.render(messages)
    # a vocabulary that adds none keeps the template's
    kept = ChatTemplate("{{ bos_token }}" + template.text, bos_token=model.bos_token)
    assert kept.render(messages) == model.bos_token + template.render(messages)


def test_a_spelled_special_token_is_text_and_the_template_still_trims_its_content():
    """Only the spelling becomes text: the ids are the template's own prompt's (its trim
    applied) with the special token's one id replaced by the ids of its text. Setting the
    whole content apart skipped the template's trim (8 more tokens with Qwen3.5's)."""
    from pymtp.chat import ChatTemplate

    model = _load(DEMO)
    trimming = ChatTemplate("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content|trim }}<|im_end|>\n"
                            "{% endfor %}<|im_start|>assistant\n")
    messages = [{"role": "user", "content": "  \n Hi <|endoftext|> there  \n\n"}]
    as_template = model.tokenize(trimming.render(messages), special=True, add_special=True)
    (eot,) = model.tokenize("<|endoftext|>", special=True, add_special=False)
    at = as_template.index(eot)
    as_text = model.tokenize("<|endoftext|>", special=False, add_special=False)
    assert chat_ids(model, trimming, messages) == as_template[:at] + as_text + as_template[at + 1:]


def test_the_fallback_templates_end_of_turn_is_written_past_under_ignore_eos():
    """The fallback's ``<|im_end|>`` is a stop string (its vocabulary may not end a turn
    with it); ignore_eos writes past it, as llama-server does: it stopped there all the same."""
    with pymtp.load(threads=1, n_ctx=512) as demo:       # no chat template: the fallback
        msgs = [{"role": "user", "content": "Hi"}]
        stopped = demo.chat(msgs, max_tokens=12)
        on = demo.chat(msgs, max_tokens=12, ignore_eos=True)
    assert (stopped.finish_reason, stopped.text) == ("stop", "")          # the demo ends its turn at once
    assert on.finish_reason == "length" and len(on.tokens) == 12 and on.text.startswith("<|im_end|>")
