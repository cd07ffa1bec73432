"""Adaptive draft depth in batched rounds (``Epochs``), and for engines that follow
another's schedule (``Following``): pure policy, no llama.cpp, as depth.py, whose
``Arms`` each bucket of rounds keeps. depth.py's docstring says why depths are chosen by
whole requests and epochs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from .depth import ARM_MIN_TOKENS, RECHECK_FIRST, Arms

EPOCH = 32             # batched rounds that the leading depth runs for (Epochs)
PROBE = 8              # ... that another runs for, to be measured: a search or a re-check
SETTLE = 2             # batched rounds at a new depth that pay for the change: not timed
CUT_ROUNDS = 3         # batched rounds after which a probe that loses by far ends ...
CUT_RATE = 0.75        # ... at below this share of the leader's tokens a second
AFTER_PROMPT = 1       # batched decode rounds after one with prompt rows that pay for it: priced with it
RESHAPED = 2           # ... and from one whose count of sequences changed (a new shape): priced the same
PRIOR_ROWS = 256       # prompt rows of the pooled price that a depth's own price of a prompt row starts from
PROMPT_HORIZON = 16384  # prompt rows (tokens emitted, for the rows a token) after which older ones count half
PROMPT_ROUNDS = 256    # ... and rounds with prompt rows a depth kept (the drafter's have no target rows)


def occupancy_label(bucket: int) -> str:
    """The sequences a round of an occupancy bucket decodes: "1", "2", "3-4", "5-8", ..."""
    return str(1 << bucket) if bucket < 2 else f"{(1 << (bucket - 1)) + 1}-{1 << bucket}"


def occupancy(n: int) -> int:
    """The bucket of a round of ``n`` decoding sequences: 1, 2, 3-4, 5-8, 9-16, ... are
    buckets 0, 1, 2, 3, 4, ..."""
    if n < 1:
        raise ValueError(f"need at least one sequence, got {n}")
    return (n - 1).bit_length()


# What a round's cost depends on besides its depth: its occupancy, and whether its seq ids
# have a gap. llama.cpp decodes a batch whose ids have a gap in several ubatches
# (scheduler.py), and such a round costs what the gap makes it: on the H100 a plain round
# of 7 sequences took 5.7 ms with a gap where 8 took 1.3, a k=4 round 11 ms where 8 took
# 6. Counted with the rounds without, a probe of plain that caught the end of a load
# (sequences finishing here and there) priced it at 3x its cost, and auto drafted k=4
# where plain was faster.
Bucket = tuple[int, bool]


@dataclass
class _Tally:
    """What the rounds of one depth in one bucket added up to, since it last told Arms."""

    rounds: int = 0
    tokens: int = 0
    seq_rounds: int = 0      # sum over the rounds of the auto sequences in them
    seconds: float = 0.0
    drafted_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)

    def add(self, seconds: float, steps: Sequence[tuple[int, int, int]], tokens: int) -> None:
        """``tokens``: what ``steps`` emitted in all."""
        self.rounds += 1
        self.seconds += seconds
        self.seq_rounds += len(steps)
        self.tokens += tokens
        for _, drafted, accepted in steps:
            for i in range(drafted):
                if i == len(self.drafted_at):
                    self.drafted_at.append(0)
                    self.accepted_at.append(0)
                self.drafted_at[i] += 1
                self.accepted_at[i] += i < accepted


@dataclass
class _Prompts:
    """The rounds with prompt rows at one depth: what they cost beyond their decoding, and
    the target's prompt rows in them (halved past PROMPT_HORIZON rows or PROMPT_ROUNDS
    rounds). By depth, not by bucket: the drafter's catch-up of a prompt comes in the
    round after its last chunk, with one sequence more decoding, often in the next bucket."""

    extra: float = 0.0
    rows: float = 0.0
    rounds: float = 0.0

    def add(self, extra: float, rows: int) -> None:
        if self.rows > PROMPT_HORIZON or self.rounds > PROMPT_ROUNDS:
            self.extra, self.rows, self.rounds = self.extra / 2, self.rows / 2, self.rounds / 2
        self.extra += extra
        self.rows += rows
        self.rounds += 1


@dataclass
class _Span:
    """A probe's rounds in one bucket, from its first through the SETTLE rounds after it
    ended (what changing back costs is the probe's too): their seconds, tokens emitted
    and target prompt rows, to price against the leader's."""

    bucket: Bucket
    k: int
    lead: int
    seconds: float = 0.0
    tokens: int = 0
    rows: int = 0
    ended: bool = False


@dataclass
class Epochs:
    """Batched rounds: every draft_max="auto" sequence drafts the same depth, picked by the
    batch's tokens a second: the leader for EPOCH rounds, another depth for PROBE rounds
    while it is measured (the search, a re-check). A sequence choosing for itself would
    draft: one k=3 sequence among plain ones emits 3 tokens a round for the price of a
    slightly longer round, while the MTP decodes it adds slow every other sequence in the
    batch (on an H100 with 8 slots: pymtp's plain rounds 4111 tok/s aggregate, k=3 2430).

    A round is timed from the landing of the one before it (rounds.Rounds.idle), so all
    the loop spends a round counts. Not counted: a round of prompts alone (nothing
    decoded), and the first SETTLE rounds at a new depth, which pay for the change: after
    plain rounds the drafter catches up, and on a GPU the first round decodes the new
    shape outside the CUDA graph and the second captures it (H100, demo model, 8
    sequences: plain after drafting 3.7-4.0 ms, then 4.4-4.9, then 1.4-1.6; counted, the
    second priced an 8-round probe of plain 25% over its cost, one of k=1..3 about 10%).
    A round with prompt rows (a prompt chunk in the
    target's decode, or a new prompt's rows in the drafter's) is priced apart
    (``_Prompts``): what it cost beyond its decode rounds' price at its depth, a prompt row,
    times the load's prompt rows a token emitted, is what a token at that depth costs
    besides its rounds. Such a round costs ten times a decode round; counted with the
    decode rounds, whichever 8-round probe caught one was priced by it (a probe of plain
    that caught two or three priced it at a quarter of its speed on the H100, and auto
    drafted k=3 at 0.7-0.8x of plain; on two CPU threads plain led for 126 rounds after a
    probe of k=3 caught two, where k=3's decode rounds gave 1.4x plain's tokens a
    second). Left out altogether, they priced drafting without what it adds to a prompt
    round (the drafter's decodes of the new prompt, a batch of unequal rows split in
    ubatches): auto estimated k=2 at 5879 tok/s where it gave 2417. A depth's price of a
    prompt row starts from the price pooled over every depth (PRIOR_ROWS of it), so one
    probe cannot set it alone.

    Why short probes: a depth that loses under load loses by far (k=4 rounds of 8
    sequences on the H100 cost 5x a plain one for 3.5x its tokens), and the search and
    the re-checks ran it for whole epochs: auto gave 0.57x of plain decoding. A probe
    that after CUT_ROUNDS rounds gives below CUT_RATE of the leader's rate ends there
    (``_losing``). What a probe lost is measured (``_Span``): its rounds, from its first
    through the SETTLE rounds after it, against what the leader would have spent on
    their tokens and prompt rows; the next re-check of its depth waits by that
    (``Arms.recheck_wait``).

    The decode round right after one with prompt rows (AFTER_PROMPT), and the first
    RESHAPED rounds after the count of sequences changed, are priced with the prompts:
    on the H100 they run outside the CUDA graph or capture it again (--spec none, demo
    model: 3.4 ms after a prompt round where the rounds around it took 1.3; rounds of 5-7
    sequences, mostly right after one joined or left, 3.2 ms against 1.0 for 8). Timed
    as decode rounds they priced plain above k=3 under load: auto's probes of plain come
    while a load's prompts arrive and its sequences join, those of the drafting depths
    in a full batch. The load's churn is what its prompts cost, so it goes with them.

    The right depth depends on how many sequences share a round, and so does a round's
    cost per sequence: on a GPU a round of one sequence costs about what a round of eight
    does. So each occupancy (``occupancy``: 1, 2, 3-4, 5-8, ... sequences), with a gap in
    the seq ids or without (``Bucket``), has an ``Arms`` of its own, timed only by its
    rounds, and a change of bucket picks the depth anew. With one ``Arms`` for all, an
    epoch that caught the end of a load (the last requests finishing one by one) priced
    its depth at several times its cost, and on the H100 auto then drafted k=4 at 2184
    tok/s where plain gave 3892.
    The acceptance by position is a property of the texts and is pooled over them all.

    A bucket's search starts at its nearest searched bucket's leader, or at plain
    decoding, not at the limit as one stream's does. A load begins with its prompts, and
    a probe lasts until it has PROBE rounds without prompt rows: on the H100 the limit,
    measured first, ran 657 of a first pass's 824 sequence-rounds at k=4 (its decode
    rounds cost 6x plain's, its prompt rounds 2x), where plain rounds cost least."""

    limit: int
    arms: dict[Bucket, Arms] = field(default_factory=dict)
    k: int = 0               # the depth in force (plain: what the first bucket tries first)
    bucket: Bucket | None = None     # ... picked for this bucket (None: none seen yet)
    left: int = -1           # rounds before it is picked again (-1: PROBE)
    settling: int = 0        # rounds at the new depth left that pay for the change: not timed
    unsettled: int = 0       # decode rounds left that pay for the last prompt round or change of shape
    decoded: int = 0         # sequences the last round decoded
    leading: bool = False    # whether the depth in force was picked as its bucket's leader
    tallies: dict[tuple[Bucket, int], _Tally] = field(default_factory=dict)    # by (bucket, depth)
    prompts: dict[int, _Prompts] = field(default_factory=dict)   # by depth: rounds with prompt rows
    load_rows: float = 0.0   # prompt rows in rounds that decoded sequences (halved past PROMPT_HORIZON)
    load_tokens: float = 0.0  # ... and the tokens those rounds emitted, all rounds counted
    span: _Span | None = None  # the probe being run or ending, to measure what it loses
    followers: list["Following"] = field(default_factory=list)   # engines drafting its depth

    def __post_init__(self) -> None:
        self._gains: list[float | None] = [None] * self.limit
        if self.left < 0:
            self.left = PROBE

    def launched(self, decoding: int) -> None:
        """A round of this engine was launched (``Following`` counts its followers')."""

    def sharing(self, decoding: int) -> int:
        """The sequences decoding in this engine's round and its followers' latest: what
        the round's bucket is by. Engines side by side share the device, so a round's
        cost follows them all: with its own count alone, the first engine timed depths
        at one or two sequences while the others' requests ended (the end of a load),
        with the device nearly to itself; it priced k=3 at 2.3x plain on the H100 where
        the full batch ran them level, and drafted."""
        return decoding + sum(f.decoding for f in self.followers)

    def arms_for(self, bucket: Bucket) -> Arms:
        arms = self.arms.get(bucket)
        if arms is None:        # the same list: every bucket's Arms updates the shared acceptance
            # an observation is PROBE rounds: the leader runs RECHECK_FIRST epochs before a re-check
            lead = self._nearest_leader(bucket)
            arms = self.arms[bucket] = Arms(self.limit, gains=self._gains, first=0 if lead is None else lead,
                                            first_wait=RECHECK_FIRST * EPOCH // PROBE, by_rounds=True)
        return arms

    def _nearest_leader(self, bucket: Bucket) -> int | None:
        """The leader of the measured bucket nearest this one: what a new bucket measures
        first. The end of a load passes through a bucket for a few rounds each, too few
        to measure anything, and the limit, tried first, ran there: on the H100 a pass
        of 24 requests drafted k=4 for 376 sequence-rounds where plain was 1.4x faster."""
        known = [(abs(b[0] - bucket[0]), b[1] != bucket[1], a.leader())
                 for b, a in ((b, self._priced(b)) for b in list(self.arms)) if a.untried() is None]
        return min(known)[2] if known else None

    def row_seconds(self, k: int) -> float:
        """What a prompt row costs rounds at depth k beyond their decoding: its own rounds'
        price, pulled towards the price pooled over every depth by PRIOR_ROWS rows of it."""
        kept = list(self.prompts.values())        # the server's /metrics reads it from its own thread
        # fewer than PRIOR_ROWS rows price as if spread over that many: rounds of the
        # drafter's catch-up alone bring cost and no rows
        pooled = sum(p.extra for p in kept) / max(sum(p.rows for p in kept), PRIOR_ROWS)
        own = self.prompts.get(k) or _Prompts()
        return max(0.0, (own.extra + PRIOR_ROWS * pooled) / (own.rows + PRIOR_ROWS))

    def _priced(self, bucket: Bucket) -> Arms:
        """The bucket's Arms, each depth's tokens a second charged with what its prompt
        rounds cost a token: its price of a prompt row times the load's rows a token. A
        drafting depth pays at least plain's price: drafting adds to a prompt's rounds (the
        drafter's decodes of it, more rows beside it) and takes nothing away, so a lower
        price is where its few prompt rounds fell, not what it costs."""
        arms = self.arms_for(bucket)
        rows_a_token = self.load_rows / self.load_tokens if self.load_tokens > 0 else 0.0
        plain = self.row_seconds(0)
        arms.per_token = {k: rows_a_token * max(self.row_seconds(k), plain) for k in range(self.limit + 1)}
        return arms

    def _losing(self, arms: Arms, t: _Tally) -> bool:
        """Whether the depth in force, not the leader of ``arms`` (priced), has lost by
        far in the CUT_ROUNDS or more rounds its tally holds: below CUT_RATE of the
        leader's tokens a second, its rounds' tokens a second charged what its prompts
        cost a token. Its probe then ends there. Under load on the H100 a probe of k=4 ran
        9 ms rounds for 0.6x plain's rate, and prompt rounds, priced apart, stretched its
        8 rounds to 69."""
        lead = arms.leader()
        if lead is None or lead == self.k or not t.seconds > 0.0:
            return False
        rate = t.tokens / (t.seconds + t.tokens * arms.per_token.get(self.k, 0.0))
        return rate < CUT_RATE * arms.rate(lead)

    def estimates(self) -> list[tuple[Bucket, int, float, float]]:
        """(bucket, depth, seconds a sequence-round, estimated tokens a second) of every
        measured depth: what auto's choices rest on (the server's /metrics)."""
        return [(bucket, k, arms.round_s[k], arms.rate(k))
                for bucket in sorted(self.arms) for arms in (self._priced(bucket),) for k in sorted(arms.round_s)]

    def pick(self, bucket: Bucket) -> int:
        """The depth for rounds of this bucket."""
        return self._priced(bucket).choose()

    def drafted(self) -> bool:
        """Whether any round has measured the acceptance by position yet."""
        return any(g is not None for g in self._gains)

    def calibrated(self, bucket: Bucket, texts: bool) -> None:
        """``bucket``'s depths were just priced by a calibration (Batcher.calibrate), on
        a built-in prompt, and so was the acceptance by position where ``texts`` (no
        round had drafted before): as one stream's (``Arms.calibrated``), the rounds'
        first measure of each depth replaces the calibration's, and that bucket's next
        pick drafts at the limit for PROBE rounds whose acceptance replaces the
        prompt's. The depths' round costs are the machine's; the acceptance belongs to
        the texts, and where the prompt's priced plain ahead nothing but a re-check
        would measure the texts' (RECHECK_FIRST epochs later), and move it a fifth of the
        way (GAIN_DECAY).

        The calibration's rounds end here: what its last tallies and probe held is
        dropped, and the requests' first round picks the depth anew, so their first
        measures are theirs alone."""
        arms = self.arms.get(bucket)
        if arms is not None:
            arms.calibrated(list(arms.round_s), texts)
        self.tallies.clear()
        self.span, self.left, self.settling, self.unsettled = None, 0, 0, 0

    def tally(self, seconds: float, steps: Sequence[tuple[int, int, int]], n_seqs: int | None = None,
              gap: bool = False, prompt_rows: int = 0, drafter_prompt: bool = False) -> None:
        """One round that decoded sequences, at the depth in force: its wall seconds, the
        sequences it decoded (``n_seqs``; the auto ones when not given), whether their seq
        ids had a gap, the prompt rows in its target decode, whether its drafter decoded a
        new prompt's rows, and, per auto sequence, (tokens emitted, drafts, drafts accepted).
        Every PROBE rounds (and ARM_MIN_TOKENS tokens) without prompt rows of one bucket
        and depth go to that bucket's ``Arms``; rounds with them go to ``prompts``. The
        depth is picked again when its EPOCH (leader) or PROBE (another) rounds are over,
        or at once when the bucket changed."""
        if not steps:
            return
        decoded = n_seqs or len(steps)
        if decoded != self.decoded:       # a new shape: its graph is built and captured again
            self.unsettled = max(self.unsettled, RESHAPED if self.decoded else 0)
            self.decoded = decoded
        emitted = sum([step[0] for step in steps])
        bucket = (occupancy(self.sharing(decoded)), gap)
        if self.span is not None:
            self._spend(bucket, seconds, emitted, prompt_rows)
        if self.settling:          # not counted in the epoch either
            self.settling -= 1
            self.unsettled = max(0, self.unsettled - 1)
            if not self.settling and self.span is not None and self.span.ended:
                self._close_span()
            return
        if self.load_tokens > PROMPT_HORIZON:
            self.load_rows, self.load_tokens = self.load_rows / 2, self.load_tokens / 2
        self.load_rows += prompt_rows
        self.load_tokens += emitted
        key = (bucket, self.k)
        prompt = bool(prompt_rows or drafter_prompt)
        if prompt or self.unsettled:
            # beyond what its decoding costs at this depth, once that is measured here
            per = self.arms_for(bucket).round_s.get(self.k)
            if per is not None:
                self.prompts.setdefault(self.k, _Prompts()).add(seconds - decoded * per, prompt_rows)
            self.unsettled = AFTER_PROMPT if prompt else self.unsettled - 1
        else:
            t = self.tallies.get(key)
            if t is None:
                t = self.tallies[key] = _Tally()
            t.add(seconds, steps, emitted)
            # priced only where a tally could end: the pricing reads every depth's prompt
            # rows. A depth picked as the leader is checked for a cut only with its PROBE
            # rounds' observation: priced every round, the pricing was most of what a plain
            # epoch's tally cost (8 sequences, two CPU threads)
            enough = PROBE if self.leading else CUT_ROUNDS
            arms = self._priced(bucket) if t.rounds >= enough and t.tokens >= ARM_MIN_TOKENS else None
            cut = arms is not None and self._losing(arms, t)
            if arms is not None and (t.rounds >= PROBE or cut):
                # per sequence-round, so a depth's seconds a round times its tokens a round is
                # the batch's tokens a second
                arms.observe(self.k, t.tokens, t.seconds, t.seq_rounds, t.drafted_at, t.accepted_at)
                del self.tallies[key]
                if cut:
                    self.left = 0
        self.left -= 1
        if self.bucket is None:
            self.bucket = bucket
        if bucket != self.bucket or self.left <= 0:
            arms, k = self.arms_for(bucket), self.pick(bucket)
            lead = arms.leader()
            leads = arms.untried() is None and k == lead
            self.bucket, self.left, self.settling = bucket, EPOCH if leads else PROBE, SETTLE if k != self.k else 0
            self._respan(bucket, k, lead)
            self.k, self.leading = k, leads

    def _respan(self, bucket: Bucket, k: int, lead: int | None) -> None:
        """After a pick: a probe of a depth other than the leader opens a span, one that
        ends keeps it open for the SETTLE rounds after it (closed at once without them)."""
        span = self.span
        if span is not None and not span.ended and k != span.k:
            span.ended = True
            if not self.settling or k != span.lead:
                self._close_span()
        if lead is not None and k != lead and k != self.k:
            self.span = _Span(bucket, k, lead)

    def _spend(self, bucket: Bucket, seconds: float, tokens: int, rows: int) -> None:
        span = self.span
        if bucket != span.bucket:       # priced by another bucket's leader: not measured
            self.span = None
            return
        span.seconds += seconds
        span.tokens += tokens
        span.rows += rows

    def _close_span(self) -> None:
        """What the probe lost: its seconds less what the leader would have spent on its
        tokens (at the leader's seconds a token) and target prompt rows."""
        span, self.span = self.span, None
        arms = self.arms[span.bucket]
        per_token = arms.seconds(span.lead) / arms.tokens(span.lead)
        arms.lost(span.k, span.seconds - span.tokens * per_token - span.rows * self.row_seconds(span.lead))


@dataclass(eq=False)       # by identity: two idle followers of one size are not one (``leave``)
class Following:
    """The depth schedule of an engine that drafts what another engine's ``Epochs`` picks
    (``pymtp serve --engines``, ``generate_batch(engines=N)``): every engine of one model
    drafts one depth, searched and timed by the first engine alone.

    Why not an ``Epochs`` each: engines in threads share one device, and an engine's
    rounds then cost what the others' rounds make them cost. Each engine priced a depth
    by its own clock while the others drafted whatever they had picked, so a probe of
    plain decoding ran beside three engines drafting k=3 and was priced as slow: on the
    H100 (demo model, 4 engines of 2 slots, 16 clients) engine 3 priced k=3 at 1618 tok/s
    and plain at 659 at one sequence a round, the engines drafted, and auto gave 0.81x of
    plain decoding (benchmarks/README.md, session 34). With one schedule, the first
    engine's probe of a depth is a probe of every engine at that depth, so its clock
    measures what the depth costs all of them: 0.91-1.01x of the best fixed setting in
    the same passes, where an Epochs each gave 0.76-0.84x (session 35; 0.78x in a third
    run, where every depth measured alike).

    The depth is taken from the leader when a round is tallied, so one round drafts one
    depth throughout (``Rounds._auto_depth`` is read several times a round). The leader
    buckets its rounds by the sequences decoding in every engine (``Epochs.sharing``):
    each follower tells it how many its latest round decodes."""

    leader: Epochs
    k: int = 0
    decoding: int = 0        # sequences its latest round decodes (0: idle)

    def __post_init__(self) -> None:
        self.k = self.leader.k
        self.leader.followers.append(self)

    def launched(self, decoding: int) -> None:
        """A round of this engine was launched: it decodes ``decoding`` sequences, at the
        leader's depth now (an engine that idled took none from a tally meanwhile)."""
        self.decoding = decoding
        self.k = self.leader.k

    def leave(self) -> None:
        """Its engine closed: the leader counts its sequences no more."""
        if self in self.leader.followers:
            self.leader.followers.remove(self)

    @property
    def arms(self) -> dict[Bucket, Arms]:
        return self.leader.arms

    def estimates(self) -> list[tuple[Bucket, int, float, float]]:
        return self.leader.estimates()

    def tally(self, seconds: float, steps: Sequence[tuple[int, int, int]], n_seqs: int | None = None,
              gap: bool = False, prompt_rows: int = 0, drafter_prompt: bool = False) -> None:
        """A round of this engine ended (``Epochs.tally``'s arguments, which the leader's
        own rounds measure): the next one drafts the leader's depth now."""
        self.k = self.leader.k
