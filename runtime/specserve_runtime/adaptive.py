"""How many tokens to draft per sequence in the next step, from the batch size and the measured
per-position acceptance.

A step that drafts L tokens per sequence commits, per sequence, 1 + p_1 + ... + p_L tokens on
average, where p_i is the chance that the first i drafts are all accepted; it costs r(B, L) times
a step without drafts at the same batch size B (draft and verify: a bigger batch makes each extra
verified token dearer, and the curve differs by machine, see
docs/benchmarks.md, "What a step costs"). The rule takes the L in 1..K that maximises

    (1 + p_1 + ... + p_L) / r(B, L)

and drafts it only if that beats plain decoding (L = 0, where it is 1) by MIN_GAIN, 5%. Near
break-even, which is where a loaded server's drafting sits, the lengths' estimates differ by less
than their noise, and the argmax of noisy estimates is on average worse than its estimate says
(the winner's curse): drafting there would lose a few percent, and it lengthens every step of the
batch, that is every sequence's inter-token latency.

Both sides are measured, and neither from tokens per second across time: this machine's speed
drifts by tens of percent over a minute, so a length timed in a fast minute would beat one timed in
a slow one. p_i is counted from every decode step's verification over every sequence that was
offered position i, whether or not its drafter found a guess for it (an n-gram drafter often finds
none: counting only the sequences that drafted would promise tokens the step does not commit); it
is a property of the text, with a memory of about 1 / ACCEPTANCE_DECAY steps. r(B, L) is the ratio
of the times of two adjacent decode steps of the same batch size, one drafting L and one not, which
share the machine's speed of that moment (steps with an idle gap of more than MAX_PAIR_GAP between
them are not adjacent). Served, the batch size moves every few steps (a request ends, a prompt
joins), and two steps of 12 and 16 sequences differ by a third in time: a ratio across them would
be a batch-size effect, not the cost of drafting. The ratios are kept per batch-size bucket (1, 2,
4, 8, ...); the median of a bucket's last RATIO_SAMPLES pairs drops the rest (the first step at a
new shape also pays for kernel selection).

The drafting step of a pair is timed only when the step before it drafted too: a drafter that sat
out steps (EAGLE-3, DFlash) first runs every target feature committed while it was idle through its
context layers, a catch-up that grows with the idle steps (DFlash's context projection for 16
sequences: 8 ms after 32 idle steps, 67 ms after 256, where a plain step of 16 takes 42 ms on the
same CPU) and that drafting every step never pays. So a pair is three steps: L (the catch-up), L
(timed), 0 (timed).

Each bucket starts by pairing every length MIN_PAIRS times, longest first, or one time fewer for a
length that loses even at the lowest of its ratios so far (no last pair could make it win: where
drafting is at break-even, the pairs of losing lengths are what learning costs). Then it explores: it
re-measures the least recently paired length, first EXPLORE_EVERY steps after the last exploring
pair, and each time that pair leaves the choice as it was (its ratio on its own would not beat the
chosen length) the wait doubles, up to MAX_EXPLORE_EVERY: on a loaded server where drafting loses,
the exploring steps, which cost up to twice a plain step, fall from one in 32 steps to one in 256.
A pair whose ratio on its own would change the choice brings the wait back to EXPLORE_EVERY, so a
length that became cheaper is confirmed within a few periods (the median needs three new pairs).
But never sooner than the pair's own cost allows: what its drafting steps (the catch-up and the
timed one) took beyond plain steps for the same tokens, counted in plain steps, over
EXPLORE_BUDGET. Near break-even a single pair's noisy ratio often says its length would win, and
exploring every 32 steps with catch-ups of several plain steps each cost a loaded server 5-6% of
its time; the budget holds it to about 1%.
The chosen length itself is re-paired every EXPLORE_EVERY steps. Length 0 (plain decoding) is
always a candidate. A step that also prefills a prompt chunk is never recorded (its time is mostly
the prompt's), so it drafts the bucket's best length and begins no pair.

A bigger batch makes drafting dearer, never cheaper: r(2B, L) >= r(B, L). A small batch's step is
mostly reading the weights, which extra verified tokens do not add to; a big batch's is mostly
arithmetic, which they do. So a length whose gain, at the cost measured at the nearest smaller
bucket, does not beat the margin cannot win at this one, and the bucket neither learns nor
explores it: on a loaded server where drafting loses, those pairs (up to 2.5x a plain step each,
and a catch-up of several more for a drafter that sat out) were what kept speculation below plain
decoding. The bound follows the acceptance: when the
text gets easier and the smaller bucket drafts again, the length is learned.

Only the speed changes: every draft is still verified, so the output is the same at any length.
"""

import math
import statistics
from dataclasses import dataclass

from .config import BatchSizeRange, scheduled_tokens

EXPLORE_EVERY = 32  # decode steps of a batch-size bucket between two exploring pairs, at first
MAX_EXPLORE_EVERY = 256  # ... and at most, once exploring keeps confirming the choice
EXPLORE_BUDGET = 0.01  # the share of a bucket's steps that exploring pairs may cost beyond plain decoding
RATIO_SAMPLES = 5  # cost-ratio pairs kept per (bucket, length); their median is r(B, L)
MIN_PAIRS = 3  # pairs per length before a bucket trusts its ratio
ACCEPTANCE_DECAY = 0.01  # per decode step: the acceptance counts forget the text of ~100 steps ago
MIN_GAIN = 1.05  # drafting must promise this much more than plain decoding's tokens per second
MAX_PAIR_GAP = 1.0  # seconds between two steps that still share the machine's speed (it drifts over tens)


def batch_bucket(batch_size: int) -> int:
    """1, 2, 4, 8, ...: the smallest power of two >= batch_size."""
    return 1 << (batch_size - 1).bit_length()


@dataclass(frozen=True)
class DecodeStep:
    batch_size: int
    length: int  # drafts offered per sequence
    seconds: float
    ended_at: float
    after_drafting: bool  # the step before it drafted, at the same batch size: the drafter's context was current
    tokens: int  # committed: one per sequence and its accepted drafts


class ScheduledDraftLength:
    """The drafts per sequence a batch-size schedule gives (numSpeculativeTokensPerBatchSize), at most the
    proposer's: chosen by whoever wrote the schedule, where DraftLengthChooser learns it."""

    def __init__(self, schedule: list[BatchSizeRange], max_drafts: int):
        self.schedule, self.max_drafts = schedule, max_drafts

    def choose(self, batch_size: int, timed: bool = True) -> int:
        return min(scheduled_tokens(self.schedule, batch_size), self.max_drafts)

    def record(self, batch_size: int, length: int, started_at: float, seconds: float,
               verified: list[tuple[int, int]]) -> None:
        pass  # a schedule learns nothing


class DraftLengthChooser:
    def __init__(self, max_drafts: int):
        if max_drafts < 1:
            raise ValueError(f"adaptive speculation needs a proposer that drafts, got max_drafts={max_drafts}")
        self.max_drafts = max_drafts
        self.offered = [0.0] * (max_drafts + 1)  # [i]: sequences offered draft position i (decayed), i >= 1
        self.accepted = [0.0] * (max_drafts + 1)  # [i]: ... and had drafts 1..i all accepted
        self.ratios: dict[tuple[int, int], list[float]] = {}  # (bucket, L) -> the last pairs' r(B, L), L >= 1
        self.paired_at: dict[tuple[int, int], int] = {}  # (bucket, L) -> the bucket's step count at its last pair
        self.steps: dict[int, int] = {}  # bucket -> decode steps recorded
        self.explore_every: dict[int, int] = {}  # bucket -> steps from one exploring pair to the next
        self.explored_at: dict[int, int] = {}  # bucket -> its step count when the last exploring pair began
        self.exploring: dict[int, int] = {}  # bucket -> the length of the exploring pair under way
        self.previous: DecodeStep | None = None
        self.before_previous: DecodeStep | None = None

    def acceptance(self, position: int) -> float:
        """p_position: the measured chance that drafts 1..position are all accepted (0 unmeasured)."""
        return self.accepted[position] / self.offered[position] if self.offered[position] > 0 else 0.0

    def expected_tokens(self, length: int) -> float:
        """Tokens a sequence commits per step when it drafts `length`: 1 + p_1 + ... + p_length."""
        return 1 + sum(self.acceptance(i) for i in range(1, length + 1))

    def cost(self, bucket: int, length: int) -> float:
        """r(B, L): a step drafting `length` against one without drafts, at this batch-size bucket."""
        return statistics.median(self.ratios[(bucket, length)]) if length else 1.0

    def choose(self, batch_size: int, timed: bool = True) -> int:
        """The drafts per sequence for the next step of `batch_size` decoding sequences. A step that
        also prefills a prompt chunk (`timed` False) is not recorded, so it can be no step of a pair:
        it drafts the bucket's best length and begins nothing (a catch-up or an exploring length
        there would be paid for and never measured)."""
        return self._plan(batch_size)[0] if timed else self._best(batch_bucket(batch_size))

    def _plan(self, batch_size: int) -> tuple[int, bool]:
        """The next step's length, and whether it begins an exploring pair."""
        bucket = batch_bucket(batch_size)
        pair_length = self._pair_due(batch_size)
        if pair_length is not None:
            return pair_length, False
        candidates = [length for length in range(self.max_drafts, 0, -1) if self._can_win(bucket, length)]
        unpaired = [length for length in candidates if not self._trusted(bucket, length)]
        if unpaired:
            return unpaired[0], False
        steps = self.steps.get(bucket, 0)
        if candidates and steps - self.explored_at.get(bucket, 0) >= self.explore_every.get(bucket, EXPLORE_EVERY):
            return min(candidates, key=lambda length: self.paired_at[(bucket, length)]), True
        return self._best(bucket), False

    def _trusted(self, bucket: int, length: int) -> bool:
        """Whether the bucket's ratios for `length` decide: MIN_PAIRS of them, or one fewer when the
        length loses even at the lowest of those. A last ratio, however low, leaves the median of
        MIN_PAIRS >= 3 ratios at or above the lowest of the others: no last pair could make the
        length win, so it is not paid for."""
        ratios = self.ratios.get((bucket, length), ())
        if len(ratios) >= MIN_PAIRS:
            return True
        return len(ratios) == MIN_PAIRS - 1 and self.expected_tokens(length) <= MIN_GAIN * min(ratios)

    def _can_win(self, bucket: int, length: int) -> bool:
        """False if `length` cannot beat the margin at this bucket even at the cost measured at the
        nearest smaller bucket that trusts one (drafting only gets dearer with the batch)."""
        smaller = bucket // 2
        while smaller >= 1 and not self._trusted(smaller, length):
            smaller //= 2
        return smaller < 1 or self._gain(smaller, length) > MIN_GAIN

    def _gain(self, bucket: int, length: int) -> float:
        """Tokens per plain step's time when drafting `length`; plain decoding counts as MIN_GAIN, the
        margin drafting must beat."""
        return self.expected_tokens(length) / self.cost(bucket, length) if length else MIN_GAIN

    def _best(self, bucket: int) -> int:
        """The length to draft: the best of plain decoding and the lengths this bucket trusts and that
        can still win here."""
        lengths = [0] + [length for length in range(1, self.max_drafts + 1)
                         if self._trusted(bucket, length) and self._can_win(bucket, length)]
        return max(lengths, key=lambda length: self._gain(bucket, length))  # a tie: the shorter

    def _pair_due(self, batch_size: int) -> int | None:
        """The rest of a pair the previous step began at this batch size: its length again if that
        step was the catch-up, 0 if it was the timed one; None if no pair is under way. A length
        is paired while it has fewer than MIN_PAIRS ratios, when exploring, and when it was chosen
        and its last pair is more than EXPLORE_EVERY steps old."""
        previous = self.previous
        if previous is None or previous.batch_size != batch_size or previous.length == 0:
            return None
        bucket = batch_bucket(batch_size)
        key = (bucket, previous.length)
        if (not self._trusted(bucket, previous.length) or self.exploring.get(bucket) == previous.length
                or self.paired_at[key] < self.steps[bucket] - EXPLORE_EVERY):
            return 0 if previous.after_drafting else previous.length
        return None

    def record(self, batch_size: int, length: int, started_at: float, seconds: float,
               verified: list[tuple[int, int]]) -> None:
        """A decode step (no prompt chunk in it) that offered `length` draft positions to each of
        `batch_size` sequences, started at `started_at` (a monotonic clock) and took `seconds`;
        `verified`: each sequence's (drafts verified, drafts accepted)."""
        bucket = batch_bucket(batch_size)
        planned, exploring = self._plan(batch_size)
        if exploring and length == planned:
            self.explored_at[bucket], self.exploring[bucket] = self.steps.get(bucket, 0), length
        for i in range(1, self.max_drafts + 1):
            self.offered[i] *= 1 - ACCEPTANCE_DECAY
            self.accepted[i] *= 1 - ACCEPTANCE_DECAY
        for _, num_accepted in verified:
            for i in range(1, length + 1):  # a position without a guess counts as offered and not accepted
                self.offered[i] += 1
                self.accepted[i] += i <= num_accepted
        self.steps[bucket] = self.steps.get(bucket, 0) + 1
        previous = self.previous
        adjacent = (previous is not None and previous.batch_size == batch_size
                    and started_at - previous.ended_at <= MAX_PAIR_GAP)
        if adjacent and previous.length and previous.after_drafting and length == 0:
            key, ratio = (bucket, previous.length), previous.seconds / max(seconds, 1e-9)
            self.ratios[key] = (self.ratios.get(key, []) + [ratio])[-RATIO_SAMPLES:]
            self.paired_at[key] = self.steps[bucket]
            if self.exploring.get(bucket) == previous.length:
                self._explored(bucket, previous.length, ratio, self._pair_cost(batch_size, seconds))
        tokens = batch_size + sum(num_accepted for _, num_accepted in verified)
        self.before_previous, self.previous = previous, DecodeStep(
            batch_size, length, seconds, started_at + seconds, after_drafting=adjacent and previous.length > 0,
            tokens=tokens)

    def _pair_cost(self, batch_size: int, plain_seconds: float) -> float:
        """What the pair that the step of `plain_seconds` ends took beyond plain decoding, in plain
        steps: its drafting steps' time (the timed one, and the catch-up before it if the drafter had
        sat out) less what plain steps would have taken for the tokens they committed."""
        timed, before = self.previous, self.before_previous
        # `timed` drafted right after `before`, at this batch size (its after_drafting); `before` was
        # the pair's catch-up if the drafter had sat out before it.
        drafting = [timed] + ([before] if not before.after_drafting and before.length == timed.length else [])
        plain_time = sum(step.tokens for step in drafting) / batch_size * plain_seconds
        return (sum(step.seconds for step in drafting) - plain_time) / max(plain_seconds, 1e-9)

    def _explored(self, bucket: int, length: int, ratio: float, cost: float) -> None:
        """An exploring pair of `length` measured `ratio` and cost `cost` plain steps beyond plain
        decoding: explore again soon if, on its own, that ratio would make `length` the choice,
        otherwise wait twice as long as last time; and at least as long as the budget needs."""
        del self.exploring[bucket]
        best = self._best(bucket)
        if best == length or self.expected_tokens(length) / ratio > self._gain(bucket, best):
            wait = EXPLORE_EVERY
        else:
            wait = min(2 * self.explore_every.get(bucket, EXPLORE_EVERY), MAX_EXPLORE_EVERY)
        self.explore_every[bucket] = max(wait, math.ceil(cost / EXPLORE_BUDGET))
