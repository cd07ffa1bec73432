"""The ``pymtp`` command: parses options and calls the library, nothing more."""

from __future__ import annotations

import contextlib
import errno
import importlib.util
import json
import os
import signal
import sys
from typing import get_args

import click

from . import __version__
from .config import (DEFAULT_N_CTX, DEFAULTS, N_CTX_MIN, THREADS_MAX, Accept, DraftKV, FlashAttn, LoadOptions,
                     ParamError, SamplingPath, Spec, draft_limit_for)
from .clitypes import (CTX_SIZE, CTX_SIZE_HELP, DRAFT_MAX, HELP, LOGIT_BIAS, LlamaFlags, OutputErrors, model_arg,
                       check_before_load, check_rpc, draft_vocab_option, logit_bias_of, given, resolve_spec,
                       rpc_options, sampling_options)
from .gguf_info import ModelFileError, require_mtp
from .guard import LlamaCppMissing
from .signals import deferring



# library parameters whose option is not their name spelled with dashes
FLAGS = {"prompt_cache_mib": "--cache-ram", "n_ctx": "--ctx-size", "path": "MODEL"}


# generate's options that only MTP reads, and their flags
MTP_OPTIONS = (("draft_max", "--draft-max"), ("p_min", "--p-min"), ("accept", "--accept"),
               ("draft_kv", "--draft-kv"), ("draft_vocab", "--draft-vocab"), ("prediction", "--prediction"))


def refused(exc: Exception) -> click.ClickException:
    """A library refusal as click's error: a ``ParamError`` as a bad value of the option
    that sets its parameter (exit 2, as click's own checks), anything else plainly."""
    if isinstance(exc, ParamError):
        flag = FLAGS.get(exc.param, f"--{exc.param.replace('_', '-')}")
        return click.BadParameter(str(exc), param_hint=f"'{flag}'")
    return click.ClickException(str(exc))


def _check_plot_file(path: str) -> None:
    """``bench --plot PATH``: a folder that exists and takes files, matplotlib importable,
    a format it writes (none given: PNG), before any run."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise click.BadParameter(f"{path}: {folder} is not a folder this user can write in", param_hint="'--plot'")
    if importlib.util.find_spec("matplotlib") is None:
        raise click.ClickException("--plot needs matplotlib (pip install matplotlib)")
    from matplotlib.backend_bases import FigureCanvasBase

    formats = FigureCanvasBase.get_supported_filetypes()
    suffix = os.path.splitext(path)[1].lower().lstrip(".")
    if suffix and suffix not in formats:
        raise click.BadParameter(f"{path}: matplotlib writes no .{suffix}; end the name in one of "
                                 f"{', '.join('.' + f for f in sorted(formats))}", param_hint="'--plot'")


def _load(model: str | None, threads: int | None, n_ctx: int, draft_limit: int | None = None,
          draft_kv: str = LoadOptions.draft_kv, flash_attn: str | None = None,
          sampling: str = LoadOptions.sampling, rpc: str | None = None, tensor_split=None,
          draft_vocab: int | None = None, rpc_timeout: float | None = LoadOptions.rpc_timeout):
    from . import load
    from .native import NativeError
    from .rpc import RpcError

    check_rpc(rpc, tensor_split)
    try:
        return load(model, threads=threads, n_ctx=n_ctx, draft_limit=draft_limit, draft_kv=draft_kv,
                    flash_attn=flash_attn, sampling=sampling, rpc=rpc, tensor_split=tensor_split,
                    draft_vocab=draft_vocab, rpc_timeout=rpc_timeout)
    except (ModelFileError, ValueError, NativeError, RpcError) as exc:   # NativeError: llama.cpp refused the file
        raise refused(exc) from exc


@contextlib.contextmanager
def _writing_out():
    """A full disk or a closed device behind standard output is the command's error, said
    in one line (it was a traceback from click.echo); a closed pipe (``| head``) stays
    click's own quiet exit."""
    try:
        yield
    except OSError as exc:
        if exc.errno == errno.EPIPE:
            raise
        raise click.ClickException(f"could not write to standard output: {exc.strerror or exc}") from exc


@contextlib.contextmanager
def _terminated_as_exit():
    """SIGTERM and SIGHUP raise SystemExit (the shell's status for the signal) while the
    block runs, so that what it started is stopped on the way out, as on Ctrl-C: their
    default action ended the process at once and left bench's llama-servers running,
    each holding the whole model, and their logs."""
    def leave(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    # deferred out of llama.cpp's log callback, where what it raises was dropped (signals.py)
    previous = {sig: signal.signal(sig, deferring(leave)) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class _Commands(OutputErrors, click.Group):
    """The group of commands, whose Ctrl-C exits 130 as a shell's (and llama.cpp's tools',
    and gguf_graft's) do: click's "Aborted!" exits 1, which a script reads as a failure;
    a missing llama-cpp-python is one "Error:" line."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            click.echo("\ninterrupted", err=True)
            raise SystemExit(128 + signal.SIGINT) from None
        except LlamaCppMissing as exc:       # a traceback of imports would bury the one line that matters
            raise click.ClickException(str(exc)) from None


@click.group(cls=_Commands, context_settings=HELP)
# the package's own version, not its install record: a source checkout on PYTHONPATH (the
# GPU routine's) has none, and click's lookup of it raised RuntimeError
@click.version_option(version=__version__, prog_name="pymtp")
def main() -> None:
    """Fast, lossless MTP speculative decoding of Qwen3.5/3.6 GGUF models."""


def _prompt_text(prompt: str | None, prompt_file) -> str:
    """The prompt of ``--prompt`` or ``--file``: exactly one of them."""
    if (prompt is None) == (prompt_file is None):
        raise click.UsageError("give the prompt as --prompt TEXT or --file FILE (- for stdin), one of them")
    if prompt_file is None:
        return prompt
    try:
        return prompt_file.read()
    except UnicodeDecodeError as exc:
        raise click.BadParameter(f"{prompt_file.name} is not UTF-8 text ({exc.reason} at byte {exc.start})",
                                 param_hint="--file") from None


@main.command(cls=LlamaFlags, context_settings=HELP, short_help="Continue a prompt, with MTP by default.")
@model_arg
@click.option("--prompt", "-p", default=None, help="Text to continue (or --file).")
@click.option("--file", "-f", "prompt_file", type=click.File("r", encoding="utf-8"), default=None,
              help="A file (- for stdin) whose text to continue, as llama.cpp's -f.")
@click.option("--max-tokens", "-n", default=DEFAULTS.max_tokens, show_default=True, type=int,
              help="Most tokens to generate; -1: no limit but the context's end, as llama.cpp's -n -1.")
@click.option("--spec", type=click.Choice(get_args(Spec)), default=None, show_default="mtp, none on a model without it",
              help="mtp: speculative decoding with the model's MTP head; none: plain decoding.")
@click.option("--draft-max", "-k", default=DEFAULTS.draft_max, show_default="auto", type=DRAFT_MAX,
              help='Most draft tokens per round, or "auto": the depth (0: plain decoding) that '
                   'measured the most tokens per second on this machine, per request. Left out: '
                   'auto, but 3 with --seed at temperature > 0, so that the seed repeats its text.')
@click.option("--p-min", default=DEFAULTS.p_min, show_default=True, type=float,
              help="Stop drafting when the head's top probability falls below this.")
@sampling_options
@click.option("--logit-bias", "-l", "logit_bias", multiple=True, type=LOGIT_BIAS,
              help="Add BIAS to a token's logit, as llama.cpp's option: 15043+1, 15043-inf bans it (repeatable).")
@click.option("--accept", type=click.Choice(get_args(Accept)), default=DEFAULTS.accept, show_default=True,
              help="temperature > 0: rejection sampling with the draft's probabilities, or "
                   "llama.cpp's exact-match rule (accepts less, costs the host less).")
@click.option("--threads", "-t", default=None, type=click.IntRange(1, THREADS_MAX),
              help="CPU threads (default: all cores).")
@click.option("--ctx-size", "-c", "n_ctx", default=DEFAULT_N_CTX, show_default=True, type=CTX_SIZE,
              help=f"Tokens the context holds, prompt and output together; {CTX_SIZE_HELP}")
@click.option("--ignore-eos", is_flag=True, help="Keep generating past end-of-text.")
@click.option("--draft-kv", type=click.Choice(get_args(DraftKV)), default=LoadOptions.draft_kv, show_default=True,
              help="MTP cache policy for accepted drafts: target re-decodes them with the target's "
                   "hidden rows; keep keeps the draft chain's rows (auto: keep on a GPU).")
@click.option("--flash-attn", "-fa", type=click.Choice(get_args(FlashAttn)), default=None,
              help="Flash attention (default: off on CPUs, where it breaks greedy identity; auto on GPUs).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object with text, tokens and stats.")
@click.option("--prediction", type=click.File("r", encoding="utf-8"), default=None,
              help="A file (- for stdin) with text the output is expected to repeat, such as the file an "
                   "edit regenerates (OpenAI's Predicted Outputs): where the output follows it, its tokens "
                   "are the drafts. Greedy output stays the same (sampled, its distribution); only its "
                   "speed changes.")
@draft_vocab_option
@rpc_options
def generate(model, prompt, prompt_file, max_tokens, spec, draft_max, p_min, temperature, top_k, top_p, min_p,
             seed, repeat_penalty, frequency_penalty, presence_penalty, repeat_last_n, logit_bias, accept,
             threads, n_ctx, ignore_eos, draft_kv, flash_attn, as_json, prediction, draft_vocab, rpc,
             tensor_split, rpc_timeout) -> None:
    """Continue the prompt with MODEL (a .gguf; default: the embedded demo model)."""
    prompt = _prompt_text(prompt, prompt_file)
    kwargs = dict(max_tokens=max_tokens, draft_max=draft_max, p_min=p_min,
                  temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed,
                  repeat_penalty=repeat_penalty, frequency_penalty=frequency_penalty,
                  presence_penalty=presence_penalty, repeat_last_n=repeat_last_n,
                  logit_bias=logit_bias_of(logit_bias), accept=accept, ignore_eos=ignore_eos)
    if spec == "none":     # an option for the drafts, given where nothing drafts, is a mistake to say
        drafting = [flag for name, flag in MTP_OPTIONS if given(name)]
        if drafting:
            raise click.UsageError(f"{', '.join(drafting)} set{'s' * (len(drafting) == 1)} how MTP drafts, and "
                                   "--spec none decodes plainly: leave --spec none out, or those options")
    no_limit = max_tokens == -1
    if max_tokens < 1 and not no_limit:
        raise click.BadParameter(f"give a number of tokens >= 1, or -1 for no limit but the context's end; "
                                 f"got {max_tokens}", param_hint="'--max-tokens'")
    try:
        check_before_load(spec, n_ctx, **{**kwargs, "max_tokens": 1 if no_limit else max_tokens})
    except ValueError as exc:
        raise refused(exc) from exc
    m = _load(model, threads, n_ctx, draft_limit=draft_limit_for(draft_max),
              draft_kv=draft_kv, flash_attn=flash_attn, rpc=rpc, tensor_split=tensor_split,
              draft_vocab=draft_vocab, rpc_timeout=rpc_timeout)
    spec, note = resolve_spec(spec, m.info.has_mtp, depth_given=given("draft_max"))
    if note:
        click.echo(f"pymtp generate: {note}", err=True)
    if spec == "mtp":
        try:
            require_mtp(m.info, plain="--spec none (and no --draft-max)")
        except ModelFileError as exc:
            raise click.ClickException(str(exc)) from None
    kwargs["spec"] = spec
    if prediction is not None:
        try:
            kwargs["prediction"] = prediction.read()
        except UnicodeDecodeError as exc:
            raise click.BadParameter(f"{prediction.name} is not UTF-8 text ({exc.reason} at byte {exc.start})",
                                     param_hint="--prediction") from None
    try:
        if as_json:
            r = m.generate(prompt, **kwargs)
            stats = r.stats.to_dict()
            if prediction is not None:
                stats.update(predicted_drafted=r.stats.predicted_drafted, predicted_accepted=r.stats.predicted_accepted)
            with _writing_out():
                click.echo(json.dumps({"text": r.text, "tokens": r.tokens, "finish_reason": r.finish_reason,
                                       "stats": stats}))
            return
        stats: list = []
        with _writing_out():
            for chunk in m.stream(prompt, stats_out=stats, **kwargs):
                click.echo(chunk.text, nl=False)
                if sys.stdout is not None:      # closed (>&-): click.echo writes nothing either
                    sys.stdout.flush()
            click.echo("")
    except ValueError as exc:     # a ParamError, or a ModelFileError for spec=mtp without MTP
        raise refused(exc) from exc
    except RuntimeError as exc:   # NativeError: the contexts, made at the first generation (no memory for --ctx-size)
        hint = "; a smaller --ctx-size needs less memory" if "could not create" in str(exc) else ""
        raise click.ClickException(f"{exc}{hint}") from exc
    s = stats[0]
    line = f"[{s.generated_tokens} tokens, {s.tokens_per_second:.1f} tok/s"
    if spec == "mtp" and s.rounds:     # rounds the head drafted (a prediction's rounds are not its)
        line += f", acceptance {s.acceptance_rate:.2f}, {s.mean_accept_len:.2f} tokens/round"
    if prediction is not None:
        line += f", prediction: {s.predicted_accepted} of {s.predicted_drafted} drafts kept"
    click.echo(line + "]", err=True)


@main.command(cls=LlamaFlags, context_settings=HELP,
              short_help="Measure tokens/s of plain decoding against MTP settings (and llama-server).")
@model_arg
@click.option("--prompts", "prompts_file", required=True, type=click.Path(exists=True, dir_okay=False),
              help="JSON lines, each with a \"prompt\" field, or a JSON list of prompt strings.")
@click.option("--max-tokens", "-n", default=DEFAULTS.max_tokens, show_default=True, type=int,
              help="Tokens to generate per prompt.")
@click.option("--draft-max", "-k", "draft_max", multiple=True, type=DRAFT_MAX,
              help='MTP depth to measure, or "auto"; repeat for several (default 1 2 3).')
@click.option("--p-min", "p_mins", multiple=True, type=float,
              help=f"Stop drafting below this top probability; repeat for several (default {DEFAULTS.p_min:g}).")
@click.option("--temperature", "--temp", default=DEFAULTS.temperature, show_default=True, type=float,
              help="0 = greedy (where MTP's output must equal plain decoding's).")
@click.option("--top-k", default=DEFAULTS.top_k, show_default=True, type=int, help="0 = off.")
@click.option("--top-p", default=DEFAULTS.top_p, show_default=True, type=float, help="1.0 = off.")
@click.option("--min-p", default=DEFAULTS.min_p, show_default=True, type=float, help="0.0 = off.")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(min=0),
              help="Base seed (>= 0); prompt i uses seed+i.")
@click.option("--accept", "accept_rules", multiple=True, type=click.Choice(get_args(Accept)),
              help="temperature > 0: acceptance rule(s) to measure (default rejection).")
@click.option("--reps", default=1, show_default=True, type=click.IntRange(min=1), help="Repetitions per prompt.")
@click.option("--limit", default=None, type=click.IntRange(min=1), help="Use only the first N prompts.")
@click.option("--threads", "-t", default=None, type=click.IntRange(1, THREADS_MAX),
              help="CPU threads, pymtp's and each llama-server's (default: all cores).")
@click.option("--ctx-size", "-c", "n_ctx", default=DEFAULT_N_CTX, show_default=True, type=click.IntRange(min=N_CTX_MIN),
              help="Tokens the context holds, prompt and output together.")
@click.option("--against-llama-server", "server_binary", default=None, type=click.Path(exists=True, dir_okay=False),
              help="Also measure this llama-server binary on the same prompts and settings.")
@click.option("--llama-server-args", default="", metavar="ARGS",
              help="Extra arguments for every llama-server, one shell-quoted string (e.g. \"-fa on\").")
@click.option("--plot", "plot_file", default=None, type=click.Path(dir_okay=False),
              help="Write a PNG of tok/s by draft depth (needs matplotlib).")
@click.option("--draft-kv", type=click.Choice(get_args(DraftKV)), default=LoadOptions.draft_kv, show_default=True,
              help="MTP cache policy for accepted drafts (see generate --help).")
@click.option("--flash-attn", "-fa", type=click.Choice(get_args(FlashAttn)), default=None,
              help="Flash attention (default: off on CPUs, where it breaks greedy identity; auto on GPUs).")
@click.option("--sampling", type=click.Choice(get_args(SamplingPath)), default=LoadOptions.sampling,
              show_default=True, help="Where temperature > 0 builds its distributions: llama.cpp's filters "
              "on the host (chain), numpy filters, or llama.cpp's filters in the decode graph (backend).")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
@draft_vocab_option
@rpc_options
def bench(model, prompts_file, max_tokens, draft_max, p_mins, temperature, top_k, top_p, min_p, seed,
          accept_rules, reps, limit, threads, n_ctx, server_binary, llama_server_args, plot_file, draft_kv,
          flash_attn, sampling, as_json, draft_vocab, rpc, tensor_split, rpc_timeout) -> None:
    """Measure no-spec against MTP settings on the same prompts, alternating.

    With --against-llama-server, a single-slot llama-server per setting (started once, on
    127.0.0.1) runs the same prompt token ids in the same rotation, for a side-by-side table.
    """
    import contextlib
    import shlex

    from tqdm import tqdm

    from .bench import Setting, check_prompts, check_settings, compare, plot_depths, read_prompts, run_bench
    from .llama_server import LlamaServerPool

    depths = sorted(set(draft_max), key=lambda k: (k == "auto", k if k != "auto" else 0)) or [1, 2, 3]
    _check_bench_options(max_tokens=max_tokens, temperature=temperature, accept_rules=accept_rules,
                         server_binary=server_binary, llama_server_args=llama_server_args, rpc=rpc,
                         tensor_split=tensor_split)
    try:
        prompts = read_prompts(prompts_file)[:limit]
    except ValueError as exc:
        raise click.ClickException(str(exc)) from exc
    if plot_file:      # checked before the runs its failure would throw away
        _check_plot_file(plot_file)
    try:
        extra_server_args = shlex.split(llama_server_args)
    except ValueError as exc:
        raise click.BadParameter(f"{exc} in {llama_server_args!r}", param_hint="'--llama-server-args'") from None
    rules = sorted(set(accept_rules)) or [DEFAULTS.accept]
    settings = [Setting("none")] + [Setting("mtp", k, p, rule) for k in depths
                                    for p in sorted(set(p_mins)) or [DEFAULTS.p_min] for rule in rules]
    filters = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    try:      # before the load (minutes, for a large model); check_settings redoes it with the model's limits
        for s in settings:
            mtp = dict(draft_max=s.draft_max, p_min=s.p_min, accept=s.accept) if s.spec == "mtp" else {}
            check_before_load(s.spec, n_ctx, max_tokens=max_tokens, seed=seed, **filters, **mtp)
    except ValueError as exc:
        raise refused(exc) from exc
    if server_binary and not os.access(server_binary, os.X_OK):
        raise click.ClickException(f"--against-llama-server {server_binary}: not an executable file; give the "
                                   "llama-server binary built from the same pinned llama.cpp")
    m = _load(model, threads, n_ctx, draft_limit=draft_limit_for(max(depths, key=lambda k: -1 if k == "auto" else k)),
              draft_kv=draft_kv, flash_attn=flash_attn, sampling=sampling, rpc=rpc, tensor_split=tensor_split,
              draft_vocab=draft_vocab, rpc_timeout=rpc_timeout)
    try:     # every bench setting but the baseline is MTP
        require_mtp(m.info, plain=None)
    except ModelFileError as exc:
        raise click.ClickException(f"bench measures MTP against plain decoding: {exc}") from None
    try:
        check_settings(m, settings, max_tokens=max_tokens, sampling=filters, seed=seed)
    except ValueError as exc:
        raise refused(exc) from exc
    try:
        check_prompts(m, prompts, max_tokens)
    except ValueError as exc:
        raise click.ClickException(f"{prompts_file}: {exc}") from exc
    n_cells = len(settings) + (len({s.key for s in settings if s.has_twin}) if server_binary else 0)
    # Both systems use the same attention kernels; --llama-server-args can still override.
    server_args = ["-fa", m.flash_attn, *extra_server_args]
    pool = LlamaServerPool(server_binary, m.path, [s.key for s in settings if s.has_twin], threads=threads, n_ctx=n_ctx,
                           n_batch=m.options.n_batch, extra_args=server_args) if server_binary else None
    try:
        with _terminated_as_exit(), pool or contextlib.nullcontext(), \
                tqdm(total=len(prompts) * n_cells * reps, desc="bench", unit="run", file=sys.stderr,
                     disable=None) as bar:
            rows = run_bench(m, prompts, settings, max_tokens=max_tokens, reps=reps, sampling=filters,
                             seed=seed, progress=bar.update, llama_server=pool)
            commands = pool.commands() if pool else None
    except (ValueError, RuntimeError) as exc:
        raise click.ClickException(str(exc)) from exc
    header = {"model": str(m.path), "prompts": len(prompts), "max_tokens": max_tokens, "reps": reps,
              "draft_kv": m.draft_kv, "row_by_row": m.row_by_row, "flash_attn": m.flash_attn,
              "sampling": m.sampling, "draft_vocab": m.options.draft_vocab, "split": m.placement.describe() if m.placement else None,
              "exactness": m.exactness, "memory": m.memory_report(),
              "threads": threads or max(1, os.cpu_count() or 2), **filters}     # what both systems were given
    no_plot = None      # the results are still printed; the exit status says the plot is missing
    if plot_file:
        try:
            plot_depths(rows, plot_file, title=f"{m.path.name}, temperature {temperature:g}")
        except ImportError as exc:      # matplotlib found, but a part of it would not load
            no_plot = f"no plot: --plot needs matplotlib (pip install matplotlib): {exc}"
        except (OSError, ValueError) as exc:
            no_plot = f"no plot written to {plot_file}: {exc}"
    with _writing_out():
        _print_bench(m, rows, header, prompts, max_tokens, reps, temperature, as_json,
                     {"llama_server": {"binary": server_binary, "commands": commands},
                      "comparison": compare(rows, greedy=temperature == 0)} if pool else None)
    if no_plot:
        raise click.ClickException(no_plot)


def _check_bench_options(*, max_tokens: int, temperature: float, accept_rules: tuple, server_binary: str | None,
                         llama_server_args: str, rpc: str | None, tensor_split: object) -> None:
    """The bench options that would measure nothing, or not what the table says, refused
    before the load: a review found each printed a table anyway."""
    if max_tokens < 2:
        raise click.BadParameter(f"bench times the tokens after the first (as llama-server does): give 2 or more, "
                                 f"got {max_tokens}", param_hint="'--max-tokens'")
    if accept_rules and temperature == 0:
        raise click.BadParameter("at temperature 0 both rules accept exactly the greedy tokens (a second row would "
                                 "time the same work); drop it, or give --temperature above 0",
                                 param_hint="'--accept'")
    if llama_server_args and not server_binary:
        raise click.BadParameter("it passes arguments to the llama-server that --against-llama-server starts; "
                                 "give that too, or drop it", param_hint="'--llama-server-args'")
    if server_binary and (rpc or tensor_split):
        raise click.BadParameter("--against-llama-server starts llama-server on this host alone, so the table would "
                                 "set a split model against an unsplit one; drop --rpc/--tensor-split, or run "
                                 "llama-server with its own --rpc by hand", param_hint="'--rpc'")


def _print_bench(m, rows: list, header: dict, prompts: list, max_tokens: int, reps: int, temperature: float,
                 as_json: bool, against: dict | None) -> None:
    """bench's results: one JSON object, or the table (and the comparison ``against``
    llama-server)."""
    from .bench import auto_against_fixed, format_comparison, format_table

    if as_json:
        click.echo(json.dumps({**header, **(against or {}), "auto_against_fixed": auto_against_fixed(rows),
                               "results": rows}, indent=2))
        return
    click.echo(f"model {m.path.name}, {len(prompts)} prompts x {max_tokens} tokens, {reps} rep(s), "
               f"temperature {temperature:g}")
    if m.placement:
        click.echo(f"layers split over {m.placement.describe()}")
    click.echo(format_table(rows))
    click.echo(f"identity: {m.exactness}")
    if against:
        click.echo("")
        click.echo(format_comparison(against["comparison"]))


from .server.cli import serve  # noqa: E402  (does not import FastAPI until the command runs)

main.add_command(serve)

if __name__ == "__main__":  # pragma: no cover
    main()
