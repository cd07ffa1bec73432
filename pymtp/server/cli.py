"""The ``pymtp serve`` command: parses options, loads the model, hands the app to uvicorn."""

from __future__ import annotations

import os
from typing import Mapping, get_args

import click

from ..clitypes import (CTX_SIZE, CTX_SIZE_HELP, DRAFT_MAX, ENGINES, HELP, LLAMA_FLAGS, LLAMA_FLAGS_OF, CacheMiB,
                        FiniteRange, LlamaFlags, model_arg,
                        check_before_load, check_rpc, draft_vocab_option, given, resolve_spec, rpc_options,
                        sampling_options)
from ..config import (CTX_STEP, DEFAULT_N_CTX, DEFAULT_PROMPT_CACHE_MIB, DEFAULTS, REASONING_FORMATS, THREADS_MAX,
                      DecodeParams, FlashAttn, Spec, draft_limit_for, shown_draft_max)
from ..gguf_info import ModelFileError, require_mtp
from .settings import (DEFAULT_BODY_TIMEOUT, DEFAULT_MAX_BODY_SIZE, DEFAULT_SHUTDOWN_TIMEOUT, ServerSettings,
                       cors_origins, default_threads)


def _names(value: str | None, option: str) -> tuple[str, ...]:
    """``NAME,ALIAS,...`` split on commas; empty names are an error, not silently dropped."""
    if value is None:
        return ()
    names = tuple(n.strip() for n in value.split(","))
    if not all(names):
        raise click.BadParameter(f"{value!r} has an empty name; give NAME or NAME,ALIAS,...", param_hint=option)
    return tuple(dict.fromkeys(names))


# llama-server's environment variables (common/arg.cpp's set_env) for the options pymtp serve
# shares with it: a deployment moved over from llama-server keeps its settings, its API key
# above all (without it the server would run open). A flag on the command line wins, as there.
LLAMA_ENV: dict[str, tuple[str, ...]] = {
    "model": ("LLAMA_ARG_MODEL",),
    "host": ("LLAMA_ARG_HOST",),
    "port": ("LLAMA_ARG_PORT",),
    "parallel": ("LLAMA_ARG_N_PARALLEL",),
    "n_ctx": ("LLAMA_ARG_CTX_SIZE",),
    "draft_max": ("LLAMA_ARG_SPEC_DRAFT_N_MAX", "LLAMA_ARG_DRAFT_MAX"),
    "p_min": ("LLAMA_ARG_SPEC_DRAFT_P_MIN",),
    "temperature": ("LLAMA_ARG_TEMPERATURE",),
    "top_k": ("LLAMA_ARG_TOP_K",),
    "top_p": ("LLAMA_ARG_TOP_P",),
    "min_p": ("LLAMA_ARG_MIN_P",),
    "repeat_penalty": ("LLAMA_ARG_REPEAT_PENALTY",),
    "frequency_penalty": ("LLAMA_ARG_FREQUENCY_PENALTY",),
    "presence_penalty": ("LLAMA_ARG_PRESENCE_PENALTY",),
    "cache_ram": ("LLAMA_ARG_CACHE_RAM",),
    "api_key": ("PYMTP_API_KEY", "LLAMA_API_KEY"),
    "api_key_file": ("LLAMA_ARG_API_KEY_FILE",),
    "threads": ("LLAMA_ARG_THREADS",),
    "alias": ("LLAMA_ARG_ALIAS",),
    "reasoning_budget": ("LLAMA_ARG_THINK_BUDGET",),
    "reasoning_budget_message": ("LLAMA_ARG_THINK_BUDGET_MESSAGE",),
    "webui": ("LLAMA_ARG_UI",),
    "slots_endpoint": ("LLAMA_ARG_ENDPOINT_SLOTS",),
    "cors": ("LLAMA_ARG_CORS_ORIGINS",),
    "flash_attn": ("LLAMA_ARG_FLASH_ATTN",),
    "rpc": ("LLAMA_ARG_RPC",),
    "tensor_split": ("LLAMA_ARG_TENSOR_SPLIT",),
    "reasoning_format": ("LLAMA_ARG_THINK",),
    "jinja": ("LLAMA_ARG_JINJA",),
    "metrics": ("LLAMA_ARG_ENDPOINT_METRICS",),
}
# llama-server's variables for options pymtp serve does not have, which change what it would
# do, and their flags: refused at start as the flags are (clitypes.LLAMA_FLAGS), not served as
# if unset (-n 8 as a variable let replies run to the end of the context)
LLAMA_ENV_REFUSED: dict[str, str] = {
    "LLAMA_ARG_N_PREDICT": "-n", "LLAMA_ARG_CHAT_TEMPLATE": "--chat-template",
    "LLAMA_ARG_CHAT_TEMPLATE_FILE": "--chat-template-file", "LLAMA_ARG_SSL_KEY_FILE": "--ssl-key-file",
    "LLAMA_ARG_SSL_CERT_FILE": "--ssl-cert-file", "LLAMA_ARG_API_PREFIX": "--api-prefix",
    "LLAMA_ARG_HF_REPO": "-hf", "LLAMA_ARG_HF_FILE": "-hff", "LLAMA_ARG_MODEL_URL": "-mu",
    "LLAMA_ARG_SPEC_DRAFT_MODEL": "-md",
}


def _refuse_llama_env(environ: Mapping[str, str]) -> None:
    """A set variable of ``LLAMA_ENV_REFUSED`` is a usage error naming it, and its flag's hint."""
    hints = {**LLAMA_FLAGS, **LLAMA_FLAGS_OF["serve"]}
    for name, flag in LLAMA_ENV_REFUSED.items():
        if environ.get(name):
            raise click.UsageError(f"{name} is set: llama-server's {flag}, which pymtp serve does not take "
                                   f"({hints[flag]}); unset it")


def _llama_env(command: click.Command) -> click.Command:
    """``command`` with its options of ``LLAMA_ENV`` read from those variables (--help shows them)."""
    for p in command.params:
        if p.name in LLAMA_ENV:
            p.envvar = list(LLAMA_ENV[p.name])
            if isinstance(p, click.Option):
                p.show_envvar = True
    return command


class _Keys(click.types.StringParamType):
    """--api-key's value; a variable holding several is split on commas, as the option's is."""

    name = "KEY[,KEY...]"
    envvar_list_splitter = ","


@_llama_env
@click.command(cls=LlamaFlags, context_settings=HELP,
               short_help="Serve a model over OpenAI's, Anthropic's and llama-server's HTTP APIs.")
@model_arg
@click.option("--spec", type=click.Choice(get_args(Spec)), default=None,
              help="Default decoding for requests (a request may send its own \"spec\") "
                   "[default: mtp when the model has an MTP block, else none].")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8080, show_default=True, type=click.IntRange(1, 65535), help="Port to listen on.")
@click.option("--parallel", "-np", default=1, show_default=True, type=click.IntRange(min=1),
              help="Slots: requests decoded at the same time, together in every round of "
                   "their batched engine (--engines).")
@click.option("--engines", default="auto", show_default=True, type=ENGINES, metavar="N|auto",
              help="Batched engines sharing the slots, each stepped by a thread of its own: on a GPU "
                   "one's host work overlaps another's decodes. auto: one per two slots (at most 4) on "
                   "a GPU of this host, one on a CPU (whose cores the engines would share) or over "
                   "--rpc.")
@click.option("--queue", default=None, type=click.IntRange(min=0),
              help="Requests that may wait for a slot before the server answers 503 "
                   "[default: 4 per slot].")
@click.option("--ctx-size", "-c", "n_ctx", default=DEFAULT_N_CTX, show_default=True, type=CTX_SIZE,
              help=f"Context of each slot, prompt and output together; {CTX_SIZE_HELP}")
@click.option("--draft-max", "-k", default=DEFAULTS.draft_max, show_default="auto", type=DRAFT_MAX,
              help='Most draft tokens per round (requests may ask for fewer), or "auto": one '
                   'depth (0: plain) for every such request, by measured tokens per second. Left '
                   'out: auto, but a request sampled with a seed drafts 3, so that its seed '
                   'repeats its text.')
@click.option("--calibrate/--no-calibrate", default=False, show_default=True,
              help='With --draft-max auto: search the depths at start, one copy of a built-in '
                   'prompt in every slot, instead of on the first requests (off: under load on '
                   'the H100 it helped one model and cost the other).')
@click.option("--p-min", default=DEFAULTS.p_min, show_default=True, type=float,
              help="Stop drafting when the head's top probability falls below this.")
@sampling_options
@click.option("--cache-ram", "-cram", "cache_ram", default=DEFAULT_PROMPT_CACHE_MIB, show_default=True,
              type=CacheMiB(), metavar="MIB",
              help="Prompt cache: MiB of recurrent-state snapshots kept so that a request resending "
                   "what a slot holds (a chat's earlier turns) decodes only the rest; 0 turns it off. "
                   "Requests may send \"cache_prompt\": false: decoded from scratch and, unlike "
                   "llama-server's, not kept for the next request either.")
@click.option("--api-key", multiple=True, type=_Keys(),
              help="Require 'Authorization: Bearer KEY' or 'x-api-key: KEY'; several keys separated by "
                   "commas or the option repeated, as llama-server's.")
@click.option("--api-key-file", multiple=True, type=click.File("r", encoding="utf-8"),
              help="A file of API keys, one a line (lines starting with # are comments), as llama-server's; "
                   "repeated, or with --api-key, every file's and option's key is let in.")
@click.option("--threads", "-t", default=None, type=click.IntRange(1, THREADS_MAX),
              help="CPU threads of each batched engine's decodes [default: all cores].")
@click.option("--alias", "-a", default=None, metavar="NAME[,ALIAS...]",
              help="Model id to serve under [default: the GGUF's name], and more names /v1/models lists, "
                   "as llama-server's; requests may still name any model.")
@click.option("--served-model-name", "served_names", default=None, metavar="NAME[,ALIAS...]",
              help="As in vLLM: serve under NAME (and ALIASes) and refuse any other model name "
                   "with 404 [default: accept any name].")
@click.option("--max-body-size", default=DEFAULT_MAX_BODY_SIZE, show_default=True, type=click.IntRange(min=1),
              metavar="BYTES", help="Refuse larger request bodies with 413, before reading them.")
@click.option("--body-timeout", default=DEFAULT_BODY_TIMEOUT, show_default=True,
              type=FiniteRange(min=0, min_open=True), metavar="SECONDS",
              help="Answer 408 when a request's body has not all arrived this long after its headers.")
@click.option("--shutdown-timeout", default=DEFAULT_SHUTDOWN_TIMEOUT, show_default=True,
              type=FiniteRange(min=0), metavar="SECONDS",
              help="On SIGTERM/SIGINT, how long running requests may finish before they are ended "
                   "with an error; new ones get 503 meanwhile.")
@click.option("--reasoning-format", default="auto", show_default=True, type=click.Choice(REASONING_FORMATS),
              help="Chat replies: a reasoning model's leading <think> block comes back apart, as "
                   "reasoning_content (auto, deepseek: llama-server's names), or stays in the "
                   "content (none). Requests may send \"reasoning_format\".")
@click.option("--reasoning-budget", default=-1, show_default=True, type=click.IntRange(min=-1), metavar="N",
              help="Chat with a thinking template: at most N tokens of thinking, then the block's end "
                   "is forced (0 ends it at once; -1 no budget). llama-server's flag; requests may send "
                   "\"reasoning_budget_tokens\".")
@click.option("--reasoning-budget-message", default="", metavar="TEXT",
              help="Written before the forced end of thinking when the budget runs out (llama-server's "
                   "flag); requests may send \"reasoning_budget_message\".")
@click.option("--spm-infill", is_flag=True,
              help="/infill prompts put the suffix before the prefix (Suffix/Prefix/Middle), for the "
                   "code models trained that way; llama-server's flag.")
@click.option("--webui/--no-webui", default=True, show_default=True,
              help="Serve the chat page on GET /: chat with the model and watch which tokens "
                   "were accepted drafts.")
@click.option("--slots/--no-slots", "slots_endpoint", default=True, show_default=True,
              help="Serve GET /slots: each slot's state and its last request's settings and counts "
                   "(llama-server's monitoring route and flag).")
@click.option("--cors-origins", "cors", default="*", show_default=True, metavar="ORIGINS",
              help="Browser pages of these origins may call the API (CORS): \"*\" any, \"localhost\" "
                   "pages of this machine, or a comma-separated list; \"\" none. llama-server's flag.")
@click.option("--flash-attn", "-fa", type=click.Choice(get_args(FlashAttn)), default=None,
              help="Flash attention (default: off on CPUs, where it breaks greedy identity; auto on GPUs).")
@click.option("--jinja", is_flag=True, help="Accepted, as llama-server's: chat templates are always jinja here.")
@click.option("--metrics", is_flag=True, help="Accepted, as llama-server's: /metrics is always served.")
@click.option("--log-level", default="info", show_default=True, help="The server's log: info lists every request.",
              type=click.Choice(["critical", "error", "warning", "info", "debug"]))
@draft_vocab_option
@rpc_options
def serve(model, spec, host, port, parallel, engines, queue, n_ctx, draft_max, calibrate, p_min, temperature, top_k,
          top_p, min_p, seed, repeat_penalty, frequency_penalty, presence_penalty, repeat_last_n, cache_ram,
          api_key, api_key_file, threads, alias, served_names, max_body_size, body_timeout, shutdown_timeout, reasoning_format,
          reasoning_budget, reasoning_budget_message, spm_infill, webui, slots_endpoint, cors, flash_attn, jinja, metrics,
          log_level, draft_vocab, rpc,
          tensor_split, rpc_timeout) -> None:
    """Serve MODEL (a .gguf; default: the embedded demo model) over an OpenAI-compatible API.

    Routes: /v1/models, /v1/completions, /v1/chat/completions, /v1/responses, /health,
    /metrics, Anthropic's /v1/messages, llama-server's /completion, /infill, /tokenize, /detokenize,
    /apply-template, /props and /slots, and the chat page
    on / with the JSON of its live panel on /pymtp/stats.

    The sampling options (--temp, --top-k, --top-p, --min-p, --seed, the penalties) are
    what a request that leaves the field out gets, as llama-server's; a request's own
    fields win.

    With --rpc, a lost worker ends the running requests with a 502 naming it, and the
    server goes on with the model loaded on this host alone where it fits.
    """
    _refuse_llama_env(os.environ)
    names = _names(served_names, "--served-model-name")
    aliases = _names(alias, "--alias")
    if names and aliases:
        raise click.UsageError("--alias and --served-model-name both set the model id; use one")
    if engines != "auto" and engines > parallel:
        raise click.UsageError(f"--engines {engines} is more than the {parallel} slot(s) of --parallel: "
                               "each engine decodes at least one slot; lower --engines or raise --parallel")
    if engines != "auto" and engines > 1 and rpc:
        raise click.UsageError("--engines above 1 cannot serve a model split over --rpc workers (a lost "
                               "worker fails the model over to one engine on this host); leave --engines out")
    if calibrate and (draft_max not in ("auto", None) or spec == "none"):
        raise click.UsageError("--calibrate searches the depths of --draft-max auto with MTP; add "
                               "--draft-max auto, or leave --calibrate out")

    check_rpc(rpc, tensor_split)
    _check_listen(host, port)        # before the model loads, which can take minutes
    keys = _api_keys(api_key, api_key_file)
    from ..cli import refused

    sampling = dict(draft_max=draft_max, p_min=p_min, temperature=temperature, top_k=top_k, top_p=top_p,
                    min_p=min_p, seed=seed, repeat_penalty=repeat_penalty, frequency_penalty=frequency_penalty,
                    presence_penalty=presence_penalty, repeat_last_n=repeat_last_n)
    try:
        check_before_load(spec, n_ctx, **sampling)
    except ValueError as exc:
        raise refused(exc) from exc

    from .. import load
    from ..native import NativeError
    from ..rpc import RpcError
    from .app import create_app
    from .drain import serve_app

    try:
        m = load(model, n_ctx=n_ctx, threads=threads or default_threads(parallel),
                 draft_limit=draft_limit_for(draft_max), prompt_cache_mib=cache_ram,
                 rpc=rpc, tensor_split=tensor_split, rpc_timeout=rpc_timeout, draft_vocab=draft_vocab,
                 flash_attn=flash_attn)
        spec, note = resolve_spec(spec, m.info.has_mtp, depth_given=given("draft_max"))
        if calibrate and spec == "none":
            m.close()
            raise click.UsageError(f"--calibrate searches the MTP head's depths, and {m.path.name} has none "
                                   "(graft one with gguf_graft); leave --calibrate out")
        if spec == "mtp":
            require_mtp(m.info, plain="--spec none (and no --draft-max)")
        # the defaults every request starts from, checked again for this model
        decode = DecodeParams(spec=spec, **sampling)
        decode.validate(m.draft_limit)
    except (ModelFileError, ValueError, NativeError, RpcError) as exc:   # NativeError: llama.cpp refused the file
        raise refused(exc) from exc
    if note:
        click.echo(f"pymtp serve: {note}", err=True)
    settings = ServerSettings(decode=decode, parallel=parallel, engines=None if engines == "auto" else engines,
                              queue=queue, api_keys=keys,
                              model_id=aliases[0] if aliases else None, aliases=aliases[1:], served_names=names,
                              max_body_size=max_body_size,
                              body_timeout=body_timeout, webui=webui, calibrate=calibrate,
                              reasoning_format=reasoning_format, reasoning_budget=reasoning_budget,
                              reasoning_budget_message=reasoning_budget_message, spm_infill=spm_infill,
                              slots_endpoint=slots_endpoint, cors_origins=cors_origins(cors))
    try:
        app = create_app(m, settings)
    except (ValueError, NativeError, RpcError) as exc:    # NativeError: no memory for the contexts
        m.close()
        if isinstance(exc, NativeError):
            raise click.ClickException(f"{exc}; each slot holds --ctx-size tokens: a smaller --ctx-size or "
                                       "--parallel needs less memory") from exc
        raise refused(exc) from exc
    service = app.state.service
    if service.calibration is not None:
        c = service.calibration
        rates = ", ".join(f"k={k}: {v:g}" for k, v in c.estimates.items())
        n = len(service.workers)
        click.echo(f"pymtp serve: draft_max=auto calibrated at start in {c.seconds:.2f} s, "
                   f"{service.workers[0].batcher.slots} sequence(s) a round"
                   f"{f' in each of {n} engines' if n > 1 else ''}, estimated tok/s {rates}", err=True)
    template = ("the GGUF's chat template" if not service.template.is_fallback else
                "no chat template in the GGUF: chat uses a plain ChatML fallback")
    click.echo(f"pymtp serve: {m.path.name} as {service.model_id!r}, spec={spec}"
               f"{f', draft_max={shown_draft_max(draft_max)}' if spec == 'mtp' else ''}, {parallel} slot(s) in "
               f"{len(service.workers)} batched engine(s), "
               f"queue {settings.max_queue}, n_ctx {m.n_ctx}"
               f"{_ctx_note(n_ctx, m.n_ctx)}"
               f", prompt cache "
               f"{f'{cache_ram:g} MiB' if cache_ram else 'off'}; {template}", err=True)
    if m.placement:
        click.echo(f"pymtp serve: layers split over {m.placement.describe()}", err=True)
    if webui:
        click.echo(f"pymtp serve: chat page on http://{host}:{port}/ (--no-webui turns it off)", err=True)
    try:
        serve_app(app, host=host, port=port, log_level=log_level, shutdown_timeout=shutdown_timeout)
    finally:
        m.close()


def _check_listen(host: str, port: int) -> None:
    """The address ``serve`` will listen on resolves and is free (uvicorn says so only
    after the model has loaded). Each address the host resolves to is tried as asyncio
    binds it: IPv6 ones only for IPv6, so an IPv4 program on the port leaves "::" free."""
    import errno
    import socket

    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise click.BadParameter(f"{host!r} is no address of this host ({exc.strerror}); give an IP address "
                                 "or a name that resolves, such as 127.0.0.1 or 0.0.0.0", param_hint="'--host'") from None
    for family, kind, proto, _, address in dict.fromkeys(infos):
        try:
            sock = socket.socket(family, kind, proto)
        except OSError:          # a family this kernel lacks (IPv6 off): asyncio skips it too
            continue
        with sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)      # as uvicorn binds
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise click.BadParameter(f"port {port} on {host or 'every address'} is in use by another "
                                             "program; choose another --port or stop that program",
                                             param_hint="'--port'") from None
                raise click.ClickException(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def _api_keys(options: tuple[str, ...], files: tuple) -> tuple[str, ...]:
    """Every --api-key's keys (comma-separated; empty ones, as an unset variable gives, are
    none) and every --api-key-file's (one a line, # comments), as llama-server reads them."""
    keys = [k.strip() for option in options for k in option.split(",")]
    for file in files:
        try:
            held = [line.strip() for line in file.read().splitlines() if not line.startswith("#")]
        except UnicodeDecodeError as exc:
            raise click.BadParameter(f"{file.name} is not UTF-8 text ({exc.reason} at byte {exc.start})",
                                     param_hint="'--api-key-file'") from None
        keys += held
        if not any(held):
            raise click.BadParameter(f"{file.name} holds no key (one a line; # starts a comment)",
                                     param_hint="'--api-key-file'")
    return tuple(dict.fromkeys(k for k in keys if k))


def _ctx_note(asked: int, held: int) -> str:
    """Why the context held differs from --ctx-size, for the start-up line."""
    if asked == 0:
        return " (--ctx-size 0: the length the model was trained for)"
    if held != asked:
        return f" (--ctx-size {asked} rounded up: llama.cpp sizes contexts in steps of {CTX_STEP})"
    return ""


if __name__ == "__main__":  # pragma: no cover
    serve()

