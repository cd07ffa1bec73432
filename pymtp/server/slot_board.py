"""llama-server's ``/slots``: each slot's state and the last request it ran, for the
dashboards and load balancers written for llama-server.

A slot is one of the server's ``--parallel`` generations at a time (a sequence of a
batched engine). The shape is the pinned llama-server's (``server_slot::to_json`` in
tools/server/server-context.cpp, its default ``only_metrics`` form): ``id``, ``n_ctx``,
``speculative``, ``is_processing``, and once a request ran there ``id_task``,
``n_prompt_tokens`` (as llama-server's: the tokens the slot's context holds, its prompt and
the tokens generated so far, what a dashboard sets against ``n_ctx``),
``n_prompt_tokens_processed``, ``n_prompt_tokens_cache``, ``params`` and ``next_token``. pymtp adds ``draft_n`` and ``draft_n_accepted`` (the drafts its
rounds verified and kept, llama-server's names from its timings).

Unlike llama-server:
- a finished request keeps its counts: ``n_decoded``, ``n_remain``, ``has_new_line`` and
  the prompt counts stay as the request left them (llama-server's read 0, -1, false and 0
  once the slot is released);
- ``n_decoded`` leaves out the end-of-generation token, as pymtp's usage does everywhere
  (llama-server counts it, so its ``n_remain`` is one less);
- the prompt counts come once the request ends (pymtp's engine reports them with its
  other stats);
- a request refused before it ran (a bad grammar, say) leaves the slot as it was, as a
  request llama-server refuses never reaches a slot;
- ``params`` tell the values pymtp ran with (llama_params.py): a filter the request's
  ``samplers`` leaves out reads its off value, where llama-server repeats the field.

The board is written from the slots' worker threads and read on the event loop; a slot's
view reads each changing field once, so its numbers agree with each other.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from ..results import Chunk, Stats


def tokens_held(n_prompt: int, n_generated: int, eog: bool) -> int:
    """The tokens a slot's context holds after a generation, as llama-server counts them
    (its ``tokens_cached``, and /slots' ``n_prompt_tokens``): the prompt and the tokens
    but the last sampled, which is not decoded yet (at an end of generation, the end
    token, which pymtp's tokens leave out: then all of them)."""
    return n_prompt + (n_generated if eog else max(n_generated - 1, 0))


@dataclass
class SlotTask:
    """One request on a slot: what it asked, and how far it has got."""

    id_task: int
    n_prompt_tokens: int
    n_predict: int                  # -1: no limit
    params: dict[str, Any]
    n_decoded: int = 0
    has_new_line: bool = False
    drafted: int = 0
    accepted: int = 0
    n_prompt_tokens_cache: int = 0
    n_prompt_tokens_processed: int = 0
    running: bool = True
    eog: bool = False               # it ended at an end-of-generation token (not among the chunks')
    before: SlotTask | None = field(default=None, repr=False)    # the slot's last task until this one

    def took(self, chunk: Chunk) -> None:
        """Count a chunk the request's generation yielded."""
        self.n_decoded += len(chunk.tokens)
        if not chunk.predicted:      # the head's drafts, as the engine's stats count them at the end
            self.drafted += chunk.drafted
            self.accepted += chunk.accepted
        if "\n" in chunk.text:
            self.has_new_line = True
        if chunk.finish_reason == "stop" and not chunk.stop_word:
            self.eog = True

    def end(self, stats: Stats | None) -> None:
        """The generation is over (``stats``: its engine's, None where it never started)."""
        if stats is not None:        # the engine's own counts (its timings') over the chunks'
            self.n_prompt_tokens_cache = stats.cached_tokens
            self.n_prompt_tokens_processed = stats.prompt_processed
            self.drafted, self.accepted = stats.drafted, stats.accepted
            # the tokens to go with those drafts: a stream cancelled mid-round counted its
            # drafts but not the round's tokens the client never took
            self.n_decoded = stats.generated_tokens
        self.running = False


@dataclass
class SlotBoard:
    """The last task of each of ``n_slots`` slots, each slot holding ``n_ctx`` tokens;
    ``speculative``: whether the slots draft with the MTP head."""

    n_slots: int
    n_ctx: int
    speculative: bool
    tasks: list[SlotTask | None] = field(init=False)
    _ids: itertools.count = field(init=False, default_factory=itertools.count)

    def __post_init__(self) -> None:
        self.tasks = [None] * self.n_slots

    def begin(self, slot: int, n_prompt_tokens: int, n_predict: int, params: dict[str, Any]) -> SlotTask:
        """A request starts on ``slot``; its task takes the next id."""
        task = SlotTask(next(self._ids), n_prompt_tokens, n_predict, params, before=self.tasks[slot])
        self.tasks[slot] = task
        return task

    def end(self, slot: int, task: SlotTask, stats: Stats | None) -> None:
        """``task`` is over: with the engine's ``stats``, or none where the request was
        refused before it ran, which leaves the slot showing the task before it."""
        task.end(stats)
        if stats is None and self.tasks[slot] is task:
            self.tasks[slot] = task.before
        task.before = None          # no chain of old tasks kept alive

    def most_held(self) -> int:
        """The most tokens a running slot's context holds now (/slots' ``n_prompt_tokens``),
        of those past their prompt (a token out): llama-server's ``n_tokens_max`` reads
        its slots at every decode."""
        return max((tokens_held(t.n_prompt_tokens, t.n_decoded, t.eog) for t in list(self.tasks)
                    if t is not None and t.running and t.n_decoded), default=0)

    def view(self) -> list[dict[str, Any]]:
        """``/slots``' answer."""
        return [self._slot(i, t) for i, t in enumerate(self.tasks)]

    def _slot(self, i: int, t: SlotTask | None) -> dict[str, Any]:
        running = t is not None and t.running
        out: dict[str, Any] = {"id": i, "n_ctx": self.n_ctx, "speculative": self.speculative,
                               "is_processing": running}
        if t is None:
            return out
        decoded, eog = t.n_decoded, t.eog         # once: the worker may be writing them
        return out | {
            "id_task": t.id_task,
            "n_prompt_tokens": tokens_held(t.n_prompt_tokens, decoded, eog),
            "n_prompt_tokens_processed": t.n_prompt_tokens_processed,
            "n_prompt_tokens_cache": t.n_prompt_tokens_cache,
            "params": t.params,
            "next_token": [{"has_next_token": running, "has_new_line": t.has_new_line,
                            "n_remain": -1 if t.n_predict < 0 else max(t.n_predict - decoded, 0),
                            "n_decoded": decoded}],
            "draft_n": t.drafted, "draft_n_accepted": t.accepted,
        }
