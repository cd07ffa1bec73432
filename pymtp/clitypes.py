"""Click parameter types shared by ``pymtp`` and ``pymtp serve`` (no FastAPI, no llama.cpp)."""

from __future__ import annotations

import contextlib
import math
import os
import re
import sys

import click

from .config import (DEFAULT_RPC_TIMEOUT, DEFAULTS, N_CTX_MIN, DecodeParams, LoadOptions, ParamError, added_bias,
                     in_bias_range, parse_draft_max)
from .load_checks import check_verify_room


# -h as llama.cpp's tools take it; on each command too, as click keeps a command's help
# option from the first context it made (serve run alone, by a test, left it --help only)
HELP = {"help_option_names": ["-h", "--help"]}


class OutputErrors:
    """A command whose own output fails to write (a full disk, a closed device behind
    standard output, ``--help > /dev/full``) says so in one line and exits 1; it was a
    traceback. Output the command writes while it runs is its own to guard (cli._writing_out)."""

    def main(self, *args, **kwargs):
        try:
            return super().main(*args, **kwargs)
        except OSError as exc:
            if not _raised_by_echo(exc):
                raise
            with contextlib.suppress(OSError):
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())   # the exit's flush fails again
            click.echo(f"Error: could not write to standard output: {exc.strerror or exc}", err=True)
            raise SystemExit(1) from None


def _raised_by_echo(exc: BaseException) -> bool:
    """Whether click.echo's own write or flush raised ``exc`` (not code that it called)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and tb.tb_frame.f_code is click.utils.echo.__code__


class DraftMaxParam(click.ParamType):
    """--draft-max: an integer, or "auto" (the depth policy picks k, pymtp/depth.py)."""

    name = "INTEGER|auto"

    def convert(self, value, param, ctx):
        if isinstance(value, str) and value.strip().lower() == "auto":     # --help prints it upper-case
            return "auto"
        try:
            return parse_draft_max(value)
        except ParamError as exc:
            self.fail(str(exc), param, ctx)


DRAFT_MAX = DraftMaxParam()


class LogitBiasParam(click.ParamType):
    """--logit-bias: llama.cpp's TOKEN_ID(+/-)BIAS, e.g. 15043+1 or 15043-inf (a ban)."""

    name = "ID(+/-)BIAS"

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        m = re.fullmatch(r"\s*(\d+)\s*([+-])\s*(inf|\d+(?:\.\d*)?(?:[eE][+-]?\d+)?)\s*", str(value))
        if m is None:
            self.fail(f"{value!r} is not TOKEN_ID+BIAS or TOKEN_ID-BIAS (e.g. 15043+1, or 15043-inf to ban it)",
                      param, ctx)
        bias = float(m.group(3))
        bias = -bias if m.group(2) == "-" else bias
        if not in_bias_range(bias):
            self.fail(f"{value!r}: a bias must be in [-100, 100], or -inf to ban the token", param, ctx)
        return int(m.group(1)), bias


LOGIT_BIAS = LogitBiasParam()


def logit_bias_of(pairs) -> dict[int, float] | None:
    """Repeated --logit-bias options as one mapping; a token named twice gets both, within
    the range each is checked against (config.added_bias)."""
    out: dict[int, float] = {}
    for token, bias in pairs or ():
        out[token] = added_bias(out.get(token, 0.0), bias)
    return out or None


class CtxSizeParam(click.ParamType):
    """--ctx-size: at least 16 tokens, or 0 for the length the model was trained for (as llama.cpp's -c 0)."""

    name = "integer"

    def convert(self, value, param, ctx):
        n = click.INT.convert(value, param, ctx)
        if n != 0 and n < N_CTX_MIN:
            self.fail(f"{n} is too small: give {N_CTX_MIN} tokens or more, or 0 for the length the model was "
                      "trained for",
                      param, ctx)
        return n


CTX_SIZE = CtxSizeParam()
CTX_SIZE_HELP = ("llama.cpp rounds a context up to a multiple of 256 tokens, so a smaller -c holds more; "
                 "0: the length the model was trained for, as llama.cpp's -c 0.")


class EnginesParam(click.ParamType):
    """--engines: a count >= 1, or "auto" (pymtp/server/batching.py's default_engines)."""

    name = "N|auto"

    def convert(self, value, param, ctx):
        if value == "auto" or isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            return value
        try:
            n = int(value)
        except (TypeError, ValueError):
            n = 0
        if n < 1 or str(n) != str(value).strip():
            self.fail(f"{value!r} is neither a count of engines >= 1 nor 'auto'", param, ctx)
        return n


ENGINES = EnginesParam()


class TensorSplitParam(click.ParamType):
    """--tensor-split: comma-separated shares, e.g. 1,1,2 (this host first, then each worker)."""

    name = "SHARES"

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        try:
            shares = tuple(float(v) for v in value.split(","))
        except ValueError:
            self.fail(f"{value!r} is not comma-separated numbers (e.g. 1,1,2)", param, ctx)
        from .rpc import shares_ok

        if not shares_ok(shares):
            self.fail(f"{value!r}: shares must be finite numbers >= 0 with a positive sum", param, ctx)
        return shares


class FiniteRange(click.FloatRange):
    """A FloatRange that also refuses nan and inf: click's lets nan through every bound
    (``--body-timeout nan`` answered every slow body with 408 at once)."""

    def convert(self, value, param, ctx):
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return number


class CacheMiB(FiniteRange):
    """--cache-ram's MiB, 0 for off. llama-server's -1 (no limit) is refused saying so:
    snapshots kept without a bound would fill the host's memory."""

    def __init__(self) -> None:
        super().__init__(min=0)

    def convert(self, value, param, ctx):
        try:
            return super().convert(value, param, ctx)
        except click.BadParameter:
            if str(value).strip() in ("-1", "-1.0"):
                self.fail("-1 (llama-server's no limit) is not taken: give the MiB of snapshots to keep, "
                          "or 0 to turn the prompt cache off", param, ctx)
            raise


def check_rpc(rpc: str | None, tensor_split) -> None:
    """--tensor-split shares the layers with --rpc workers: alone it is a usage error,
    said before the model loads."""
    if tensor_split is not None and not rpc:
        raise click.UsageError("--tensor-split shares the layers between this host and --rpc workers: add "
                               "--rpc HOST:PORT[,HOST:PORT...], or leave --tensor-split out")
    if not rpc and given("rpc_timeout"):
        raise click.UsageError("--rpc-timeout bounds the calls that reach --rpc workers: add "
                               "--rpc HOST:PORT[,HOST:PORT...], or leave --rpc-timeout out")


def rpc_options(command):
    """--rpc, --tensor-split and --rpc-timeout, shared by generate, bench and serve."""
    command = click.option(
        "--rpc-timeout", "rpc_timeout", default=DEFAULT_RPC_TIMEOUT, show_default=True,
        type=FiniteRange(min=0, min_open=True), metavar="SECONDS",
        help="With --rpc: how long one llama.cpp call may wait on a worker before the worker counts "
             "as lost (a host gone without closing its socket is otherwise waited on for good; the "
             "server then fails over to this host). The load waits this plus the file's size at "
             "10 MiB/s.")(command)
    command = click.option(
        "--tensor-split", "-ts", "tensor_split", default=None, type=TensorSplitParam(),
        help="With --rpc: the share of the layers for this host (its GPUs, or its CPU) and then "
             "each worker device, e.g. 1,1,1 (default: by free memory).")(command)
    return click.option(
        "--rpc", "rpc", default=None, metavar="HOST:PORT[,HOST:PORT...]",
        help="llama.cpp rpc-server workers that hold a share of the layers (needs a build with "
             "CMAKE_ARGS=\"-DGGML_RPC=on\"; rpc-server has no authentication: private networks only).")(command)


def draft_vocab_option(command):
    """--draft-vocab, shared by generate, bench and serve."""
    return click.option(
        "--draft-vocab", "draft_vocab", default=None, type=click.IntRange(min=1), metavar="N",
        help="The MTP head drafts over the first N token ids (and the control tokens after them) "
             "instead of the whole vocabulary: a cheaper draft step at a large vocabulary, the same "
             "output. Made once per model into pymtp's cache [default: the whole vocabulary].")(command)


# (flags, parameter, type, help): llama.cpp's names, so that a model card's flags work
# (Qwen's: --temp 0.7 --top-k 20 --top-p 0.8 --min-p 0)
_SAMPLING = (
    (("--temperature", "--temp"), "temperature", float, "0 = greedy."),
    (("--top-k",), "top_k", int, "0 = off."),
    (("--top-p",), "top_p", float, "1.0 = off."),
    (("--min-p",), "min_p", float, "0.0 = off."),
    (("--repeat-penalty",), "repeat_penalty", float, "Divide the logits of recent tokens by this (1.0 = off)."),
    (("--frequency-penalty",), "frequency_penalty", float,
     "Lower recent tokens' logits by this per occurrence (0.0 = off)."),
    (("--presence-penalty",), "presence_penalty", float, "Lower recent tokens' logits by this once (0.0 = off)."),
    (("--repeat-last-n",), "repeat_last_n", int,
     "How many recent tokens (prompt included) the penalties look at; -1 = all, 0 = off."),
)


# llama-server/llama-cli flags pymtp has no option for, and what to do instead. Checked
# before click parses: it split an unknown -ngl into -n gl ("'gl' is not a valid integer").
_GRAFT_HINT = ("pymtp drafts with the model's own MTP block: put a separate one into the model first "
               "(gguf_graft BASE.gguf MTP.gguf -o OUT.gguf)")
_DOWNLOAD_HINT = "pymtp takes a local GGUF: download it first (huggingface-cli download REPO FILE.gguf)"
_TEMPLATE_HINT = "pymtp renders the GGUF's own chat template (ChatML where it has none)"
_TLS_HINT = "pymtp serves plain HTTP: put a TLS proxy in front of it"
LLAMA_FLAGS = {
    "-m": "MODEL is positional: pymtp COMMAND MODEL.gguf",
    "--model": "MODEL is positional: pymtp COMMAND MODEL.gguf",
    "-ngl": "pymtp puts every layer on the GPU of a CUDA or Metal build (CPU otherwise): leave -ngl out",
    "--n-gpu-layers": "pymtp puts every layer on the GPU of a CUDA or Metal build (CPU otherwise): leave it out",
    "--gpu-layers": "pymtp puts every layer on the GPU of a CUDA or Metal build (CPU otherwise): leave it out",
    "-hf": _DOWNLOAD_HINT,
    "--hf-repo": _DOWNLOAD_HINT,
    "-hff": _DOWNLOAD_HINT,
    "--hf-file": _DOWNLOAD_HINT,
    "-mu": _DOWNLOAD_HINT,
    "--model-url": _DOWNLOAD_HINT,
    "--n-predict": "use --max-tokens / -n",
    "--predict": "use --max-tokens / -n",
    "-md": _GRAFT_HINT,
    "--model-draft": _GRAFT_HINT,
    "--spec-draft-model": _GRAFT_HINT,
    "-cb": "pymtp decodes one prompt at a time here: leave it out",
    "--cont-batching": "pymtp decodes one prompt at a time here: leave it out",
}
# ... and where the command changes what to do instead (the server has no --max-tokens,
# generate and bench no --parallel)
LLAMA_FLAGS_OF = {"serve": {
    "--n-predict": "each request's max_tokens (n_predict) bounds its reply; the server has no default of its own",
    "-n": "each request's max_tokens (n_predict) bounds its reply; the server has no default of its own",
    "--predict": "each request's max_tokens (n_predict) bounds its reply; the server has no default of its own",
    "-cb": "batching is always on: --parallel sets the slots",
    "--cont-batching": "batching is always on: --parallel sets the slots",
    "--chat-template": _TEMPLATE_HINT,
    "--chat-template-file": _TEMPLATE_HINT,
    "--ssl-key-file": _TLS_HINT,
    "--ssl-cert-file": _TLS_HINT,
    "--api-prefix": "pymtp serves its routes at the root: map the prefix in a proxy",
}}
# llama.cpp's short flags of two letters or more (every tool's, in common/arg.cpp at the pin).
# Click reads one whose first letter is a short option of ours as that option and its value:
# -ts 1,1 was "--threads: 's' is not a valid integer", -md "No such option '-m'".
LLAMA_SHORT_FLAGS = frozenset(
    "-ag -bf -bs -Cb -cb -Cbd -Cd -cl -cmoe -cmoed -cms -cnv -co -Cr -cram -Crb -Crbd -Crd -ctk -ctkd -ctv "
    "-ctvd -ctxcp -decay-epochs -dev -devd -dr -dt -epochs -fa -fit -fitc -fitp -fitt -gan -gaw -hf -hfd -hff "
    "-hfr -hfrd -hft -if -jf -kvo -kvu -lcd -lcs -lm -lr -lr-min -lv -lzm -md -mg -mli -mm -mmdev -mmu -mu "
    "-ncffn -ncmoe -ncmoed -ngl -ngld -nkvo -nocb -np -npl -npp -nr -ns -ntg -ofreq -opt -ot -otd -pps -ptc "
    "-rea -sm -sp -sps -st -sys -sysf -tb -tbd -td -tgs -to -ts -ub -val-split -wd".split())


# MODEL: a folder passes, for the library to say what to pass instead (click said only "is a directory")
model_arg = click.argument("model", required=False, type=click.Path())


class LlamaFlags(click.Command):
    """A command that answers a llama.cpp flag it lacks with what to do instead."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        own = {name for p in self.params for name in (*p.opts, *p.secondary_opts)}
        # options whose next argument is their value (``-p -m`` is a prompt, not a flag)
        valued = {name for p in self.params if isinstance(p, click.Option) and not p.is_flag and not p.count
                  for name in p.opts}
        value_next = False
        for arg in args:
            if value_next:
                value_next = False
                continue
            if arg == "--":
                break
            flag, eq, _ = arg.partition("=")
            if flag in own:
                value_next = flag in valued and not eq
            elif flag in (hints := {**LLAMA_FLAGS, **LLAMA_FLAGS_OF.get(ctx.info_name, {})}):
                raise click.UsageError(f"no such option {flag} (a llama.cpp flag): {hints[flag]}", ctx)
            elif flag in LLAMA_SHORT_FLAGS:
                raise click.UsageError(f"no such option {flag} (a llama.cpp flag pymtp {ctx.info_name} does not "
                                       f"take): pymtp {ctx.info_name} --help lists its options", ctx)
        return super().parse_args(ctx, args)


def sampling_options(command):
    """The sampling options shared by generate and serve (where they are the defaults of
    requests that leave a field out), and --seed."""
    command = click.option("--seed", "-s", default=DEFAULTS.seed, type=int, callback=_fresh_seed,
                           help="Seed for sampling (temperature > 0); -1: a fresh one, as llama.cpp's.")(command)
    for flags, name, kind, text in reversed(_SAMPLING):
        command = click.option(*flags, name, default=getattr(DEFAULTS, name), show_default=True, type=kind,
                               help=text)(command)
    return command


def _fresh_seed(ctx, param, value: int | None) -> int | None:
    """llama.cpp's -1 (draw a seed) is pymtp's None."""
    if value is not None and value < -1:
        raise click.BadParameter(f"a seed is an integer >= 0, or -1 for a fresh one; got {value}")
    return None if value == -1 else value


def check_before_load(spec: str | None, n_ctx: int = 0, **fields) -> None:
    """Raise ``ParamError`` for a generation option that is wrong whatever the model, before
    the model loads (minutes, for a large one). What depends on the model (its MTP block,
    its snapshot limit, its vocabulary) is checked again once it has loaded."""
    depth = fields.get("draft_max")
    counted = isinstance(depth, int) and not isinstance(depth, bool)
    # a depth is for MTP, whichever the model turns out to have: -k 0 was refused only once
    # it had loaded; without a depth, none is the lenient reading
    decode = DecodeParams(spec=spec or ("mtp" if counted else "none"), **fields)
    decode.validate(draft_limit=depth if counted and depth > 0 else 1)
    if counted:       # said as draft_max: the load's n_batch is an option the CLI has not
        check_verify_room(LoadOptions().n_batch, n_ctx, depth, name="draft_max")


def resolve_spec(requested: str | None, has_mtp: bool, depth_given: bool = False) -> tuple[str, str | None]:
    """MTP by default when the model has it; plain decoding, with a note, when it has not.

    An explicit ``--spec mtp``, or a ``--draft-max`` given (a depth is for MTP), on a model
    without the block stays an error (raised by the caller), so a user who asked for MTP is
    never silently served without it: the Python API's rule (session.decode_params, a request that
    names spec or draft_max).
    """
    if requested is not None:
        return requested, None
    if has_mtp or depth_given:
        return "mtp", None
    return "none", ("the model has no MTP block, so requests decode plainly (spec=none); "
                    "add one with `gguf_graft MODEL.gguf MTP_SOURCE -o MODEL-mtp.gguf`")


def given(name: str) -> bool:
    """Whether the running command's option ``name`` came from the command line or the
    environment rather than its default."""
    from click.core import ParameterSource
    source = click.get_current_context().get_parameter_source(name)
    return source in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)
