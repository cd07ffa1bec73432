"""The MTP drafter: feeds (target hidden state, token) pairs to the MTP context and chains drafts.

Invariant (docs/design.md, "The MTP cache"): the MTP KV at position q holds the pair
(h_{q-1}, x_q), where h_{q-1} is the *target's* hidden row at q-1. Rows built from the MTP's own hidden state
(draft steps 1..k-1) live only until the next ``propose``, which drops them first. So a
rejected draft never has to be re-decoded: the next round decodes only the accepted rows,
fused with its own first draft step into one MTP decode.

Nothing about acceptance lives here.
"""

from __future__ import annotations

import numpy as np

from .native import Batch, ContextConfig, NativeContext, NativeModel
from .sampling import Dist, Sampler, sampled_dist


ROW_BY_ROW_MAX = 4   # catch-ups longer than this (a prompt) go in one decode


def top_prob(logits: np.ndarray) -> float:
    """Softmax probability of the argmax, without materialising the distribution."""
    m = logits.max()
    return float(1.0 / np.exp(logits - m, dtype=np.float64).sum())


class MTPDrafter:
    """Proposes up to k draft tokens per round with the model's MTP head."""

    def __init__(self, model: NativeModel, cfg: ContextConfig, *, keep_accepted: bool = False,
                 row_by_row: bool = False) -> None:
        self.ctx = NativeContext(model, cfg)
        # Unmasked: one hidden row per batch row, so the fused catch-up decode can output
        # logits for its last row only and still read that row's hidden state.
        self.ctx.set_nextn_output(True, masked=False)
        self.batch = Batch(self.ctx.n_batch, embd_width=model.n_embd_out)
        self.keep_accepted = keep_accepted
        self.row_by_row = row_by_row
        self.end = 0         # positions [0, end) hold committed pairs
        self.dirty = False   # chain rows beyond `end` are in the KV
        self.n_chain = 0     # chain rows decoded by the last propose, at end, end+1, ...
        # q comes from a backend sampler chain attached to ctx (the engine attaches it),
        # not from the logits, which llama.cpp then does not copy out
        self.sampled = False

    def reset(self) -> None:
        self.ctx.clear()
        self.end = 0
        self.dirty = False
        self.n_chain = 0

    def close(self) -> None:
        self.ctx.close()

    def _drop_chain(self) -> None:
        if self.dirty:
            self.ctx.seq_rm(0, self.end, -1)
            self.dirty = False

    def feed(self, tokens: np.ndarray, hidden: np.ndarray) -> None:
        """Append pairs without asking for output: tokens[i] at position end+i with hidden[i] = h_{end+i-1}."""
        self._drop_chain()
        cap = self.batch.capacity
        for s in range(0, len(tokens), cap):
            e = min(s + cap, len(tokens))
            self.batch.set(tokens[s:e], self.end + s, outputs="none", embd=hidden[s:e])
            self.ctx.decode(self.batch)
        self.end += len(tokens)

    def propose(self, tokens: np.ndarray, hidden: np.ndarray, k: int, p_min: float,
                sampler: Sampler | None = None, *, sample: bool = False,
                recent: np.ndarray | None = None) -> tuple[np.ndarray, list[Dist]]:
        """Catch up on ``tokens`` (the last one is the token to draft after) and draft up to k tokens.

        hidden[i] must be the target hidden row of the position before tokens[i].
        Without ``sample`` the drafts are the head's argmax (greedy and exact-match modes);
        with it, each draft is sampled from q, the head's distribution under the sampler's
        filters (the target's), and q is returned for rejection sampling. ``recent`` is the
        history the sampler's penalties look back on; draft i sees it and d_1..d_{i-1},
        as the target's row for draft i does.
        Returns (drafts int32[<= k], q per draft or []); fewer drafts when the head's top
        probability falls below p_min.
        """
        self._drop_chain()
        if self.row_by_row and len(tokens) <= ROW_BY_ROW_MAX:
            # One-row decodes keep one graph shape for the whole round, which a GPU
            # replays as a CUDA graph; a multi-row decode is launched kernel by kernel.
            for i in range(len(tokens)):
                self.batch.set(tokens[i:i + 1], self.end, outputs="last", embd=hidden[i:i + 1])
                self.ctx.decode(self.batch)
                self.end += 1
            m = 1
        else:
            if len(tokens) > self.batch.capacity:
                self.feed(tokens[:-1], hidden[:-1])
                tokens, hidden = tokens[-1:], hidden[-1:]
            m = len(tokens)
            self.batch.set(tokens, self.end, outputs="last", embd=hidden)
            self.ctx.decode(self.batch)
            self.end += m
        drafts = np.empty(k, dtype=np.int32)
        qs: list[Dist] = []
        row = m - 1
        n = 0
        while n < k:
            logits = None if (sample and self.sampled) else self.ctx.logits(1)[0]
            before = None if recent is None else np.concatenate([recent, drafts[:n]])
            if not sample:
                if sampler is not None:
                    logits = sampler.penalised(logits, before)   # the raw row without penalties
                tok = int(logits.argmax())
                if p_min > 0.0 and top_prob(logits) < p_min:
                    break
            else:
                q = sampled_dist(self.ctx, row) if self.sampled else sampler.dist(logits, before)
                if p_min > 0.0 and float(q.probs.max()) < p_min:
                    break
                tok = sampler.sample(q)
                qs.append(q)
            drafts[n] = tok
            n += 1
            if n == k:
                break   # the last draft is never fed back: its successor would not be verified
            h = self.ctx.hidden(row + 1)[row]
            self.batch.set(drafts[n - 1:n], self.end + n - 1, outputs="last", embd=h[None, :])
            self.ctx.decode(self.batch)
            self.dirty = True
            row = 0
        self.n_chain = n if n < k else n - 1
        return drafts[:n], qs

    def commit(self, n_accepted: int) -> int:
        """After verification: how many catch-up rows the next ``propose`` can skip.

        With ``keep_accepted`` the chain rows of accepted drafts stay in the KV (built from
        the head's own hidden state instead of the target's), so the next round decodes
        only the rows the chain never reached; otherwise every accepted row is decoded
        again with the target's hidden state (docs/design.md, "The MTP cache").
        """
        if not self.keep_accepted:
            return 0
        kept = min(n_accepted, self.n_chain)
        self.end += kept
        self.n_chain = 0
        return kept
