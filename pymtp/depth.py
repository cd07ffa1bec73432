"""Adaptive draft depth: the depth draft_max="auto" drafts, by what each depth measured.

Pure policy, no llama.cpp: the engine feeds it what its requests and rounds measured and
asks which depth runs next.

- ``Arms``: the depth of a whole single-stream request, 0 (plain decoding, on the no-spec
  context) included. A depth is priced by the seconds a round it measured times the
  tokens a round the pooled acceptance by position promises. Its search can run at load,
  on a built-in prompt (``session.Session.calibrate``), instead of on the first requests:
  that prompt prices the rounds, and the first request's acceptance replaces its own.
- ``Epochs`` (depth_batched.py): batched rounds, where every auto sequence drafts the depth ``Arms`` picks,
  EPOCH rounds at a time (PROBE while it measures another depth), by the batch's tokens a
  second, with an ``Arms`` per bucket (how many sequences share a round, and whether
  their seq ids have a gap). Its search can run at load too (``batch.Batcher.calibrate``),
  and the first rounds after it measure the texts' acceptance as one stream's do.

Why whole requests and epochs, not a depth per round: a k=0 round inside a drafting run
still pays for the MTP target (recurrent snapshots, hidden rows, the drafter kept in
step), 8% over plain decoding on two CPU threads, so where plain decoding wins
(temperature 0.7) only a request run as plain decoding matches it. And a per-round cost
model (target decode by rows, MTP step, host line, calibrated at load) priced depths
wrong by enough to lose: k=0 in 121 of 124 rounds at temperature 0 on the small model,
where k=3 ran as fast as plain. It was removed once nothing used it (git history has it).

The depth never changes what is emitted, only how many drafts are proposed, so every
choice is lossless (greedy identity and the sampling distribution hold at any k).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

ARM_DECAY = 0.3        # weight of the newest request in a depth's seconds a round
GAIN_DECAY = 0.2       # ... and in the acceptance by position the depths share
RECHECK_FIRST = 4      # requests (batched: epochs) on the leading depth before the runner-up runs again
RECHECK_GROWTH = 16    # ... doubled after each re-check the leader kept, up to this many times
CONTEND = 0.9          # depths estimated within 10% of the leader are re-checked in turn
RECHECK_SHARE = 0.02   # what a re-check may lose, at most, of the time on the leader before it:
                       # well inside the 3% auto may trail the best fixed depth by (issue #12);
                       # at 5%, one re-check of k=4 in 16 requests took auto to 0.96x (H100, T=0.7)
ARM_MIN_TOKENS = 32    # a request with fewer decoded tokens says too little about a rate
SLOW_CLIP = 1.2        # one stream: a request's seconds a round count at most this times its depth's
                       # price (``Arms.observe`` says why)


def decayed(old: float | None, new: float, weight: float) -> float:
    """A running estimate moved ``weight`` of the way to ``new`` (``new`` where none was kept)."""
    return new if old is None else old + weight * (new - old)


@dataclass
class Arms:
    """The depth a draft_max="auto" request of one kind runs at, the same every round: 0
    (plain decoding, on the no-spec context) or 1..limit. Whole requests at one depth keep
    the decodes' shapes steady and time everything a round costs.

    A depth's tokens a second are estimated, not read off whole requests: the seconds a
    round it measured (decayed; a property of the machine and its load) times the tokens
    a round the acceptance by position promises, pooled over every request that drafted
    (a property of the texts). Compared request against request, two depths differ by
    their prompts as much as by their cost: one easy prompt at k=3 kept it ahead of
    plain decoding for 11 of 16 requests on the H100 where plain was 12% faster.

    Untried depths go first: ``first`` where one is given (Epochs: a neighbour's leader, else plain),
    the limit (its drafts measure every position), plain, then, from the limit down, any
    depth whose optimistic estimate beats the leader (``seconds``). A round's cost jumps
    from plain to one draft (the MTP head's decodes, the snapshots) and then grows by at
    most a chain step and a verify row a depth, so a depth the estimate rules out cannot
    win: where plain decoding leads by far, two requests explore. Then the leader runs,
    and after ``wait`` requests on it a contender runs once: of the depths estimated
    within CONTEND of the leader, the one measured longest
    ago (a machine whose speed drifts leaves every estimate but the leader's stale; the
    runner-up alone kept plain decoding, measured once, behind a k=3 it had overtaken
    since); with none that close, the one of all measured longest ago, so that one bad
    measurement cannot keep a depth out for good. A re-check waits at least until what it
    is estimated to lose is RECHECK_SHARE of the time on the leader before it
    (``recheck_wait``), and one the leader keeps doubles the wait (up to RECHECK_GROWTH
    times the first), so a depth that loses costs ever less; one that takes the lead
    resets it."""

    limit: int
    round_s: dict[int, float] = field(default_factory=dict)   # seconds a round (a token, at 0)
    gains: list[float | None] = field(default_factory=list)   # P(drafts 1..i+1 all accepted)
    first_wait: int = RECHECK_FIRST       # observations on the leader before the first re-check
    first: int | None = None              # the depth the search measures first (None: the limit)
    wait: int = -1                        # ... before the next one (-1: first_wait)
    since: int = 0           # requests on the leader since another depth last ran
    seen: int = 0            # requests observed
    last: dict[int, int] = field(default_factory=dict)       # ... when each depth last ran
    per_token: dict[int, float] = field(default_factory=dict)  # seconds a token adds at a depth
                                                                # besides its rounds (Epochs: prompts)
    by_rounds: bool = False  # an observation is a number of rounds (Epochs), not a request
    observed_s: dict[int, float] = field(default_factory=dict)   # seconds of an observation at a depth
    probe_loss: dict[int, float] = field(default_factory=dict)   # seconds a probe of a depth lost,
                                                                 # measured (Epochs), decayed
    prompt_pass: float | None = None   # one stream: seconds the drafter's pass over a prompt adds
                                       # a decoded token, decayed (``observe``'s prompt_s)
    provisional: set[int] = field(default_factory=set)   # depths priced by a calibration only
    provisional_texts: bool = False    # ... and the acceptance and prompt pass (``calibrated``)
    probe_texts: bool = False          # the next request drafts at the limit, to measure the requests'
                                       # acceptance in place of the calibration's (``calibrated``)
    exhaustive: bool = False           # ``untried`` offers every unmeasured depth (Session.calibrate)

    def __post_init__(self) -> None:
        if self.limit < 1:
            raise ValueError(f"need a draft limit >= 1, got {self.limit}")
        self.gains = self.gains or [None] * self.limit
        if self.wait < 0:
            self.wait = self.first_wait

    def seconds(self, k: int) -> float | None:
        """Seconds a round at depth k: measured, else an optimistic guess from the measured
        depths around it (None without one on each side). Above plain, on the line from
        plain's to the next measured depth's: a round's cost jumps at the first draft.
        Above a measured drafting depth, that depth's own: past the first draft a verify
        row can cost less than the one before it (a GPU), and the line between two
        drafting depths then runs above the depths between them. On the H100 under load
        it ruled k=3 out between k=1 and k=4, and auto ran k=4 at 0.74x of k=3."""
        if k in self.round_s:
            return self.round_s[k]
        measured = list(self.round_s)       # a copy: other threads read it (``leader``)
        lo = max((j for j in measured if j < k), default=None)
        hi = min((j for j in measured if j > k), default=None)
        if lo is None or hi is None:
            return None
        if lo > 0:
            return self.round_s[lo]
        return self.round_s[lo] + (self.round_s[hi] - self.round_s[lo]) * (k - lo) / (hi - lo)

    def tokens(self, k: int) -> float:
        """Tokens a round at depth k, by the pooled acceptance by position."""
        tokens, cap = 1.0, 1.0
        for g in self.gains[:k]:
            cap = min(cap, 0.0 if g is None else g)     # a deeper draft is never likelier
            tokens += cap
        return tokens

    def rate(self, k: int) -> float:
        """Estimated tokens a second at depth k (see ``seconds``), ``per_token`` included,
        and at a drafting depth the drafter's prompt pass (``prompt_pass``)."""
        tokens, seconds = self.tokens(k), self.seconds(k)
        if seconds is None:
            raise ValueError(f"depth {k} has no measured depth on both sides to estimate it from")
        extra = self.per_token.get(k, 0.0) + ((self.prompt_pass or 0.0) if k else 0.0)
        return tokens / (seconds + tokens * extra)

    def leader(self) -> int | None:
        """The depth estimated fastest. Over a copy of the measured depths: an engine that
        follows this one's depths reads them from its own thread (calibrating), the
        server's /metrics from another, and iterated while the search measured a new
        depth they raised "dictionary changed size during iteration"."""
        measured = list(self.round_s)
        return max(measured, key=lambda k: (self.rate(k), -k)) if measured else None

    def untried(self) -> int | None:
        """The next depth to measure, or None while none could beat the leader (with
        ``exhaustive``, while none is left: a calibration prices every depth's rounds)."""
        for k in (self.first, self.limit, 0):
            if k is not None and k not in self.round_s:
                return k
        if self.exhaustive:
            return next((k for k in range(self.limit - 1, 0, -1) if k not in self.round_s), None)
        best = self.rate(self.leader())
        return next((k for k in range(self.limit - 1, 0, -1)
                     if k not in self.round_s and self.rate(k) > best), None)

    def choose(self) -> int:
        k = self.untried()
        if k is not None:
            return k
        if self.probe_texts:
            self.probe_texts = False
            return self.limit
        lead = self.leader()
        if len(self.round_s) < 2:
            return lead
        others = [k for k in self.round_s if k != lead]
        near = [k for k in others if self.rate(k) >= CONTEND * self.rate(lead)]
        contender = min(near or others, key=lambda k: (self.last.get(k, -1), k))
        return lead if self.since < self.recheck_wait(contender) else contender

    def recheck_wait(self, k: int) -> int:
        """Observations on the leader before depth ``k`` is re-checked: the wait (doubled
        by each re-check the leader kept), and at least as many as keep what the
        re-check is estimated to lose within RECHECK_SHARE of the time on the leader.
        Under load on a GPU a probe of k=4 costs 6x a plain round for 0.6x its tokens a
        second; re-checked every 16 observations, as a close contender is, the probes
        cost a pass a quarter of its time. Where a probe of k measured what it lost
        (``lost``, Epochs), that is what it is estimated to lose: the estimate from the
        rates misses what a probe pays besides its timed decode rounds (the drafter
        catching up on every prompt of the plain epoch, the untimed SETTLE rounds into
        and out of it)."""
        lead = self.leader()
        if k in self.probe_loss and self.observed_s.get(lead, 0.0) > 0.0:
            losing = self.probe_loss[k] / self.observed_s[lead] / RECHECK_SHARE
        else:
            ratio = self.rate(k) / self.rate(lead)
            # an observation's seconds at k against one at the leader: PROBE rounds each
            # (Epochs), or one request each, whose tokens take the longer the slower the depth
            cost = self.round_s[k] / self.round_s[lead] if self.by_rounds else 1.0 / ratio
            losing = cost * max(0.0, 1.0 - ratio) / RECHECK_SHARE
        return min(max(self.wait, round(losing)), RECHECK_GROWTH * self.first_wait)

    def lost(self, k: int, seconds: float) -> None:
        """What a probe of depth ``k`` measured it lost against the leader (Epochs): from
        then on the re-checks of k wait by it, not by the estimate."""
        self.probe_loss[k] = decayed(self.probe_loss.get(k), max(0.0, seconds), ARM_DECAY)

    def calibrated(self, depths: Sequence[int], texts: bool) -> None:
        """The last observations of ``depths`` were a calibration's (Session.calibrate),
        on a built-in prompt, and so were the acceptance by position and the prompt pass
        where ``texts`` (no request had drafted before). A request's first observation
        of each replaces it instead of moving it ARM_DECAY (GAIN_DECAY) of the way:
        decayed, a calibration that priced k=4 at 166 tok/s on the small model on two
        CPU threads, where its requests ran at 234 and plain at 220, would still have
        priced it under plain after a re-check measured it.

        With ``texts``, the next request drafts at the limit (``choose``), part of the
        search, not a re-check: a depth's round costs are the machine's, which the
        calibration measures, but its acceptance is the texts', which a request that
        decodes plain never measures. On the H100 the calibration priced the small
        model's k=4 under plain (1081 against 1213 tok/s, greedy) where its requests ran
        it 16% faster than plain, and auto decoded 14 of 16 requests plain: 0.90x of k=4."""
        self.provisional |= set(depths)
        self.provisional_texts = self.provisional_texts or texts
        self.probe_texts = self.probe_texts or texts

    def observe(self, k: int, tokens: int, seconds: float, rounds: int,
                drafted_at: Sequence[int] = (), accepted_at: Sequence[int] = (),
                prompt_s: float = 0.0) -> None:
        """A finished request of this kind at depth ``k``: ``tokens`` decoded in
        ``seconds`` over ``rounds`` rounds (prompt excluded), per draft position how
        often it was drafted and accepted, and, at a drafting depth on one stream, the
        seconds its drafter's pass over the prompt took (``prompt_s``, outside
        ``seconds``). One too short to time says nothing.

        Why the prompt pass apart: it costs what the prompt's length makes it, not what
        the depth does (20-156 ms a request on the small model on two CPU threads, where
        a k=3 request decodes in 1.1-1.5 s), so inside a depth's seconds a round it
        priced each depth by the prompts it happened to get. Every drafting depth pays
        it alike: it is pooled over them (``prompt_pass``) and charged to each a token
        (``rate``); plain decoding does not pay it.

        One stream's request is priced at most SLOW_CLIP times its depth's price a round
        (a calibration's included): a request runs slower than the machine can when the
        host's other work takes time from it, never faster. On the H100, 4 of 48 plain
        requests of the demo model ran at 0.49-0.74x of the median, their token gaps
        wider throughout (no Python GC in them); one such request, counted whole, moved
        plain under k=4 for six requests at 0.9x of plain. Another run held k=3 for 13 of
        16 requests at 0.69x of plain (temperature 0.7; its order was not recorded, and a
        slow first measure of plain, which replaces the calibration's price, is the
        likely cause). A real slowdown still moves the price, a little a request.
        Batched rounds (``by_rounds``) average many sequences' rounds: not clipped."""
        if not 0 <= k <= self.limit:
            raise ValueError(f"need a depth in 0..{self.limit}, got {k}")
        if tokens < ARM_MIN_TOKENS or not seconds > 0.0 or rounds < 1:
            return
        weight = 1.0 if k in self.provisional else ARM_DECAY
        self.provisional.discard(k)
        texts = self.provisional_texts and any(drafted_at)
        if texts:
            self.provisional_texts = False
        if k > 0 and prompt_s > 0.0:
            self.prompt_pass = decayed(self.prompt_pass, prompt_s / tokens, 1.0 if texts else ARM_DECAY)
        searching, lead = self.untried() is not None, self.leader()
        per, price = seconds / rounds, self.round_s.get(k)
        if not self.by_rounds and price is not None:
            per = min(per, SLOW_CLIP * price)
        self.round_s[k] = decayed(price, per, weight)
        self.observed_s[k] = decayed(self.observed_s.get(k), seconds, weight)
        self.seen += 1
        self.last[k] = self.seen
        for i, (d, a) in enumerate(zip(drafted_at[: self.limit], accepted_at)):
            if d:
                self.gains[i] = decayed(self.gains[i], a / d, 1.0 if texts else GAIN_DECAY)
        if searching or texts:            # the requests' first acceptance: still the search
            return
        if k == lead:
            self.since += 1
            return
        self.since = 0                      # a re-check
        self.wait = (self.first_wait if self.leader() == k
                     else min(2 * self.recheck_wait(k), RECHECK_GROWTH * self.first_wait))
