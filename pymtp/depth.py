"""Adaptive draft depth: each round, the k per sequence that maximises expected tokens per second.

Pure policy, no llama.cpp: the engine feeds it the wall times it measures and the verdicts
of its rounds, and asks for a plan before each draft phase.

- ``CostModel``: seconds of a target decode as a function of its rows, of the drafter's
  catch-up (the rows it has yet to see, the last of which gives draft 1) as a function of
  those rows, and of one MTP chain step (draft 2, 3, ...) as a function of the sequences
  still drafting; measured (a calibration at load, then every round corrects the row
  counts it saw), interpolated between measured row counts and extrapolated past them
  from the last two. A sequence at k=0 leaves its rows for the round that drafts (the
  engine defers them), so a plain round costs only the target decode: on a GPU, where the
  MTP head's one-row decode costs half a target decode, that is what makes no-spec win.
  The rest of a round's wall time (judging each verify row, sampling it above temperature
  0, bookkeeping) is a line in the verify rows fitted to what rounds measure: on a GPU,
  where a 5-row decode costs about what a 4-row one does, sampling a row on the host is
  what makes depth 4 dearer than depth 3. A sequence alone in its round is priced by the
  rounds it ran at that depth once seen a few times (``RoundTimes``).
- ``Acceptance``: per sequence, the chance that draft i is accepted given draft i-1 was, by
  position, decayed so it follows the text (code, prose, a list) instead of its average.
- ``plan_depths``: the depths for the sequences of one round, maximising the expected
  tokens of the round over its expected time. k=0 is a plain decode. The search is exact
  for one sequence (a k=3 that beats no-spec while k=1 loses is found: the target's 4-row
  decode can cost little more than a 2-row one) and a local search for several.
- ``Arms``: the depth of a whole single-stream request, 0 (plain decoding) included, by
  what each depth measured on the requests before. A k=0 round inside a drafting run
  still pays for the MTP target (recurrent snapshots, hidden rows, the drafter kept in
  step): 8% over plain decoding on two CPU threads. Where plain decoding wins
  (temperature 0.7), only a request run as plain decoding matches it; and the per-round
  model priced depths wrong by enough (k=0 nearly every round at temperature 0 on the
  small model, where k=3 ran as fast as plain) that measuring whole requests wins.

Acceptance never changes what is emitted, only how many drafts are proposed, so every
depth plan is lossless (greedy identity and the sampling distribution hold at any k).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

DECAY = 0.1            # weight of the newest round in a sequence's acceptance by position
PRIOR = 0.7            # acceptance assumed at every position before anything was seen
PROBE_EVERY = 16       # rounds at k=0 before a sequence drafts once anyway, to keep learning
PROBE_MAX = 256        # ... doubled after each probe that left it at k=0, up to this
SWITCH_GAIN = 0.03     # a sequence alone changes depth only for this much more tokens a second
EXPLORE_EVERY = 64     # drafting rounds before a sequence whose plain rounds are unmeasured runs some
ARM_DECAY = 0.3        # weight of the newest request in a depth's seconds a round
GAIN_DECAY = 0.2       # ... and in the acceptance by position the depths share
RECHECK_FIRST = 4      # requests on the leading depth before the runner-up runs again
RECHECK_MAX = 64       # ... doubled after each re-check the leader kept, up to this
CONTEND = 0.9          # depths estimated within 10% of the leader are re-checked in turn
EPOCH = 32             # batched rounds without prompt rows that one depth runs for (Epochs)
ARM_MIN_TOKENS = 32    # a request with fewer decoded tokens says too little about a rate


@dataclass
class Curve:
    """Seconds as a function of a row count: measured points, decayed, piecewise linear."""

    points: dict[int, float] = field(default_factory=dict)
    decay: float = 0.2
    _memo: dict[int, float] = field(default_factory=dict, repr=False)

    def observe(self, rows: int, seconds: float) -> None:
        if rows < 1 or not seconds > 0.0:
            raise ValueError(f"need rows >= 1 and seconds > 0, got {rows}, {seconds}")
        old = self.points.get(rows)
        self.points[rows] = seconds if old is None else old + self.decay * (seconds - old)
        self._memo.clear()

    def __call__(self, rows: int) -> float:
        """The time of ``rows`` rows (0 rows cost nothing)."""
        if rows <= 0:
            return 0.0
        t = self._memo.get(rows)
        if t is None:
            t = self._memo[rows] = self._at(rows)
        return t

    def _at(self, rows: int) -> float:
        if not self.points:
            raise ValueError("no measurement yet: calibrate or observe a row count first")
        if rows in self.points:
            return self.points[rows]
        xs = sorted(self.points)
        if len(xs) == 1:                       # one point: time proportional to rows
            return self.points[xs[0]] * rows / xs[0]
        lo = max((x for x in xs if x < rows), default=None)
        hi = min((x for x in xs if x > rows), default=None)
        if lo is None:
            lo, hi = xs[0], xs[1]
        elif hi is None:
            lo, hi = xs[-2], xs[-1]
        slope = (self.points[hi] - self.points[lo]) / (hi - lo)
        return max(0.0, self.points[lo] + slope * (rows - lo))


@dataclass
class Line:
    """Seconds = fixed + per_row x rows, fitted to decayed observations. Until two row
    counts were seen the slope is 0 (a constant, the mean); a fitted slope below 0 (noise)
    counts as 0, and no prediction is below 0."""

    decay: float = 0.2
    n: int = 0
    mx: float = 0.0     # decayed means of rows, seconds, rows^2 and rows x seconds
    my: float = 0.0
    mxx: float = 0.0
    mxy: float = 0.0

    @classmethod
    def constant(cls, seconds: float, decay: float = 0.2) -> Line:
        line = cls(decay)
        line.observe(1, seconds)
        return line

    def observe(self, rows: int, seconds: float) -> None:
        x, y = float(rows), max(seconds, 0.0)       # clock noise never makes it negative
        w = 1.0 if self.n == 0 else self.decay
        self.n += 1
        self.mx += w * (x - self.mx)
        self.my += w * (y - self.my)
        self.mxx += w * (x * x - self.mxx)
        self.mxy += w * (x * y - self.mxy)

    @property
    def per_row(self) -> float:
        var = self.mxx - self.mx * self.mx
        if var <= 1e-9 * max(1.0, self.mxx):
            return 0.0
        return max(0.0, (self.mxy - self.mx * self.my) / var)

    @property
    def fixed(self) -> float:
        return self.my - self.per_row * self.mx

    def __call__(self, rows: int) -> float:
        return max(0.0, self.fixed + self.per_row * rows)


@dataclass
class RoundTimes:
    """One sequence's whole rounds, timed by depth: the decomposed model misses what only
    a whole round shows (a CPU's caches cold after the MTP head's decode, Python around
    each draft). A depth seen ``trusted`` times is priced by what its rounds took; any
    other by the model, scaled by how far the model was off on the rounds it priced."""

    decay: float = 0.1
    trusted: int = 3
    seconds: dict[int, float] = field(default_factory=dict)
    seen: dict[int, int] = field(default_factory=dict)
    scale: float = 1.0          # decayed mean of measured / modelled round seconds

    def observe(self, k: int, seconds: float, modelled: float) -> None:
        old = self.seconds.get(k)
        self.seconds[k] = seconds if old is None else old + self.decay * (seconds - old)
        self.seen[k] = self.seen.get(k, 0) + 1
        if modelled > 0.0:
            self.scale += self.decay * (seconds / modelled - self.scale)

    def get(self, k: int) -> float | None:
        return self.seconds[k] if self.seen.get(k, 0) >= self.trusted else None


@dataclass
class CostModel:
    """What a round costs: target decode by rows, MTP chain step by rows, and the host's
    work around them by verify rows."""

    target: Curve = field(default_factory=Curve)
    mtp_step: Curve = field(default_factory=Curve)
    host: Line = field(default_factory=Line)
    catch_up: Curve = field(default_factory=Curve)   # empty: a catch-up row costs a chain step's
    solo: RoundTimes = field(default_factory=RoundTimes)   # rounds of one sequence alone

    def observe_host(self, rows: int, seconds: float) -> None:
        """A round's wall time outside the decodes the curves time, at its verify rows."""
        self.host.observe(rows, seconds)

    def round_seconds(self, depths: Sequence[int], extra_rows: int = 0,
                      pending: Sequence[int] | None = None) -> float:
        """Seconds of a round where sequence i drafts depths[i] tokens, beside
        ``extra_rows`` prompt rows in the same target decode. ``pending[i]`` is the rows
        sequence i's drafter has yet to see (1 when not given): a drafting sequence
        decodes them first, and its draft 1 comes out of their last row; each further
        draft is one chain step over the sequences still at it. A sequence alone in its
        round is priced by ``solo`` where it has been measured."""
        if len(depths) == 1 and not extra_rows:
            measured = self.solo.get(depths[0])
            if measured is not None:
                return measured
            return self.solo.scale * self.modelled(depths, extra_rows, pending)
        return self.modelled(depths, extra_rows, pending)

    def modelled(self, depths: Sequence[int], extra_rows: int = 0, pending: Sequence[int] | None = None) -> float:
        """``round_seconds`` from the parts: decodes by rows, and the host's line."""
        rows = extra_rows + sum(k + 1 for k in depths)
        caught = sum(1 if pending is None else pending[i] for i, k in enumerate(depths) if k > 0)
        catch_up = (self.catch_up if self.catch_up.points else self.mtp_step)(caught)
        steps = sum(self.mtp_step(sum(1 for k in depths if k >= j)) for j in range(2, max(depths, default=0) + 1))
        return self.host(rows) + self.target(rows) + catch_up + steps


@dataclass
class Acceptance:
    """One sequence's acceptance by draft position (conditional on the one before)."""

    rates: list[float]
    decay: float = DECAY
    idle: int = 0           # rounds in a row planned at k=0
    probe_every: int = 0    # idle rounds before the next probe (0: PROBE_EVERY)
    busy: int = 0           # rounds in a row that drafted
    plain_left: int = 0     # rounds left of a block of plain ones that measures them

    @classmethod
    def fresh(cls, limit: int, prior: float = PRIOR) -> Acceptance:
        return cls([prior] * limit)

    def observe(self, drafted: int, accepted: int) -> None:
        """A round's verdict: positions 1..accepted were accepted, accepted+1 (if drafted)
        was not; positions past it were not tried and keep their rates."""
        if not 0 <= accepted <= drafted <= len(self.rates):
            raise ValueError(f"need 0 <= accepted <= drafted <= {len(self.rates)}, got {accepted}, {drafted}")
        for i in range(min(accepted + 1, drafted)):
            hit = 1.0 if i < accepted else 0.0
            self.rates[i] += self.decay * (hit - self.rates[i])

    def gains(self) -> list[float]:
        """Expected extra tokens from draft i (1-based position i+1): the chance all
        drafts up to it are accepted."""
        out, p = [], 1.0
        for r in self.rates:
            p *= r
            out.append(p)
        return out


def expected_tokens(gains: Sequence[float], k: int) -> float:
    """Tokens a round emits on average with k drafts: the bonus/correction token plus
    every accepted draft."""
    return 1.0 + sum(gains[:k])


def plan_depths(gains: Sequence[Sequence[float]], limits: Sequence[int], cost: CostModel,
                extra_rows: int = 0, start: Sequence[int] | None = None,
                pending: Sequence[int] | None = None) -> list[int]:
    """Depths maximising (expected tokens of all sequences) / (round seconds).

    ``gains[i]`` is sequence i's ``Acceptance.gains()``, ``limits[i]`` the most it may
    draft this round (its draft limit, room and max_tokens). A local search from all
    zero: each step takes the best of two kinds of move while one raises the ratio -- one
    sequence to any other depth, or the m likeliest sequences at depth j raised to at
    least j (they share the MTP steps up to j, which one alone may not pay for). With one
    sequence that tries every k; O(n x depth) moves a step. ``start`` (last round's
    depths) is where the search begins instead of all zero: a round or two of moves then.
    ``pending[i]``: the rows sequence i's drafter would catch up on before drafting.
    """
    tops = [min(lim, len(g)) for g, lim in zip(gains, limits)]
    if not tops:
        return []

    table = [[expected_tokens(g, k) for k in range(t + 1)] for g, t in zip(gains, tops)]

    def ratio(depths: list[int]) -> float:
        tokens = sum(row[k] for row, k in zip(table, depths))
        return tokens / cost.round_seconds(depths, extra_rows, pending)

    if len(tops) == 1:      # every k once: exact, and a few curve lookups a round
        best = max(range(tops[0] + 1), key=lambda k: (ratio([k]), -k))
        # a change of depth changes the decodes' shapes, which a GPU pays for (its CUDA
        # graphs are captured again): stay unless the best is clearly better
        if start is not None and start[0] <= tops[0] and ratio([best]) <= ratio([start[0]]) * (1 + SWITCH_GAIN):
            return [start[0]]
        return [best]

    def moves(ks: list[int]):
        for i, top in enumerate(tops):
            for k2 in range(top + 1):
                if k2 != ks[i]:
                    yield ks[:i] + [k2] + ks[i + 1:]
        for j in range(1, max(tops) + 1):
            order = sorted((i for i, t in enumerate(tops) if t >= j), key=lambda i: -gains[i][j - 1])
            trial = list(ks)
            for i in order:
                trial[i] = max(trial[i], j)
                yield list(trial)

    ks = [0] * len(tops) if start is None else [min(max(0, k), t) for k, t in zip(start, tops)]
    best = ratio(ks)
    while True:
        move, move_ratio = None, best
        for trial in moves(ks):
            r = ratio(trial)
            if r > move_ratio * (1 + 1e-12):
                move, move_ratio = trial, r
        if move is None:
            return ks
        ks, best = move, move_ratio


def with_probes(planned: Sequence[int], accs: Sequence[Acceptance], limits: Sequence[int],
                every: int | None = None, most: int | None = None,
                unmeasured_plain: Sequence[bool] | None = None, block: int = 4) -> list[int]:
    """The plan, except that a sequence planned at k=0 for ``every`` rounds in a row
    drafts one token, so its acceptance can follow the text back up; counts the idle
    rounds in ``accs``. A probe that leaves the sequence at k=0 doubles its wait (up to
    ``most``), and a planned draft resets it: where drafting does not pay, probing, whose
    catch-up and verify rows cost more than the plain round they replace, fades out.
    One draft is enough to learn whether position 1 pays; deeper ones follow once it does.

    The other way: a sequence that drafted EXPLORE_EVERY rounds in a row while
    ``unmeasured_plain`` says its plain rounds were never timed runs ``block`` plain rounds
    in a row (the first after a change of depth is not a plain round's steady cost)."""
    every = PROBE_EVERY if every is None else every
    most = max(every, PROBE_MAX if most is None else most)
    out = []
    for i, (k, acc, lim) in enumerate(zip(planned, accs, limits)):
        if acc.plain_left:
            acc.plain_left -= 1
            k = 0
        elif k > 0 and unmeasured_plain is not None and unmeasured_plain[i]:
            acc.busy += 1
            if acc.busy >= EXPLORE_EVERY:
                acc.busy, acc.plain_left, k = 0, block - 1, 0
        if k == 0 and lim > 0:
            acc.idle += 1
            wait = acc.probe_every or every
            if acc.idle >= wait:
                acc.idle = 0
                acc.probe_every = min(2 * wait, most)
                k = 1
        elif k > 0:
            acc.idle, acc.probe_every = 0, every
        out.append(k)
    return out




@dataclass
class Arms:
    """The depth a draft_max="auto" request of one kind runs at, the same every round: 0
    (plain decoding, on the no-spec context) or 1..limit. Whole requests at one depth keep
    the decodes' shapes steady and time everything a round costs, which the per-round
    model misses (``plan_depths``).

    A depth's tokens a second are estimated, not read off whole requests: the seconds a
    round it measured (decayed; a property of the machine and its load) times the tokens
    a round the acceptance by position promises, pooled over every request that drafted
    (a property of the texts). Compared request against request, two depths differ by
    their prompts as much as by their cost: one easy prompt at k=3 kept it ahead of
    plain decoding for 11 of 16 requests on the H100 where plain was 12% faster.

    Untried depths go first: the limit (its drafts measure every position), then plain,
    then, from the limit down, any depth whose optimistic estimate beats the leader: its
    seconds a round on the line between the measured depths around it. A round's cost
    jumps from plain to one draft (the MTP head's decodes, the snapshots) and then grows
    by a chain step and a verify row a depth, so that line runs below the real cost, and
    a depth it rules out cannot win: where plain decoding leads by far, two requests
    explore. Then the leader runs, and after ``wait`` requests on it a contender runs
    once: of the depths estimated within CONTEND of the leader, the one measured longest
    ago (a machine whose speed drifts leaves every estimate but the leader's stale; the
    runner-up alone kept plain decoding, measured once, behind a k=3 it had overtaken
    since). A re-check the leader keeps doubles the wait (up to RECHECK_MAX), so a depth
    that loses costs ever less; one that takes the lead resets it."""

    limit: int
    round_s: dict[int, float] = field(default_factory=dict)   # seconds a round (a token, at 0)
    gains: list[float | None] = field(default_factory=list)   # P(drafts 1..i+1 all accepted)
    wait: int = RECHECK_FIRST
    since: int = 0           # requests on the leader since another depth last ran
    seen: int = 0            # requests observed
    last: dict[int, int] = field(default_factory=dict)       # ... when each depth last ran

    def __post_init__(self) -> None:
        if self.limit < 1:
            raise ValueError(f"need a draft limit >= 1, got {self.limit}")
        self.gains = self.gains or [None] * self.limit

    def seconds(self, k: int) -> float | None:
        """Seconds a round at depth k: measured, else on the line between the measured
        depths around it (None without one on each side)."""
        if k in self.round_s:
            return self.round_s[k]
        lo = max((j for j in self.round_s if j < k), default=None)
        hi = min((j for j in self.round_s if j > k), default=None)
        if lo is None or hi is None:
            return None
        return self.round_s[lo] + (self.round_s[hi] - self.round_s[lo]) * (k - lo) / (hi - lo)

    def rate(self, k: int) -> float:
        """Estimated tokens a second at depth k (see ``seconds``)."""
        tokens, cap = 1.0, 1.0
        for g in self.gains[:k]:
            cap = min(cap, 0.0 if g is None else g)     # a deeper draft is never likelier
            tokens += cap
        seconds = self.seconds(k)
        if seconds is None:
            raise ValueError(f"depth {k} has no measured depth on both sides to estimate it from")
        return tokens / seconds

    def leader(self) -> int | None:
        return max(self.round_s, key=lambda k: (self.rate(k), -k)) if self.round_s else None

    def untried(self) -> int | None:
        """The next depth to measure, or None while none could beat the leader."""
        if self.limit not in self.round_s:
            return self.limit
        if 0 not in self.round_s:
            return 0
        best = self.rate(self.leader())
        return next((k for k in range(self.limit - 1, 0, -1)
                     if k not in self.round_s and self.rate(k) > best), None)

    def choose(self) -> int:
        k = self.untried()
        if k is not None:
            return k
        lead = self.leader()
        if self.since < self.wait or len(self.round_s) < 2:
            return lead
        others = [k for k in self.round_s if k != lead]
        near = [k for k in others if self.rate(k) >= CONTEND * self.rate(lead)]
        if not near:
            return max(others, key=lambda k: (self.rate(k), -k))
        return min(near, key=lambda k: (self.last.get(k, -1), k))

    def observe(self, k: int, tokens: int, seconds: float, rounds: int,
                drafted_at: Sequence[int] = (), accepted_at: Sequence[int] = ()) -> None:
        """A finished request of this kind at depth ``k``: ``tokens`` decoded in
        ``seconds`` over ``rounds`` rounds (prompt excluded), and per draft position how
        often it was drafted and accepted. One too short to time says nothing."""
        if not 0 <= k <= self.limit:
            raise ValueError(f"need a depth in 0..{self.limit}, got {k}")
        if tokens < ARM_MIN_TOKENS or not seconds > 0.0 or rounds < 1:
            return
        searching, lead = self.untried() is not None, self.leader()
        per = seconds / (tokens if k == 0 else rounds)
        old = self.round_s.get(k)
        self.round_s[k] = per if old is None else old + ARM_DECAY * (per - old)
        self.seen += 1
        self.last[k] = self.seen
        for i, (d, a) in enumerate(zip(drafted_at[: self.limit], accepted_at)):
            if d:
                g, old_g = a / d, self.gains[i]
                self.gains[i] = g if old_g is None else old_g + GAIN_DECAY * (g - old_g)
        if searching:
            return
        if k == lead:
            self.since += 1
            return
        self.since = 0                      # a re-check
        self.wait = RECHECK_FIRST if self.leader() == k else min(2 * self.wait, RECHECK_MAX)


@dataclass
class Epochs:
    """Batched rounds: every draft_max="auto" sequence drafts the same depth, EPOCH rounds
    at a time, and ``Arms`` picks it by the batch's tokens a second. A sequence choosing
    for itself would draft: one k=3 sequence among plain ones emits 3 tokens a round for
    the price of a slightly longer round, while the MTP decodes it adds slow every other
    sequence in the batch (on an H100 with 8 slots: pymtp's plain rounds 4111 tok/s
    aggregate, k=3 2430). Rounds with prompt rows say nothing about the depth (a prefill
    chunk sets their time) and are not counted."""

    arms: Arms
    k: int = -1
    rounds: int = 0
    tokens: int = 0
    seq_rounds: int = 0      # sum over the rounds of the sequences that ran at the depth
    seconds: float = 0.0
    drafted_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.k < 0:
            self.k = self.arms.choose()

    def tally(self, seconds: float, steps: Sequence[tuple[int, int, int]]) -> None:
        """One round without prompt rows: its wall seconds and, per auto sequence, (tokens
        emitted, drafts, drafts accepted). The EPOCH-th goes to ``arms``, which picks the
        next epoch's depth."""
        if not steps:
            return
        self.rounds += 1
        self.seconds += seconds
        self.seq_rounds += len(steps)
        for tokens, drafted, accepted in steps:
            self.tokens += tokens
            for i in range(drafted):
                if i == len(self.drafted_at):
                    self.drafted_at.append(0)
                    self.accepted_at.append(0)
                self.drafted_at[i] += 1
                self.accepted_at[i] += i < accepted
        if self.rounds < EPOCH:
            return
        # per sequence-round, so a depth's seconds a round times its tokens a round is
        # the batch's tokens a second
        self.arms.observe(self.k, self.tokens, self.seconds, self.seq_rounds, self.drafted_at, self.accepted_at)
        self.rounds = self.tokens = self.seq_rounds = 0
        self.seconds = 0.0
        self.drafted_at, self.accepted_at = [], []
        self.k = self.arms.choose()
