"""Between the routes and the library: prompt building, slot lending, metrics per generation.

Everything here is about one loaded model; nothing here knows about HTTP framing, only
the ``APIError`` a refusal becomes.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import closing
from dataclasses import dataclass, field, replace
from typing import Iterable, Iterator

from ..config import ParamError, added_bias, shown_draft_max
from ..generate import Model
from ..results import Calibration, Chunk, Stats
from ..session import Session
from ..scheduler import BatchMetrics
from ..chat import ChatTemplate, chat_prompt, template_for
from ..constraint import json_schema_grammar
from ..reasoning import block_at_start, budget_start, opener, reply_split, think_first, thinking_tokens
from ..tools import ToolPlan, compiled_reply_constraint, template_messages
from .errors import from_value_error, invalid, model_not_found, overloaded
from .metrics import Metrics
from .responses import Extras
from .schemas import GenerationRequest, asked_kwargs, runnable
from .settings import ServerSettings
from .batching import BatchSlot, BatchWorker, batch_slots, default_engines
from .llama_params import task_params
from .slot_board import SlotBoard, SlotTask
from .slots import Generation, Overloaded, SlotPool


@dataclass
class Run:
    """One generation as the routes see it: its prompt, its first chunk, and its stats."""

    prompt_tokens: int
    gen: Generation[Chunk]
    first: Chunk | None = None
    finish_reason: str | None = None
    stats_out: list[Stats] = field(default_factory=list)
    extras: Extras | None = None       # echo and logprobs, when the request asked
    tools: ToolPlan | None = None      # chat with tools: the reply is read back into tool calls
    # chat whose thinking comes back apart (reasoning.py): whether the prompt opened the
    # block; None: the reply is handed back as the model wrote it
    reasoning: bool | None = None
    # chat that continues its last (assistant) message: that message's text, which the
    # reply's content starts with, as llama-server's does
    prefill: str = ""
    # reasoning_format "none": the generation prompt's think tags, which the reply's content
    # starts with (before ``prefill``), as llama-server's (reasoning.opener)
    opener: str = ""
    slot: int = -1                     # the slot it ran on (llama-server's id_slot)
    prompt_ids: list[int] = field(default_factory=list)    # the prompt as decoded
    decided_out: list[str] = field(default_factory=list)   # a finish the route decided (stop)
    t_first: float = 0.0               # perf_counter() when the first chunk came

    @property
    def stats(self) -> Stats | None:
        return self.stats_out[0] if self.stats_out else None

    @property
    def preamble(self) -> str:
        """What the reply's content starts with before the model's own text: the think tags
        (``opener``), then the continued message (``prefill``)."""
        return self.opener + self.prefill

    def stop(self, finish_reason: str) -> None:
        """End the generation early where the route decided its end (llama-server's line
        rules): /metrics counts it as ``finish_reason``, not as a cancelled run (one that
        had run to its own end before the route read that far counts its own)."""
        self.decided_out.append(finish_reason)
        self.gen.cancel()


def reasoning_tokens(model: Model, run: Run, tokens: Iterable[int]) -> int | None:
    """How many of a reply's ``tokens`` its thinking took (usage's ``reasoning_tokens``);
    None where the reply's thinking does not come back apart (``Run.reasoning``)."""
    if run.reasoning is None:
        return None
    # rendered as the reply's text is: a control token spells nothing there
    return thinking_tokens((model.token_bytes(t, special=False) for t in tokens), run.reasoning)


def _fields(req: GenerationRequest) -> dict[str, str]:
    """The library names a refused parameter as its API does; the client may have said it
    otherwise: its names for this request."""
    return {"prompt": "messages" if req.kind == "chat" else "prompt",
            "max_tokens": req.max_tokens_field,
            "logprobs": "top_logprobs" if req.kind == "chat" else "logprobs",
            "prompt_logprobs": "logprobs", "json_schema": req.format_field,
            "infill": "samplers"}       # the server's infill sampler is named in the list


class Service:
    """One model served through ``settings.parallel`` slots of batched engines (or the
    sessions a caller passes)."""

    def __init__(self, model: Model, settings: ServerSettings, sessions: list[Session] | None = None) -> None:
        self.model = model
        self.settings = settings
        self.owns_sessions = sessions is None
        self.workers: list[BatchWorker] = []
        self.calibration: Calibration | None = None
        group = None
        if sessions is None:       # batched engines; the pool lends their slots (batching.py)
            d = settings.decode
            auto = d.spec == "mtp" and d.draft_max in ("auto", None) and model.has_mtp
            engines = settings.engines or default_engines(settings.parallel, model.on_gpu, bool(model.rpc))
            sessions, self.workers, self.calibration = batch_slots(
                model, settings.parallel, calibrate=auto and settings.calibrate, engines=engines)
            group = (lambda slot: id(slot.worker)) if len(self.workers) > 1 else None
        self.pool: SlotPool[Session] = SlotPool(sessions, settings.max_queue, group=group)
        self.template: ChatTemplate = template_for(model)
        self.metrics = Metrics()
        self.board = SlotBoard(self.pool.size, model.n_ctx,
                               speculative=model.has_mtp and settings.decode.spec == "mtp")
        self.metrics.watch_pool(self.pool.size, lambda: self.pool.busy, lambda: self.pool.waiting, self.board.most_held)
        if self.workers:
            self.metrics.watch_batch(self.batch_metrics, lambda e, seq: self._slot_index(self.workers[e], seq))
        budget = model.cache_budget
        self.metrics.watch_cache((lambda: budget.used) if budget else (lambda: 0), budget.budget if budget else 0)
        p = model.path
        self.strict = bool(settings.served_names)
        if self.strict:
            self.model_id = settings.served_names[0]
            self.names = set(settings.served_names)
        else:
            self.model_id = settings.model_id or model.info.name
            # the file name at most: an absolute path would tell clients about the host
            self.names = {self.model_id, *settings.aliases, model.info.name, p.name, p.stem}
        self.created = int(p.stat().st_mtime)
        self.started = int(time.time())     # /metrics' Process-Start-Time-Unix, as llama-server's

    def close(self) -> None:
        self.pool.cancel_all()
        self.pool.shutdown()
        if self.owns_sessions:
            for s in self.pool.sessions:
                s.close()
        for w in self.workers:
            w.close()

    def batch_metrics(self) -> list[BatchMetrics]:
        """Each batched engine's own metrics (a worker's batcher changes on a fail-over)."""
        return [w.batcher.metrics for w in self.workers]

    # -- what the routes ask
    def card(self) -> dict:
        m, s, d = self.model, self.settings, self.settings.decode
        return {"id": self.model_id, "aliases": sorted(self.names), "tags": [], "object": "model",
                "created": self.created, "owned_by": "pymtp",
                "meta": {**m.facts, "file": m.path.name, "n_ctx": m.n_ctx, "has_mtp": m.has_mtp,
                         "spec": d.spec, "draft_max": shown_draft_max(d.draft_max), "draft_limit": m.draft_limit,
                         "p_min": d.p_min, "parallel": s.parallel,
                         "engines": len(self.workers), "queue": s.max_queue,
                         "chat_template": self.template.source, "aliases": sorted(self.names)}}

    def listed(self) -> dict:
        """The model as Ollama's list shows it, as llama-server's ``/v1/models`` has it:
        the fields pymtp knows nothing of are empty, as there."""
        return {"name": self.model_id, "model": self.model_id, "modified_at": "", "size": "", "digest": "",
                "type": "model", "description": "", "tags": [""], "capabilities": ["completion"], "parameters": "",
                "details": {"parent_model": "", "format": "gguf", "family": "", "families": [""],
                            "parameter_size": "", "quantization_level": ""}}

    @property
    def broken(self) -> Exception | None:
        """Why no engine here can decode (an RPC worker lost and no fail-over), or None."""
        return next((w.broken for w in self.workers if w.broken is not None), None)

    def check_model(self, name: str | None) -> None:
        """Any name is this model, unless --served-model-name made the names strict."""
        if self.strict and name and name not in self.names:
            raise model_not_found(name, self.model_id)

    async def check_prompts(self, reqs: list[GenerationRequest]) -> None:
        """Refuse now a prompt of ``reqs`` that ``start`` would refuse for its length: a
        whole answer runs its generations in turns (``runs.turns``), and a later turn's
        refusal would otherwise come after the earlier turns' work."""
        seen: set[int] = set()
        for req in reqs:
            if id(req.prompt) in seen:       # a prompt's n choices share it
                continue
            seen.add(id(req.prompt))
            try:
                await asyncio.to_thread(self._prompt_ids, req)
            except ParamError as exc:
                raise from_value_error(exc, _fields(req)) from exc

    async def start(self, req: GenerationRequest) -> Run:
        """Build the prompt, wait for a slot and run until the first chunk.

        Everything that can be wrong with a request shows up before the first chunk, so
        a caller that has this Run can commit to a 200.
        """
        self.check_model(req.model)
        req = await asyncio.to_thread(self.biases, req)      # a long bias text tokenizes a while
        fields = _fields(req)
        try:
            ids, tail = await asyncio.to_thread(self._prompt_ids, req)
        except ParamError as exc:      # a prompt that cannot fit, refused before it is all tokenized
            raise from_value_error(exc, fields) from exc
        asked = asked_kwargs(req, self.settings.decode, max_tokens=self.model.n_ctx)
        kwargs = runnable(asked)
        # tools beside a format: a forced call's grammar, or calls or the format. A grammar of
        # pymtp's may think first (a forced call, calls or response_format's JSON); a raw
        # grammar is the client's, with tools or not
        forced = req.tools is not None and req.tools.parses and (req.tools.grammar is not None or req.formatted)
        turn_ends = self.template.turn_ends(constrained=bool(forced or req.formatted),
                                            ignore_eos=bool(kwargs.get("ignore_eos"))) if req.kind == "chat" else ()
        stops = list(req.stop + turn_ends)
        thinks = self._reasoning(req, tail)
        if req.tools is not None:
            stops = req.tools.stops(stops, thinks)
        if req.tools is not None:
            try:
                kwargs["grammar"], kwargs["json_schema"] = await asyncio.to_thread(
                    compiled_reply_constraint, self.model._native, req.tools, kwargs.get("grammar"),
                    kwargs.get("json_schema"), xml=self.template.xml_calls)
            except ParamError as exc:
                raise from_value_error(exc, fields) from exc
        kwargs.update(self._budget(req, self._thinking(req, tail), (forced or req.formatted) and thinks is None))
        if thinks is not None and (forced or req.formatted):     # a formatted reply may think first
            try:
                kwargs.update(await asyncio.to_thread(_thinking_grammar, kwargs, thinks))
            except ParamError as exc:
                raise from_value_error(exc, fields) from exc
        stats_out: list[Stats] = []
        finish: list[str] = []
        decided: list[str] = []       # Run.stop's

        slot = [-1]
        n_predict = -1 if req.max_tokens is None else req.max_tokens
        params = task_params(asked, n_predict=n_predict, stop=req.stop, stream=req.stream,
                             n_probs=req.logprobs or 0, samplers=req.samplers, full=False)
        task: list[SlotTask] = []

        def placed(index: int) -> None:
            slot[0] = index
            task.append(self.board.begin(index, len(ids), n_predict, params))

        def generate(session: Session) -> Iterator[Chunk]:
            where = {}
            if isinstance(session, BatchSlot):     # the slot is the seq id the engine picks
                where["placed"] = lambda seq: placed(self._slot_index(session.worker, seq))
                where["arrived"] = arrived      # its wait for the slot is queue time too
            else:
                placed(self.pool.sessions.index(session))
            # closing(): when the worker stops early, the session's generator must close now
            # (releasing its lock and contexts), not whenever it is garbage-collected.
            try:
                with closing(session.stream(ids, stop=stops, stats_out=stats_out, **kwargs, **where)) as chunks:
                    for chunk in chunks:
                        if chunk.finish_reason:
                            finish.append(chunk.finish_reason)
                        task[0].took(chunk)
                        yield chunk
            except Exception:      # counted as an error, not as a client's cancel
                finish.append("error")
                raise

        def on_end() -> None:
            if task:
                self.board.end(slot[0], task[0], stats_out[0] if stats_out else None)
            if stats_out:     # nothing ran when stream() refused its arguments
                ended = decided or finish or ["cancelled"]
                self.metrics.observe_generation(stats_out[0], ended[0], eog=bool(task) and task[0].eog)

        prefer = None
        if len(self.workers) > 1 and kwargs.get("cache_prompt") is not False:
            def prefer(slot) -> int:       # the engine whose prompt cache skips the most
                return slot.worker.batcher.reusable(ids)
        arrived = time.perf_counter()
        try:
            gen = await self.pool.run(generate, on_end, prefer)
        except Overloaded:
            raise overloaded(self.settings.retry_after) from None
        run = Run(len(ids), gen, stats_out=stats_out, tools=req.tools, reasoning=thinks,
                  prompt_ids=ids, prefill=self._prefill(req), decided_out=decided,
                  opener="" if forced or req.formatted else self._opener(req, tail))
        try:
            run.first = await gen.__anext__()
            run.t_first = time.perf_counter()
        except StopAsyncIteration:
            pass
        except ValueError as exc:
            raise from_value_error(exc, fields) from exc
        except BaseException:
            gen.cancel()
            raise
        run.slot = slot[0]
        if req.echo or req.logprobs is not None:
            run.extras = self._extras(req, ids, run.first)
        return run

    def _slot_index(self, worker: BatchWorker, seq: int) -> int:
        """The pool's index of ``worker``'s slot for seq id ``seq`` (/slots' id, id_slot)."""
        return next(i for i, s in enumerate(self.pool.sessions)
                    if isinstance(s, BatchSlot) and s.worker is worker and s.seq == seq)

    def _extras(self, req: GenerationRequest, ids: list[int], first: Chunk | None) -> Extras:
        """Echo and logprobs rendering for one response. OpenAI counts completions' text
        offsets from the start of the prompt's text, so it is needed even without echo."""
        text = ""
        if req.kind == "completion":
            text = req.prompt if isinstance(req.prompt, str) else \
                b"".join(self.model.token_bytes(t) for t in ids).decode("utf-8", errors="replace")
        return Extras(req.kind, self.model.token_bytes, logprobs=req.logprobs is not None,
                      echo=req.echo, prompt_text=text, prompt_ids=ids,
                      prompt_logprobs=first.prompt_logprobs if first is not None else None)

    def _budget(self, req: GenerationRequest, thinks: bool | None, format_first: bool) -> dict:
        """The reasoning budget keywords of ``req``: a chat's, with a thinking template (as
        llama-server, which has the block's tags only from such a template), its own or
        else the server's; none where neither sets one, or where the reply may not think
        (reasoning.budget_start: ``thinks``, ``_thinking``; ``format_first``)."""
        s = self.settings
        if req.kind != "chat" or not self.template.thinks:
            return {}
        room = budget_start(thinks, format_first)
        if room is None:
            return {}
        budget = s.reasoning_budget if req.reasoning_budget is None else req.reasoning_budget
        if budget < 0:
            return {}
        message = s.reasoning_budget_message if req.reasoning_budget_message is None else req.reasoning_budget_message
        return {"reasoning_budget": budget, "reasoning_budget_message": message, "reasoning_opened": room}

    def _prefill(self, req: GenerationRequest) -> str:
        """The continued message's text (``Run.prefill``), "" where the chat does not continue one."""
        return self.template.text_of(req.messages[-1]["content"]) if req.continue_final else ""

    def _reasoning(self, req: GenerationRequest, tail: str) -> bool | None:
        """``Run.reasoning`` for ``req``, whose prompt ends in ``tail``: how its reply is read."""
        if req.kind != "chat":
            return None
        return reply_split(req.reasoning_format or self.settings.reasoning_format, self.template.thinks, tail,
                           self._prefill(req))

    def _opener(self, req: GenerationRequest, tail: str) -> str:
        """``Run.opener`` for ``req``, whose prompt ends in ``tail`` (a reply a grammar of
        pymtp's formats has none: its content is the call or the JSON)."""
        if req.kind != "chat":
            return ""
        return opener(req.reasoning_format or self.settings.reasoning_format, self.template.thinks, tail,
                      self._prefill(req))

    def _thinking(self, req: GenerationRequest, tail: str) -> bool | None:
        """Where ``req``'s reply may think (reasoning.block_at_start): what the model may
        write, whatever reasoning_format reads of it."""
        if req.kind != "chat":
            return None
        return block_at_start(self.template.thinks, tail, self._prefill(req))

    def _chat_ids(self, req: GenerationRequest, fit_context: bool = True) -> tuple[list[int], str]:
        """The template's own text with special tokens parsed; message content as plain text;
        and the generation prompt's text (chat.chat_prompt)."""
        try:
            return chat_prompt(self.model, self.template, template_messages(req.messages or []),
                               extra=self._template_extra(req), add_generation_prompt=req.add_generation_prompt,
                               continue_final=req.continue_final, fit_context=fit_context)
        except ParamError:      # content that cannot fit the context: the caller maps it
            raise
        except ValueError as exc:
            raise invalid(str(exc), "messages", "invalid_messages") from exc

    async def count_chat_tokens(self, req: GenerationRequest) -> int:
        """The tokens of a chat request's prompt as the chat route decodes it, however many
        (the token-counting routes: a client asks to learn whether to cut its input, so a
        prompt past the context is counted, as llama-server counts it), off the event loop.
        A model the server does not serve is refused as the generating routes refuse it."""
        self.check_model(req.model)
        try:
            return len((await asyncio.to_thread(self._chat_ids, req, False))[0])
        except ParamError as exc:
            raise from_value_error(exc, {"prompt": "messages"}) from exc

    def render_chat(self, req: GenerationRequest) -> str:
        """The chat route's prompt for ``req`` as text (llama-server's /apply-template)."""
        try:
            pieces = self.template.render_pieces(template_messages(req.messages or []), lambda text: [text],
                                                 extra=self._template_extra(req),
                                                 add_generation_prompt=req.add_generation_prompt,
                                                 continue_final=req.continue_final)
            return "".join(text for text, _ in pieces)
        except ValueError as exc:
            raise invalid(str(exc), "messages", "invalid_messages") from exc

    @staticmethod
    def _template_extra(req: GenerationRequest) -> dict:
        """The template's variables beside the messages: the request's, and its tools."""
        extra = dict(req.template_kwargs)
        if req.tools is not None and req.tools.template_tools:
            extra["tools"] = req.tools.template_tools
        return extra

    def _completion_ids(self, prompt: str | list[int]) -> list[int]:
        """The prompt's ids as Session.stream takes them (a string tokenized with special-token
        text parsed), refused as it refuses them (empty, outside the vocabulary, too long):
        ``check_prompts`` finds a later turn's bad ids before the first turn's work."""
        return self.model.prompt_ids(prompt)

    def biases(self, req: GenerationRequest) -> GenerationRequest:
        """``req`` with its ``logit_bias`` by token id: a text (llama-server's) biases each
        of its tokens, as many times as it holds them (no BOS, special text as text)."""
        bias = req.logit_bias
        if not bias or all(isinstance(k, int) for k in bias):
            return req
        out: dict[int | str, float] = {}
        for key, value in bias.items():
            for t in self.model.tokenize(key, add_special=False) if isinstance(key, str) else [key]:
                out[t] = added_bias(out.get(t, 0.0), value)
        return replace(req, logit_bias=out or None)

    def _prompt_ids(self, req: GenerationRequest) -> tuple[list[int], str]:
        """Tokens of the prompt or of the rendered chat (the library refuses an empty one
        or one that does not fit), and a chat's generation prompt ("" for completions)."""
        return self._chat_ids(req) if req.kind == "chat" else (self._completion_ids(req.prompt), "")



def _thinking_grammar(kwargs: dict, opened: bool) -> dict:
    """The grammar and schema keywords of a formatted reply (a forced call, response_format)
    that may think first (reasoning.think_first); off the event loop, as a schema's
    conversion may take a while."""
    source = kwargs.get("grammar") or json_schema_grammar(kwargs.get("json_schema"), "json_schema")
    return {"grammar": think_first(source, opened), "json_schema": None}
