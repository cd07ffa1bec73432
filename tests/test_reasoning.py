"""The thinking block split off a reply (pymtp/reasoning.py), whole and streamed."""

from __future__ import annotations

import random

import pytest

from pymtp.reasoning import ReasoningStream, opened_by, opener, split_reasoning


@pytest.mark.parametrize("text, opened, want", [
    # the thinking keeps the white space before its end tag, as llama-server's parser
    ("<think>\nLet me see.\n</think>\n\nParis.", False, ("Let me see.\n", "Paris.")),
    ("  <think>a\n\nb  </think>  c ", False, ("a\n\nb  ", "c ")),
    ("Let me see.\n</think>\n\nParis.", True, ("Let me see.\n", "Paris.")),
    ("\n</think>\n\nParis.", True, ("", "Paris.")),                  # an empty block
    ("Paris. <think>no</think>", False, (None, "Paris. <think>no</think>")),   # not at the start
    ("<thinking>x", False, (None, "<thinking>x")),
    ("<thi", False, (None, "<thi")),                                  # cut where a tag might start
    ("<think>cut off by max_tok", False, ("cut off by max_tok", "")),
    # an end tag cut short (max_tokens) is neither, as llama-server reads a reply cut by its
    # limit (as partial: a tag's start is held back); it was the thinking's "</thi"
    ("half a thought </thi", True, ("half a thought ", "")),
    ("<think><<</t", False, ("<<", "")),
    ("<think>a</think>", False, ("a", "")),
    ("", True, ("", "")),
    ("", False, (None, "")),
    (" \n", False, (None, " \n")),
    ("<think>a</think>b</think>c", False, ("a", "b</think>c")),        # one block only
])
def test_split_reasoning(text, opened, want):
    assert split_reasoning(text, opened) == want


def _streamed(text: str, opened: bool, cuts: list[int]) -> tuple[str, str]:
    stream, thinking, content = ReasoningStream(opened), [], []
    for a, b in zip([0] + cuts, cuts + [len(text)]):
        t, c = stream.feed(text[a:b])
        thinking.append(t)
        content.append(c)
    t, c = stream.finish()
    return "".join(thinking) + t, "".join(content) + c


@pytest.mark.parametrize("text, opened", [
    ("<think>\nStep 1: add.\n\nStep 2:  carry. \n</think>\n\n The sum is 5.\n", False),
    ("We want x.\n  Then y.\n</think>\n\n<tool_call>\n{}\n</tool_call>", True),
    ("\n\n<think></think>answer", False),
    ("no thinking at all, <think> later", False),
    ("<think>unfinished  \n", False),
    ("cut in its end tag </th", True),
])
def test_a_stream_cut_anywhere_joins_to_the_whole_split(text, opened):
    # whatever the chunks, the pieces handed out join to the whole reply's split, so a
    # streamed reply and a non-streamed one say the same
    thinking, content = split_reasoning(text, opened)
    rng = random.Random(7)
    for _ in range(300):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, min(8, len(text) - 1))))
        assert _streamed(text, opened, cuts) == (thinking or "", content)
    assert _streamed(text, opened, list(range(1, len(text)))) == (thinking or "", content)   # a char a chunk


def test_a_stream_holds_back_only_what_may_be_a_tag_or_leading_space():
    s = ReasoningStream(opened=True)
    assert s.feed("\n ") == ("", "")                   # the thinking's leading space is dropped
    assert s.feed("First, ") == ("First, ", "")
    assert s.feed("the sum.\n</th") == ("the sum.\n", "")
    assert s.feed("ink>\n\nIt") == ("", "It")
    assert s.feed(" is 5") == ("", " is 5")
    s = ReasoningStream()
    assert s.feed("<thi") == ("", "")
    assert s.feed("s is content") == ("", "<this is content")


@pytest.mark.parametrize("tail, opened", [
    ("<|im_start|>assistant\n<think>\n", True),
    ("<|im_start|>assistant\n<think>", True),
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", False),      # enable_thinking false
    ("<|im_start|>assistant\n", False),
])
def test_opened_by_reads_the_generation_prompt(tail, opened):
    assert opened_by(tail) is opened


def test_model_chat_hands_the_thinking_back_apart(dense_model, monkeypatch):
    from pymtp.chat import ChatTemplate
    from pymtp.config import ParamError

    fixture_template = dense_model.chat_template_for_prompts()
    assert not fixture_template.thinks        # ChatML: a reply there is never split
    thinking = ChatTemplate(fixture_template.text.replace("message['content']", "message['content'].split('</think>')[-1]"),
                            bos_token=fixture_template.bos_token, eos_token=fixture_template.eos_token)
    assert thinking.thinks
    monkeypatch.setattr(dense_model, "_template", thinking)
    msgs = [{"role": "user", "content": "What is the sum?"}]
    kw = dict(max_tokens=40, temperature=0, grammar='root ::= "<think>" [a-z ]{2,14} "</think>\\n\\n" [a-z ]{1,12}')
    raw = dense_model.chat(msgs, reasoning_format="none", **kw)
    assert raw.reasoning is None and raw.text.startswith("<think>")
    split = dense_model.chat(msgs, **kw)
    assert split.tokens == raw.tokens
    assert (split.reasoning, split.text) == split_reasoning(raw.text) and split.reasoning and split.text
    plain = dense_model.chat(msgs, max_tokens=8, temperature=0, grammar='root ::= [a-z ]{2,14}')
    assert plain.reasoning is None and plain.text == dense_model.chat(msgs, max_tokens=8, temperature=0,
                                                                       grammar='root ::= [a-z ]{2,14}',
                                                                       reasoning_format="none").text
    with pytest.raises(ParamError, match="reasoning_format must be one of 'auto', 'deepseek', 'deepseek-legacy', 'none', got 'x'"):
        dense_model.chat(msgs, reasoning_format="x")


def _walk(model, gbnf: str, text: str) -> tuple[bool, bool]:
    """Whether ``gbnf`` allows ``text``'s tokens one by one, and then the end of the reply."""
    import numpy as np

    from pymtp.constraint import Constraint

    c = Constraint(model._native, gbnf)
    mask = c.start()
    try:
        for t in model.tokenize(text, special=False, add_special=False):
            if not mask.allows(np.array([t], dtype=np.int32))[0]:
                return False, False
            mask = mask.then(t)
        eog = next(t for t in range(model.n_vocab) if model._native.is_eog(t))
        return True, bool(mask.allows(np.array([eog], dtype=np.int32))[0])
    finally:
        c.close()


def test_think_first_lets_a_formatted_reply_think_and_close_first(dense_model):
    from pymtp.reasoning import think_first
    from pymtp.tools import ToolChoice, tool_call_grammar

    tools = [{"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"root": {"type": "integer"}}, "required": ["root"]}}}]
    calls = tool_call_grammar(tools, ToolChoice("required"), parallel=False)
    call = '<tool_call>\n{"name": "add", "arguments": {"root": 5}}\n</tool_call>'
    assert _walk(dense_model, calls, call) == (True, True)
    wrapped = think_first(calls)
    # the block's rest, any text but its end tag, then the call
    assert _walk(dense_model, wrapped, "Add them: < / <b> </thin </think >.\n</think>\n\n" + call) == (True, True)
    assert _walk(dense_model, wrapped, "</think>" + call) == (True, True)       # an empty rest
    # the block must close: a call without it is thinking text, and the reply cannot end there
    assert _walk(dense_model, wrapped, call) == (True, False)
    assert _walk(dense_model, wrapped, "a</think>b") == (False, False)     # after the block, only the call
    # the block ends at its first end tag whatever came before it, as split_reasoning reads it
    for rest in ("a <", "</t", "</think", "<<", "x</thin<", "a < b and c </div> <"):
        assert split_reasoning(rest + "</think>" + call, opened=True) == (rest.strip(), call)
        assert _walk(dense_model, wrapped, rest + "</think>" + call) == (True, True), rest
    # a reply that need not open the block (the template thinks, the prompt opened none)
    optional = think_first(calls, opened=False)
    assert _walk(dense_model, optional, call) == (True, True)
    assert _walk(dense_model, optional, "\n<think>plan</think>\n" + call) == (True, True)
    assert _walk(dense_model, optional, "plan</think>" + call) == (False, False)


def test_think_first_names_its_rules_apart_from_the_grammars(dense_model):
    # a JSON schema's property names become rule names; the new rules must not take theirs
    from pymtp.constraint import json_schema_grammar
    from pymtp.reasoning import think_first

    schema = {"type": "object", "properties": {"pymtp-reply-body": {"type": "object", "properties": {
        "x": {"type": "integer"}}}, "pymtp-reply-t0": {"type": "boolean"}},
        "required": ["pymtp-reply-body", "pymtp-reply-t0"]}
    gbnf = json_schema_grammar(schema)
    assert "\npymtp-reply-body ::=" in gbnf and "pymtp-reply-t0-kv ::=" in gbnf
    doc = '{"pymtp-reply-body": {"x": 1}, "pymtp-reply-t0": true}'
    assert _walk(dense_model, gbnf, doc) == (True, True)
    assert _walk(dense_model, think_first(gbnf), "ok</think>" + doc) == (True, True)
    assert _walk(dense_model, think_first(gbnf), 'ok</think>{"pymtp-reply-body": {"x": true') == (False, False)


def test_model_chat_refuses_a_grammar_and_a_schema_under_a_thinking_prompt_too(dense_model, monkeypatch):
    from pymtp.chat import ChatTemplate
    from pymtp.config import ParamError

    base = dense_model.chat_template_for_prompts()
    monkeypatch.setattr(dense_model, "_template", ChatTemplate(
        base.text.replace("'<|im_start|>assistant\\n'", "'<|im_start|>assistant\\n<think>\\n'"),
        bos_token=base.bos_token, eos_token=base.eos_token))
    with pytest.raises(ParamError):
        dense_model.chat([{"role": "user", "content": "x"}], grammar='root ::= "a"', json_schema={"type": "object"},
                         max_tokens=2)


def test_model_chat_lets_a_forced_call_think_first_under_an_opening_prompt(dense_model, monkeypatch):
    # the library's chat builds the same grammar as the server (tests/server/test_reasoning_http.py)
    from pymtp.chat import ChatTemplate

    base = dense_model.chat_template_for_prompts()
    opening = ChatTemplate(base.text.replace("'<|im_start|>assistant\\n'", "'<|im_start|>assistant\\n<think>\\n'"),
                           bos_token=base.bos_token, eos_token=base.eos_token)
    assert opening.thinks
    msgs = [{"role": "user", "content": "Add 2 and 3."}]
    tools = [{"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}]
    kw = dict(tools=tools, tool_choice="required", max_tokens=40, temperature=0)
    at_once = dense_model.chat(msgs, **kw)
    # a call, or one cut by max_tokens (left out of the reply: its tokens say what it wrote)
    assert at_once.tool_calls or dense_model.detokenize(at_once.tokens).startswith("<tool_call>")
    monkeypatch.setattr(dense_model, "_template", opening)
    r = dense_model.chat(msgs, **kw)
    assert r.finish_reason == "length" and r.text == "" and r.tool_calls is None
    assert r.reasoning and not r.reasoning.startswith("<tool_call>")
    unsplit = dense_model.chat(msgs, reasoning_format="none", **kw)
    assert dense_model.detokenize(unsplit.tokens).startswith("<tool_call>")


@pytest.mark.parametrize("tail, prefill, opened", [
    ("<|im_start|>assistant\n<think>\nSure, here", "Sure, here", True),       # the template left the block open
    ("<|im_start|>assistant\n<think>\nplan</think>\n\nSure", "plan</think>\n\nSure", False),
    ("<|im_start|>assistant\n<think>\n", "", True),
    ("<|im_start|>assistant\n", "", False),       # the model may open a block itself
    # the template closed the block (Qwen3.5's enable_thinking: false): all content, as
    # llama-server reads it, a prefill or not
    ("<|im_start|>assistant\n<think>\n\n</think>\n\nSure", "Sure", None),
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", "", None),
])
def test_a_continued_reply_starts_where_the_template_left_the_block(tail, prefill, opened):
    from pymtp.reasoning import reply_split

    assert reply_split("auto", True, tail, prefill) is opened


def test_model_chat_continues_a_trailing_assistant_message_as_the_server_does(dense_model):
    from pymtp.config import ParamError

    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Sure, here"}]
    ids = dense_model.tokenize("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nSure, here", special=True)
    want = dense_model.generate(ids, max_tokens=6, ignore_eos=True, spec="none").text
    r = dense_model.chat(msgs, max_tokens=6, ignore_eos=True, spec="none")
    assert r.text == "Sure, here" + want and r.stats.prompt_tokens == len(ids)
    turn = dense_model.chat(msgs, continue_final_message=False, max_tokens=6, ignore_eos=True, spec="none")
    assert turn.stats.prompt_tokens > len(ids) and not turn.text.startswith("Sure, here")
    # asked to continue, with add_generation_prompt left as the last message asks (the
    # server's field defaults to true, and there both are refused, as llama-server's)
    continued = dense_model.chat(msgs, continue_final_message=True, max_tokens=6, ignore_eos=True, spec="none")
    assert continued.text == r.text
    with pytest.raises(ParamError, match="Cannot set both"):
        dense_model.chat(msgs, continue_final_message=True, add_generation_prompt=True, max_tokens=2)
    with pytest.raises(ParamError, match="cannot be combined with grammar"):
        dense_model.chat(msgs, continue_final_message=True, add_generation_prompt=False, grammar='root ::= "a"')
    for add in ("no", "false", 0):      # a string is true to Python: the prompt was added
        with pytest.raises(ParamError, match="add_generation_prompt must be true or false") as e:
            dense_model.chat(msgs[:1], add_generation_prompt=add, max_tokens=2)
        assert e.value.param == "add_generation_prompt"


@pytest.mark.parametrize("pieces, opened, n", [
    (["a", "b", "</th", "ink>", "x"], True, 4),          # the tag split across tokens
    (["<think>", "hm", "</think>", "x"], False, 3),
    ([" <th", "ink>", "a"], False, 3),                   # never closed: all of them
    (["a", "</think", "x"], True, 3),
    (["hi", "<think>", "a", "</think>"], False, 0),       # a block not at the start is content
    (["a", "</think>"], False, 0),
    (["é", "</think>"], True, 2),
    ([], True, 0),
])
def test_thinking_tokens_count_up_to_the_end_tag(pieces, opened, n):
    from pymtp.reasoning import thinking_tokens

    assert thinking_tokens([p.encode() for p in pieces], opened) == n


def test_a_block_the_template_closed_leaves_a_formatted_reply_no_block_to_open(dense_model, monkeypatch):
    """Qwen3.5's enable_thinking: false writes an empty block; a JSON reply could open a new
    one and think to max_tokens (openai-python's parse() raised LengthFinishReasonError).
    "<" pushed up makes the model take every opening the grammar leaves it."""
    from pymtp.chat import ChatTemplate

    base = dense_model.chat_template_for_prompts()
    closing = ChatTemplate(base.text.replace("'<|im_start|>assistant\\n'",
                                             "'<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n'"),
                           bos_token=base.bos_token, eos_token=base.eos_token)
    assert closing.thinks
    monkeypatch.setattr(dense_model, "_template", closing)
    (lt,) = dense_model.tokenize("<", add_special=False)
    r = dense_model.chat([{"role": "user", "content": "JSON please"}], json_schema={"type": "object"},
                         max_tokens=12, temperature=0, logit_bias={lt: 30})
    assert r.reasoning is None and r.text.startswith('{"<'), (r.text, r.reasoning)


def test_the_opener_is_the_generation_prompts_tags_under_none_alone():
    """reasoning_format "none" keeps the generation prompt's think tags at the content's
    start, as llama-server's parser does (from the reasoning start tag on)."""
    gen = "<|im_end|>\n<|im_start|>assistant\n"
    assert opener("none", True, gen + "<think>\n") == "<think>\n"
    assert opener("none", True, gen + "<think>\n\n</think>\n\n") == "<think>\n\n</think>\n\n"
    assert opener("none", True, gen + "<think>\n\n</think>\n\nab", "ab") == "<think>\n\n</think>\n\n"
    assert opener("none", True, gen + "ab", "ab") == ""
    assert opener("none", True, gen) == ""
    assert opener("none", False, gen + "<think>\n") == ""          # a template that does not think
    for fmt in ("auto", "deepseek", "deepseek-legacy"):
        assert opener(fmt, True, gen + "<think>\n") == ""
    # a tag with text after it in the prompt's tail is a message's, not the generation prompt's
    assert opener("none", True, "<think>\nsome thought</think>\n" + gen) == ""
