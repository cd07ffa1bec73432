"""A tiny byte-level BPE vocabulary for the synthetic fixtures.

It is written as llama.cpp's `gpt2` tokenizer with the `qwen2` pre-tokenizer, the
same pair a converted Qwen3.5 GGUF declares, so tokenization runs through the same
code path as a real model. Every byte has its own token, so any text round-trips
whatever the merges are; the merges only make common English and Python shorter.
"""

from __future__ import annotations

import collections
import re
from dataclasses import dataclass

# GGUF token types (llama.cpp `llama_token_type`).
TOKEN_NORMAL = 1
TOKEN_CONTROL = 3
TOKEN_UNUSED = 5

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)

# ChatML, as Qwen models use it (without the tool and thinking branches).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Text the merges are learned from: a little English and a little Python.
_CORPUS = """\
The quick brown fox jumps over the lazy dog. The dog was not amused, and the fox
ran into the forest. There is nothing in the world that the fox likes more than
a good run in the morning. When the sun is up, the birds sing and the river runs
on. This is the story of the fox and the dog, and of the things that they do.
It was the best of times, it was the worst of times; it was the age of reason,
and there was a lot to learn for all of them, in the heat of the long summer.

def fibonacci(n):
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)

class Counter:
    def __init__(self, start=0):
        self.value = start

    def increment(self, step=1):
        self.value = self.value + step
        return self.value

for index in range(10):
    print(index, fibonacci(index))
"""

# ASCII approximation of the qwen2 pre-tokenizer regex (llama-vocab.cpp), used only
# to learn merges; llama.cpp applies its own regex when it tokenizes.
_PRETOKEN_RE = re.compile(
    r"'[sStTmMdD]|'[rR][eE]|'[vV][eE]|'[lL][lL]"
    r"|[^\r\nA-Za-z0-9]?[A-Za-z]+|[0-9]| ?[^\sA-Za-z0-9]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map.

    Printable Latin-1 bytes map to themselves; the rest (space, control bytes, ...)
    are shifted to code points from 256 up, so no token text holds whitespace.
    """
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in keep}
    shifted = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


def learn_merges(text: str, n_merges: int) -> list[tuple[str, str]]:
    """Greedy BPE training; ties go to the lexicographically smallest pair."""
    b2u = byte_to_unicode()
    words = collections.Counter(
        tuple(b2u[b] for b in piece.encode("utf-8")) for piece in _PRETOKEN_RE.findall(text)
    )
    merges: list[tuple[str, str]] = []
    while len(merges) < n_merges:
        pairs: collections.Counter[tuple[str, str]] = collections.Counter()
        for word, count in words.items():
            for pair in zip(word, word[1:]):
                pairs[pair] += count
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        if pairs[best] < 2:
            break
        merges.append(best)
        words = collections.Counter({_merge_word(w, best): c for w, c in words.items()})
    return merges


def _merge_word(word: tuple[str, ...], pair: tuple[str, str]) -> tuple[str, ...]:
    out: list[str] = []
    i = 0
    while i < len(word):
        if i + 1 < len(word) and (word[i], word[i + 1]) == pair:
            out.append(word[i] + word[i + 1])
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)


@dataclass(frozen=True)
class Vocab:
    """Token texts, GGUF token types and merges, ready for a GGUF writer.

    Layout: ids 0..255 are the bytes (id == byte value), then one token per merge,
    then the special tokens, then unused padding up to `n_vocab`.
    """

    tokens: tuple[str, ...]
    token_types: tuple[int, ...]
    merges: tuple[str, ...]  # "left right", in rank order
    n_normal: int  # ids below this are bytes or merges

    @property
    def n_vocab(self) -> int:
        return len(self.tokens)

    def token_id(self, text: str) -> int:
        return self.tokens.index(text)


def build_vocab(n_vocab: int = 384) -> Vocab:
    """The fixture vocabulary: bytes, as many merges as fit, specials, padding."""
    n_merges = n_vocab - 256 - len(SPECIAL_TOKENS)
    if n_merges < 0:
        raise ValueError(f"n_vocab={n_vocab} leaves no room for the bytes and specials")
    b2u = byte_to_unicode()
    merges = learn_merges(_CORPUS, n_merges)
    tokens = [b2u[b] for b in range(256)] + [a + b for a, b in merges]
    types = [TOKEN_NORMAL] * len(tokens)
    n_normal = len(tokens)
    tokens += SPECIAL_TOKENS
    types += [TOKEN_CONTROL] * len(SPECIAL_TOKENS)
    n_pad = n_vocab - len(tokens)
    tokens += [f"[PAD{i}]" for i in range(n_pad)]
    types += [TOKEN_UNUSED] * n_pad
    if len(set(tokens)) != len(tokens):
        raise AssertionError("duplicate token text in the fixture vocabulary")
    return Vocab(tuple(tokens), tuple(types), tuple(f"{a} {b}" for a, b in merges), n_normal)
