"""Step 3 of a round (rounds.py): which rule judges a sequence's drafts, on what.

The rules themselves are pure (acceptance.py); this picks one per round and feeds it: the
graph's draws or its sampled distributions where the sequence samples in the graph
(backend_sampling.py), llama.cpp's draws from a C sampler chain where only tokens are read,
or distributions built on the host from the verify logits (sampling.py), row by row as the
rule reads them. A row without drafts has its token drawn the same ways (``draw``).
"""

from __future__ import annotations

import numpy as np

from .acceptance import Verdict, exact_match_accept, exact_match_draws, greedy_accept, rejection_accept
from .backend_sampling import BackendChains, SampledDists, plain_token
from .constraint import GrammarPath
from .native import NativeContext, NativeModel
from .round_state import SeqState
from .sampling import Dist, History, Sampler


class _LazyDists:
    """Target distributions of the verify rows, computed only for the rows acceptance reads.

    Row i predicts the token after d_i, so its penalties see the history and d_1..d_i.
    Building every row at once (sharing the numpy work around llama.cpp's filter calls)
    measured slower: it saves ~10 us per 4 rows at 8,192 tokens, and a rejection at the
    first draft, common, then leaves 2-3 rows unread (~20 us each).
    """

    def __init__(self, sampler: Sampler, logits: np.ndarray, history: History, drafts: np.ndarray,
                 path: GrammarPath | None = None) -> None:
        self.sampler, self.logits, self.history, self.drafts = sampler, logits, history, drafts
        self.path = path     # row i is masked by the grammar state after d_1..d_i
        self.cache: dict[int, Dist] = {}

    def __len__(self) -> int:
        return len(self.logits)

    def __getitem__(self, i: int) -> Dist:
        d = self.cache.get(i)
        if d is None:
            d = self.cache[i] = self.sampler.dist(self.logits[i], self.history.recent(self.drafts[:i]),
                                                  None if self.path is None else self.path.at(i))
        return d


class Judge:
    """The accept step of one target context's rounds, and the draw of a row without drafts."""

    def __init__(self, model: NativeModel, target: NativeContext, chains: BackendChains) -> None:
        self.model, self.target, self.chains = model, target, chains

    def draw(self, s: SeqState, row: int, logits: np.ndarray | None = None) -> int:
        """The token of batch row ``row`` where no draft is judged against it: the graph's,
        llama.cpp's draw from the row, or the host's from ``logits`` (read from the target
        when None)."""
        if s.sampled:
            return plain_token(self.target, row, s.sampler, self.chains.chain(self.target, s.seq))
        if s.sampler.draws_natively(self.model.n_vocab, s.grammar is not None):
            return self.target.sample(s.sampler.draw_chain, row)
        if logits is None:
            logits = self.target.logits(row + 1)[row]
        recent = s.history.recent()
        if s.sampler.is_greedy:
            return s.sampler.argmax(logits, recent, s.grammar)
        return s.sampler.sample(s.sampler.dist(logits, recent, s.grammar))

    def verdict(self, s: SeqState) -> Verdict:
        """Which drafts the target keeps, and the recovered or bonus token (acceptance.py).
        An unconstrained plain row has no draft to judge: its token is drawn as the
        prompt's last row's is (``draw``)."""
        rnd, sampler, history, rule = s.rnd, s.sampler, s.history, s.params.accept
        path = rnd.path
        if not rnd.n_drafts and path is None:
            return Verdict(0, self.draw(s, rnd.first_row, None if rnd.sampled else rnd.logits[0]), "bonus")
        if rnd.sampled and sampler.is_greedy:      # the graph's argmax of each row: one int each
            return greedy_accept(rnd.drafts, [self.target.sampled_token(rnd.first_row + i)
                                              for i in range(rnd.n_drafts + 1)])
        if sampler.is_greedy and sampler.lookback == 0 and path is None:     # a bias at most: all rows at once
            return greedy_accept(rnd.drafts, sampler.argmaxes(rnd.logits))
        if sampler.is_greedy:      # penalties and a grammar move the argmax, row by row
            return greedy_accept(rnd.drafts, [sampler.argmax(row, history.recent(rnd.drafts[:i]),
                                                             None if path is None else path.at(i))
                                              for i, row in enumerate(rnd.logits)])
        if rule == "exact" and rnd.sampled:
            # only tokens are read: each row's token is the one its chain drew in the graph
            chain = self.chains.chain(self.target, s.seq)
            return exact_match_draws(rnd.drafts, lambda i: plain_token(self.target, rnd.first_row + i, sampler, chain))
        if rule == "exact" and sampler.draws_natively(self.model.n_vocab, path is not None):
            # only tokens are read: llama.cpp draws each row, no distribution is built
            return exact_match_draws(rnd.drafts, lambda i: self.target.sample(sampler.draw_chain,
                                                                              rnd.first_row + i))
        target_dists = (SampledDists(self.target, rnd.first_row, rnd.n_drafts + 1) if rnd.sampled
                        else _LazyDists(sampler, rnd.logits, history, rnd.drafts, path))
        if rule == "exact" or not rnd.n_drafts:
            return exact_match_accept(rnd.drafts, target_dists, sampler.rng)
        return rejection_accept(rnd.drafts, rnd.draft_dists, target_dists, sampler.rng)
