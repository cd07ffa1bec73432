"""Backend sampling: llama.cpp's filters run inside a context's decode graph, one chain
per seq id, and only the kept candidates and their probabilities leave the device, and
the token the chain's dist drew (what a round without drafts takes: one int, no host work,
where that draw does not hang on the order top_k left the candidates in: ``plain_token``).

The engine decides which sequences sample here (sampling_route.Router); this
module attaches and frees the chains and reads a sequence's verify rows back.
"""

from __future__ import annotations

from .native import NativeContext
from .native_samplers import SamplerChain
from .sampling import Dist, Sampler, draw, filter_chain, sampled_dist


# llama.cpp's in-graph min_p keeps a token where logit - (max logit + log min_p) > 0 in
# float32: where log min_p vanishes next to the largest logit (min_p 1.0, and 0.9999999
# measured on the demo model) it keeps none, not even the top one, and the chain's draw
# then took the vocabulary's last id. Above this a request samples on the host, whose
# min_p keeps the top token (log min_p is at most -1e-3 below it: far past float32's
# resolution at any logit a model writes).
GRAPH_MIN_P_MAX = 0.999


def draws_in_a_fixed_order(sampler: Sampler) -> bool:
    """Whether the chain's own draw gives the same token for the same seed on every run.

    The draw walks the kept candidates in the order the graph left them. ggml's top_k
    promises no order (its CPU kernel swaps the first two on purpose); CUB's DeviceTopK,
    which CUDA builds use from CCCL 3.2 on, returns them in an order that changes from run
    to run. A top_p after it sorts them by logit again, and with no top_k the candidates
    are the vocabulary in id order; top_k with no top_p leaves the order to the kernel.
    The greedy chain draws nothing: its token is the row's argmax."""
    return sampler.is_greedy or sampler.top_k <= 0 or sampler.top_p < 1.0


def reads_probabilities(sampler: Sampler, spec: bool, accept: str) -> bool:
    """Whether a sequence would read its chain's probabilities (not only drawn tokens):
    rejection sampling reads p at every verify row, and a draw that hangs on the order of
    the candidates (``draws_in_a_fixed_order``) is made on the host from them.

    In a context of several sequences such a read can be wrong. llama.cpp applies every
    attached chain in every graph, the chains of sequences with no rows in it on a dummy
    row and left out of the computation (``build_sampling``, src/llama-graph.cpp); two
    graphs with as many nodes, differing only in which chain is computed, then share one
    memory plan (ggml-alloc reuses a plan whenever the node counts and sizes fit), and a
    later node overwrites the last row's probabilities. Measured on the pinned CPU build,
    the demo model, chains on seq ids 1 and 3 (top_k 20, top_p 0.8, T=0.7) and four rows
    each: decoded in turn, or in one batch that llama.cpp splits in two, seq 3's last row
    summed to 0.087 (its logits read 1.0 throughout); under the batcher a k=3 rejection
    round crashed on a row of zeros, and 1 of 8 batched requests parted from its solo run.
    An H200's CUDA build overwrote the last row at 1, 3, 4, 5 and 6 rows (sums 0.09-0.78;
    benchmarks/chain_overwrite.py). The drawn tokens lay in their raw rows' top 20, and the
    greedy ones were their argmax, in every case checked, on both builds."""
    return not sampler.is_greedy and ((spec and accept != "exact") or not draws_in_a_fixed_order(sampler))


def plain_token(ctx: NativeContext, row: int, sampler: Sampler, chain: SamplerChain | None) -> int:
    """The token of batch row ``row`` where no draft is judged against it: the chain's own
    draw (one int back), or where that draw depends on the order of the candidates
    (``draws_in_a_fixed_order``), ``sampler``'s draw from the row's distribution, whose
    ids are sorted.

    ``chain`` (the one attached to the row's sequence; None only where nothing was
    attached, as in hand-made rows) commits the draw it read. In a context whose
    sequences may output several rows a decode (``n_outputs_max_per_seq`` above 1: every
    verify context) llama.cpp's dist is transactional: each decode draws
    its uniforms afresh from the state the last committed draw left, and only
    ``llama_sampler_accept`` commits one. Uncommitted, every decode reuses the same
    uniforms: one row decoded 200 times drew 1 distinct token of 40 candidates
    (tests/test_stochastic.py). Rows are read, and committed, in order; a row never read
    leaves its uniform unseen for the next decode."""
    if not draws_in_a_fixed_order(sampler):
        return draw(sampled_dist(ctx, row), sampler.rng)
    token = ctx.sampled_token(row)
    if chain is not None:
        chain.accept(token)
    return token


class SampledDists:
    """One sequence's target distributions of its verify rows, read from the backend
    sampler chain attached to its seq id; its rows start at batch row ``first_row``."""

    def __init__(self, ctx: NativeContext, first_row: int, n_rows: int) -> None:
        self.ctx, self.first_row, self.n_rows = ctx, first_row, n_rows
        self.cache: dict[int, Dist] = {}

    def __len__(self) -> int:
        return self.n_rows

    def __getitem__(self, i: int) -> Dist:
        d = self.cache.get(i)
        if d is None:
            d = self.cache[i] = sampled_dist(self.ctx, self.first_row + i)
        return d


def _key(sampler: Sampler, seed: int | None, argmax: bool) -> tuple:
    """What decides a chain: its filters (or greedy), its bias, its draw's seed (None:
    fresh entropy at every reset, so an unseeded request keeps the chain it finds)."""
    greedy = sampler.is_greedy or argmax
    filters = ("greedy",) if greedy else (sampler.top_k, sampler.top_p, sampler.min_p, sampler.temperature)
    bias = sampler.logit_bias
    return filters, None if bias is None else (bias.ids.tobytes(), bias.values.tobytes()), 0 if greedy else seed


def _chain(filters: tuple, bias, n_vocab: int | None, seed: int | None) -> SamplerChain:
    if filters != ("greedy",):
        return filter_chain(*filters, bias, n_vocab).add_dist(seed)
    chain = SamplerChain()
    if bias is not None:
        chain.add_logit_bias(n_vocab, bias.ids, bias.values)
    return chain.add_greedy()


class BackendChains:
    """The llama.cpp chains (the sampler's filters, then dist) attached to contexts, one
    per seq id, for backend sampling; a seq id keeps its chain while the sequences under
    it ask for the same filters.

    llama.cpp runs an attached chain on the output rows of its own seq id only, so the
    sequences of one batch may each have their own filters, or none (those get logits).
    It initialises a chain for the graph once, so every attach takes a fresh one; a
    context does not own its chains, so a chain is freed only once detached. Penalties
    need each verify row's own history, which llama.cpp's backend penalties cannot take
    (they refuse more than one output per sequence): such runs detach. A greedy run takes
    llama.cpp's greedy sampler, the row's argmax in the graph (ggml's picks the first
    maximum on the CPU; CUDA's kernel may pick another id among equal maxima).
    """

    def __init__(self) -> None:
        # (id(ctx), seq) -> (key, chain)
        self.attached: dict[tuple[int, int], tuple[tuple, SamplerChain]] = {}
        # (id(ctx), filters, biased) -> sampler names: a context that could not run a chain
        # whole (the drafter's head may sit on another device than the target) refuses it
        # for itself only, whatever the seed or the bias's values
        self.refused: dict[tuple, list[str]] = {}

    def set(self, ctx: NativeContext, seq: int, sampler: Sampler | None, seed: int | None = 0,
            argmax: bool = False, n_vocab: int | None = None) -> bool:
        """Attach the chain for ``sampler``'s filters to ``seq`` (None detaches); False when
        this sequence runs on the host instead (detached, or llama.cpp cannot offload the
        chain). ``seed`` seeds the chain's own draw (``NativeContext.sampled_token``), which
        a round without drafts takes; a new seed attaches a new chain, the same one restarts
        the kept chain's draws, and None (an unseeded request) keeps a chain drawing from
        fresh entropy, reseeded by the restart. Attaching costs the context a new graph
        reservation at its next decode (llama_context::set_sampler), for every sequence in
        that decode: ~6 ms on 2 CPU threads for the demo model, 15-20 ms a request on an
        H200 (benchmarks/attach_cost.py). ``argmax`` attaches the greedy chain whatever the
        temperature (a drafter's argmax drafts). A logit bias goes first in either chain,
        as on the host; ``n_vocab`` is then the width of ``ctx``'s rows."""
        key = None if sampler is None else _key(sampler, seed, argmax)
        slot = (id(ctx), seq)
        now = self.attached.get(slot)
        if now is not None and now[0] == key:
            now[1].reset()      # its committed draws start over, as a fresh chain's would
            return True
        if now is not None:
            ctx.set_sampler(seq, None)
            now[1].close()
            del self.attached[slot]
        refusal = None if key is None else (id(ctx), key[0], key[1] is not None)
        if key is None or refusal in self.refused:
            return False
        chain = _chain(key[0], sampler.logit_bias, n_vocab, seed)
        # "+name": the sampler runs in the graph; "?name": llama.cpp's empty sampler, which
        # stands for a filter at its neutral value (temp 1.0) and does nothing anywhere;
        # anything else would leave filters undone. (A temperature of 1.0, OpenAI's
        # default, was refused here until the "?" was read as what it is.)
        if not ctx.set_sampler(seq, chain) or not all(n.startswith(("+", "?")) for n in chain.names()):
            self.refused[refusal] = chain.names()
            ctx.set_sampler(seq, None)
            chain.close()
            return False
        self.attached[slot] = (key, chain)
        return True

    def chain(self, ctx: NativeContext, seq: int) -> SamplerChain | None:
        """The chain attached to ``seq`` in ``ctx``, if any."""
        now = self.attached.get((id(ctx), seq))
        return None if now is None else now[1]

    def close(self) -> None:
        """Free the chains; call after closing the contexts they were attached to."""
        for _, chain in self.attached.values():
            chain.close()
        self.attached.clear()
