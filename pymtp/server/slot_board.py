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

Unlike llama-server, a finished request keeps its counts (llama-server zeroes its
decoded tokens and prompt counts when the slot is released), and the prompt counts come
once the request ends (pymtp's engine reports them with its other stats).

The board is written from the slots' worker threads and read on the event loop: each
field is one attribute store, and a reader takes whatever the last stores left.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from ..generate import Chunk, Stats


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

    def took(self, chunk: Chunk) -> None:
        """Count a chunk the request's generation yielded."""
        self.n_decoded += len(chunk.tokens)
        self.drafted += chunk.drafted
        self.accepted += chunk.accepted
        if "\n" in chunk.text:
            self.has_new_line = True
        if chunk.finish_reason == "stop" and not chunk.stop_word:
            self.eog = True

    @property
    def n_held(self) -> int:
        """The tokens the slot's context holds, as llama-server counts them: the prompt and
        the tokens but the last sampled (not decoded yet; at an end of generation, the end
        token, which the chunks leave out)."""
        return self.n_prompt_tokens + (self.n_decoded if self.eog else max(self.n_decoded - 1, 0))

    def end(self, stats: Stats | None) -> None:
        """The generation is over (``stats``: its engine's, None where it never started)."""
        if stats is not None:        # the engine's own counts (its timings') over the chunks'
            self.n_prompt_tokens_cache = stats.cached_tokens
            self.n_prompt_tokens_processed = stats.prompt_tokens - stats.cached_tokens
            self.drafted, self.accepted = stats.drafted, stats.accepted
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
        task = SlotTask(next(self._ids), n_prompt_tokens, n_predict, params)
        self.tasks[slot] = task
        return task

    @property
    def n_idle(self) -> int:
        return sum(1 for t in self.tasks if t is None or not t.running)

    def view(self) -> list[dict[str, Any]]:
        """``/slots``' answer."""
        return [self._slot(i, t) for i, t in enumerate(self.tasks)]

    def _slot(self, i: int, t: SlotTask | None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": i, "n_ctx": self.n_ctx, "speculative": self.speculative,
                               "is_processing": t is not None and t.running}
        if t is None:
            return out
        n_remain = -1 if t.n_predict < 0 else max(t.n_predict - t.n_decoded, 0)
        return out | {
            "id_task": t.id_task,
            "n_prompt_tokens": t.n_held,
            "n_prompt_tokens_processed": t.n_prompt_tokens_processed,
            "n_prompt_tokens_cache": t.n_prompt_tokens_cache,
            "params": t.params,
            "next_token": [{"has_next_token": t.running, "has_new_line": t.has_new_line,
                            "n_remain": n_remain, "n_decoded": t.n_decoded}],
            "draft_n": t.drafted, "draft_n_accepted": t.accepted,
        }
