"""Where a sequence's tokens are drawn: on the host from copied logits, or by llama.cpp's
samplers inside each context's decode graph (a backend chain per seq id, backend_sampling.py).

``Router.attach`` decides per sequence when it starts (Rounds.start) and attaches or
detaches the chains its seq id needs in the target context and the drafter's; the round
then reads whatever ``Route`` says it holds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from .backend_sampling import GRAPH_MIN_P_MAX, BackendChains, draws_in_a_fixed_order, reads_probabilities
from .config import DecodeParams
from .native import NativeContext, NativeModel
from .sampling import Sampler

if TYPE_CHECKING:
    from .drafter import MTPDrafter

# Where distributions are built: "chain" and "numpy" are sampling.py's host paths over the
# logits; "backend" runs llama.cpp's filters in the decode graph and reads back only the
# candidates and their probabilities (benchmarks/sampling_cost.py compares them).
SAMPLING_PATHS = ("auto", "chain", "numpy", "backend")
# "auto" is "chain", but a plain (no-spec) run on a GPU at a vocabulary this large samples in
# the graph: the host then reads one token id per round, not a row of logits. H100, demo
# model, T=0.7, tok/s chain -> backend: at 248,320 tokens 1153 -> 1421, 1230 -> 1419,
# 1305 -> 1468 (1293 -> 1169 once); at 8,192 1799 -> 1744, 1873 -> 1750 (the graph's
# filters cost more than the host's); drafting runs were slower in the graph at both sizes.
# That was with the CUDA 13.0 toolkit's CCCL, whose in-graph top_k sorts the whole row. Built
# against CCCL >= 3.2 headers (vendor/llama.cpp/README.md) drafting runs are faster in the
# graph (H100, small Q8_0 at 248k, k=3: 1018-1054 tok/s against 784-965 on the host), but
# nothing in the C API says which headers a build had: such builds pass sampling="backend".
GRAPH_PLAIN_VOCAB = 65536


def samples_in_graph(sampling: str, offloaded: bool, n_vocab: int, drafts: bool, greedy: bool = False) -> bool:
    """Whether a sequence takes a backend chain (where it can): llama.cpp's filters and
    dist at temperature > 0, its greedy sampler (the argmax in the graph) at 0.

    "auto" takes the graph's argmax where the plain draw goes there, drafting or not: the
    host then reads one token id a row, not a row of logits. H100, demo model at 248,320
    tokens, two runs, tok/s host -> graph: no-spec 1384 -> 1436, 1168 -> 1565; k=3
    1088 -> 1199, 1190 -> 1377. At 8,192 the runs disagree (no-spec 2068 -> 1771,
    1959 -> 2035). On the CPU ggml's argmax is slower than numpy's (tiny f16 at 248k,
    two threads, two runs each, tok/s host / graph: no-spec 106.8, 106.3 / 94.8, 98.8;
    k=3 79.5, 75.2 / 66.9, 69.2)."""
    if sampling == "auto":
        return offloaded and (greedy or not drafts) and n_vocab >= GRAPH_PLAIN_VOCAB
    return sampling == "backend"


class Route(NamedTuple):
    """What ``Router.attach`` attached for one sequence."""
    target: bool        # the target's p (or token) comes from its chain
    drafter: bool       # the drafter's q (or argmax draft) comes from its chain
    # kept off the graph only for its company: alone, its plain draws would be the host's
    # from the graph's rows (backend_sampling.plain_token)
    off_graph: bool


class Router:
    """Where each sequence of one Rounds samples: holds what stays fixed for its life (the
    chains, the model, both contexts and the sampling path asked for), so a sequence's start
    passes only what is its own."""

    def __init__(self, chains: BackendChains, model: NativeModel, target: NativeContext,
                 drafter: MTPDrafter | None, sampling: str) -> None:
        self.chains, self.model, self.target, self.drafter = chains, model, target, drafter
        self.sampling = sampling

    def attach(self, seq: int, sampler: Sampler, draft_sampler: Sampler, p: DecodeParams,
               spec: bool, constrained: bool) -> Route:
        """Attach or detach the backend chains ``seq`` needs in both contexts.

        The drafter samples from its own chain where acceptance reads q (rejection sampling);
        argmax drafts (greedy, or the exact-match rule at any temperature) come from its
        graph's greedy sampler, unless p_min reads the head's top probability, which needs the
        logits. Each seq id has its own chain, so one batch may mix sequences sampled on the
        backend, on the host and greedy. A constrained sequence samples on the host: llama.cpp's
        grammar sampler has no backend (in-graph) implementation, so the mask must see the
        logits; nor has its infill sampler. So does one with penalties: each verify row's
        penalties see their own history, which llama.cpp's backend penalties cannot take. A
        logit bias runs in the graph, first in the chain (llama.cpp's logit_bias has a backend
        implementation), except in a drafter over a draft vocabulary, whose rows speak other
        ids: there the host widens them first. In a context of several sequences only the drawn
        tokens are read from the graph: its probabilities can be overwritten there
        (``reads_probabilities`` says how), so a sequence that would read them samples on the
        host."""
        chains, model, target, drafter = self.chains, self.model, self.target, self.drafter
        greedy = sampler.is_greedy
        n_vocab = model.n_vocab
        alone = (samples_in_graph(self.sampling, model.offloaded, n_vocab, spec, greedy)
                 and sampler.lookback == 0
                 and sampler.min_p <= GRAPH_MIN_P_MAX      # past it the graph's min_p keeps nothing
                 and not constrained
                 and not p.infill          # llama.cpp's infill sampler has no in-graph implementation
                 and p.logprobs is None and p.prompt_logprobs is None)    # logprobs read the logits
        wanted = alone and not (target.n_seq_max > 1 and reads_probabilities(sampler, spec, p.accept))
        # the chain's own draw (rounds without drafts) follows the request's seed (a child of
        # it: the host's rng is not drawn from, so its stream does not hang on the path); an
        # unseeded one keeps the chain its seq id holds (no new graph reservation)
        seed = sampler.draw_seed if wanted and not greedy else 0
        on_target = chains.set(target, seq, sampler if wanted else None, seed, n_vocab=n_vocab)
        on_drafter = False
        if drafter is not None:
            reads_q = not greedy and p.accept != "exact"
            argmax = not reads_q and p.p_min == 0.0
            vocab = drafter.vocab
            # a draft vocabulary's rows hold its ids: a bias speaks the model's (the host widens
            # the rows first), and a top_k past the row aborts llama.cpp's graph
            narrow = vocab is not None and (draft_sampler.logit_bias is not None
                                            or (not argmax and draft_sampler.top_k >= len(vocab.ids)))
            on_drafter = chains.set(drafter.ctx, seq,
                                    draft_sampler if on_target and spec and (reads_q or argmax) and not narrow
                                    else None, argmax=argmax, n_vocab=n_vocab)
        return Route(on_target, on_drafter, alone and not wanted and not draws_in_a_fixed_order(sampler))
