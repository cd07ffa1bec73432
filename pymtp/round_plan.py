"""How a round's batch is shaped and cut: pure functions over lists of ints, testable by hand.

llama.cpp splits a multi-sequence batch into ubatches of equal rows per sequence and keeps
a sequence's last n_rs_seq + 1 rows in one, so how many rows each sequence puts in a verify
decode decides how many weight passes the decode costs. These functions decide those rows
(``verify_rows``, ``prefill_chunks``, ``shaped_chunks``) and where a round's emitted tokens
stop (``stop_rules``, ``kept_drafts``); ``Rounds`` (rounds.py) applies them.
"""

from __future__ import annotations

from typing import Callable

# a prompt chunk at most this many tokens longer than the decoding sequences' rows rides
# as their rows (shaped_chunks): a prompt's last TAIL_TOKENS (prefix_cache) are one
SHAPED_ROWS = 4


def stop_rules(tokens: list[int], produced: int, max_tokens: int,
                is_eog: Callable[[int], bool]) -> tuple[list[int], str | None]:
    """Cut a run of emitted tokens at its first end-of-generation token within max_tokens,
    else at max_tokens. A seeded request's round may run past max_tokens (Drafting._room):
    an end token there comes after the limit, which plain decoding stops at first."""
    room = max_tokens - produced
    for i, token in enumerate(tokens[:room]):
        if is_eog(token):
            return tokens[:i], "stop"
    if len(tokens) >= room:
        return tokens[:room], "length"
    return tokens, None


def kept_drafts(n_accepted: int, n_emitted: int, finish: str | None) -> int:
    """Accepted drafts a round leaves in the target's KV. A sequence that goes on keeps
    them all; one that ends inside them keeps what it emitted, and an end-of-generation
    draft too, so its KV holds what a chat's next turn resends (its reply, then the
    end-of-turn token) and the prompt cache can reuse all of it."""
    if finish is None:
        return n_accepted
    return min(n_accepted, n_emitted + (finish == "stop"))


def verify_rows(n_rows: list[int], checkpointed: list[bool], n_rs_seq: int, space: list[int]) -> list[int]:
    """Rows each sequence puts in the verify batch: its own k + 1, padded to the longest.

    llama.cpp splits a multi-sequence batch into ubatches of equal rows per sequence (and
    keeps a sequence's last n_rs_seq + 1 rows in one), so sequences of different depths
    would each get a ubatch of their own, paying for every weight again. A pad row costs
    one row of compute; the snapshots roll it back with the rejected drafts. Sequences
    whose rollback goes through a checkpoint, and any padding the snapshots could not
    roll back, are left alone; so is a sequence with less ``space`` (positions left in
    its context) than the longest: pads past its context failed the whole batch's decode.
    """
    longest = max(n_rows, default=0)
    if longest - 1 > n_rs_seq:
        return list(n_rows)
    return [n if ck or room < longest else longest for n, ck, room in zip(n_rows, checkpointed, space)]


def prefill_chunks(remaining: list[int], scoring: list[bool], rows: int, outputs: int) -> list[int]:
    """Prompt tokens each prefilling sequence decodes this round, first come first served,
    within the rows and the outputs the verify batch leaves. A prompt's last chunk outputs
    its last row; a chunk scoring the prompt (prompt_logprobs) outputs every row."""
    out = []
    for n, every_row in zip(remaining, scoring):
        take = max(0, min(n, rows, outputs if every_row else n))
        if not every_row and take == n and outputs < 1:
            take -= 1          # the last chunk waits for an output row
        take = max(take, 0)
        out.append(take)
        rows -= take
        outputs -= take if every_row else int(take == n and take > 0)
    return out


def shaped_chunks(sizes: list[int], scoring: list[bool], rows: int | None, n_rs_seq: int,
                  room: int, space: list[int]) -> list[tuple[int, int]]:
    """(prompt tokens, pad rows) each prompt chunk decodes beside decoding sequences that
    all put ``rows`` rows in the verify (None: they differ, or there are none), within
    ``room`` batch rows for them all and each chunk's ``space`` (positions left in its
    sequence's context from the chunk's start).

    llama.cpp splits a batch into ubatches of equal rows per sequence, and keeps a
    sequence's last n_rs_seq + 1 rows in one. So a chunk of other than ``rows`` tokens
    costs a ubatch of its own, and when it is shorter than the snapshots' tail, one for
    every sequence before it; on a GPU each such ubatch runs outside the captured graph
    and the decode rounds after it too (benchmarks/batch_mix.py, H100 demo: 7 one-row
    decodes 0.58 ms, with a 4-token chunk 4.7 ms). A short chunk (within SHAPED_ROWS, or
    within the snapshots' tail, of ``rows``) rides as ``rows`` rows over as many rounds
    as it needs instead, its last ones padded where it runs short: the snapshots roll
    the pads back, as they do a verify's (``Rounds._prefilled``). A chunk scoring every
    row (prompt_logprobs) is left as it is."""
    keep_tail = n_rs_seq + 1 if n_rs_seq else 0
    spare = room - sum(sizes)
    out = []
    for n, every_row, left in zip(sizes, scoring, space):
        if rows is None or every_row or n == 0 or n - rows >= max(keep_tail, SHAPED_ROWS):
            out.append((n, 0))
            continue
        take = min(n, rows)
        spare += n - take
        pads = rows - take if rows - take <= min(n_rs_seq, spare, left - take) else 0
        spare -= pads
        out.append((take, pads))
    return out
