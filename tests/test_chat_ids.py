"""A chat's prompt ids: message content is tokenized twice (with and without special-token
parsing) only when it may spell a special token, and the shortcut never changes the ids."""

from __future__ import annotations

import random
from pathlib import Path

from conftest import _load

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
