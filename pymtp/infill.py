"""Fill-in-the-middle prompts for code completion: the text before and after the cursor
(and other files) around a FIM model's special tokens, laid out as llama-server's
``/infill`` lays them out (``format_prompt_infill`` in the pinned tools/server), so that
editor plugins written for it (llama.vscode, llama.vim) get the same prompt:

    [FIM_REP]myproject\\n [FIM_SEP]name\\n text ... [FIM_SEP]filename\\n
    [BOS] [FIM_PRE] prefix prompt [FIM_SUF] suffix [FIM_MID]

(suffix first with ``spm``). The extra files come only where the vocabulary has the
repository and file-separator tokens, else each after a "--- snippet ---" line. The
prompt is shared out of a batch of ``n_batch`` tokens: the prefix's last 3/4 of it, the
suffix's first 1/4 less the ``prompt`` (the cursor's line, llama.vscode's) and two tokens;
the extra files' last tokens fill what the context has left after a batch and twice
``n_predict`` (the server's ``/infill`` passes -1, as llama-server passes its
server-wide ``-n``, not the request's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

# llama-server's default --batch-size, which its /infill shares out between the prefix and
# the suffix; pymtp's own decode batch is smaller and says nothing about the prompt's shape
INFILL_BATCH = 2048
_SNIPPET = "\n\n--- snippet ---\n\n"


class InfillUnsupported(ValueError):
    """The model's vocabulary lacks a fill-in-the-middle token."""


@dataclass(frozen=True)
class FimTokens:
    """A vocabulary's fill-in-the-middle tokens (None: it has none), and its BOS where it
    adds one to a prompt."""

    pre: int | None
    suf: int | None
    mid: int | None
    rep: int | None = None
    sep: int | None = None
    bos: int | None = None

    def check(self) -> None:
        """``InfillUnsupported`` naming the missing tokens, as llama-server's 501 names them."""
        missing = [name for name, t in (("prefix", self.pre), ("suffix", self.suf), ("middle", self.mid))
                   if t is None]
        if missing:
            raise InfillUnsupported(f"Infill is not supported by this model: {', '.join(missing)} token "
                                    "missing; serve a model trained for fill-in-the-middle (its vocabulary "
                                    "has <|fim_prefix|>, <|fim_suffix|>, <|fim_middle|> or the like)")


Mixed = str | Sequence[int | str]


def mixed_ids(part: Mixed, tokenize: Callable[[str], list[int]]) -> list[int]:
    """Text, or ids and texts mixed, as ids (llama-server's tokenize_mixed, no specials)."""
    if isinstance(part, str):
        return tokenize(part)
    return [t for x in part for t in (tokenize(x) if isinstance(x, str) else [int(x)])]


def infill_prompt(fim: FimTokens, tokenize: Callable[[str], list[int]], prefix: Mixed, suffix: Mixed,
                  extra: Sequence[tuple[str, str]] = (), prompt: Sequence[int] = (), *,
                  n_batch: int | None = INFILL_BATCH, n_ctx: int, n_predict: int = -1,
                  spm: bool = False) -> list[int]:
    """The prompt's ids (the module docstring). ``tokenize`` turns text into ids with no
    special tokens parsed or added; ``extra`` holds (file name, text) pairs; ``prompt``
    is already ids (its special-token text parsed, as llama-server reads it). ``n_batch``
    None keeps the whole prefix, suffix and files (OpenAI's suffix: the client sized them)."""
    fim.check()
    pre, suf, prompt = mixed_ids(prefix, tokenize), mixed_ids(suffix, tokenize), list(prompt)
    files: list[int] = []
    if fim.rep is not None:
        files += [fim.rep] + tokenize("myproject\n")
    for name, text in extra:
        files += [fim.sep] + tokenize(name + "\n") if fim.sep is not None else tokenize(_SNIPPET)
        files += tokenize(text)
    if fim.sep is not None:
        files += [fim.sep] + tokenize("filename\n")
    if n_batch is None:
        n_pre, n_suf, n_files = len(pre), len(suf), len(files)
    else:
        n_pre = min(len(pre), 3 * (n_batch // 4))
        n_suf = min(len(suf), max(0, n_batch // 4 - (2 + len(prompt))))
        n_files = min(max(0, n_ctx - n_batch - 2 * n_predict), len(files))
    pre = [fim.pre] + pre[len(pre) - n_pre:] + prompt
    suf = [fim.suf] + suf[:n_suf]
    first, second = (suf, pre) if spm else (pre, suf)
    head = files[len(files) - n_files:] + ([fim.bos] if fim.bos is not None else [])
    return head + first + second + [fim.mid]
