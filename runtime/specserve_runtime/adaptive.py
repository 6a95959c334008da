"""How many tokens to draft per sequence in the next step, from the batch size and the measured
per-position acceptance.

A step that drafts L tokens per sequence commits, per sequence, 1 + p_1 + ... + p_L tokens on
average, where p_i is the chance that the first i drafts are all accepted; it costs r(B, L) times
a step without drafts at the same batch size B (draft and verify: a bigger batch makes each extra
verified token dearer, and the curve differs by machine, see docs/benchmarks.md). The rule drafts
the L in 0..K that maximises

    (1 + p_1 + ... + p_L) / r(B, L)        with r(B, 0) = 1.

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
new shape also pays for kernel selection). Each bucket starts by pairing every
length MIN_PAIRS times with a step without drafts, longest first, and every EXPLORE_EVERY steps it
re-measures the least recently paired length (a step at that length, then one at 0); the longest
length's steps also refresh p_K. Length 0 (plain decoding) is always a candidate.

Only the speed changes: every draft is still verified, so the output is the same at any length.
"""

import statistics

EXPLORE_EVERY = 32  # decode steps of a batch-size bucket between two exploring pairs
RATIO_SAMPLES = 5  # cost-ratio pairs kept per (bucket, length); their median is r(B, L)
MIN_PAIRS = 3  # pairs per length before a bucket trusts its ratio
ACCEPTANCE_DECAY = 0.01  # per decode step: the acceptance counts forget the text of ~100 steps ago
MAX_PAIR_GAP = 1.0  # seconds between two steps that still share the machine's speed (it drifts over tens)


def batch_bucket(batch_size: int) -> int:
    """1, 2, 4, 8, ...: the smallest power of two >= batch_size."""
    return 1 << (batch_size - 1).bit_length()


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
        self.previous: tuple[int, int, float, float] | None = None  # the last decode step: (batch size, L, seconds, ended at)

    def acceptance(self, position: int) -> float:
        """p_position: the measured chance that drafts 1..position are all accepted (0 unmeasured)."""
        return self.accepted[position] / self.offered[position] if self.offered[position] > 0 else 0.0

    def expected_tokens(self, length: int) -> float:
        """Tokens a sequence commits per step when it drafts `length`: 1 + p_1 + ... + p_length."""
        return 1 + sum(self.acceptance(i) for i in range(1, length + 1))

    def choose(self, batch_size: int) -> int:
        bucket = batch_bucket(batch_size)
        lengths = range(self.max_drafts, 0, -1)
        if self._pair_due(batch_size):  # the second step of a pair: without drafts, right after it
            return 0
        unpaired = [length for length in lengths if len(self.ratios.get((bucket, length), ())) < MIN_PAIRS]
        if unpaired:
            return unpaired[0]
        if self.steps.get(bucket, 0) % EXPLORE_EVERY == EXPLORE_EVERY - 1:
            return min(lengths, key=lambda length: self.paired_at[(bucket, length)])
        return max(range(self.max_drafts + 1), key=lambda length: self.expected_tokens(length) / self.cost(bucket, length))

    def cost(self, bucket: int, length: int) -> float:
        """r(B, L): a step drafting `length` against one without drafts, at this batch-size bucket."""
        return statistics.median(self.ratios[(bucket, length)]) if length else 1.0

    def _pair_due(self, batch_size: int) -> bool:
        """Whether the previous step drafted, at this batch size, and still needs its step without
        drafts (an unpaired length, an exploring one, or the chosen one, due again)."""
        if self.previous is None:
            return False
        previous_batch_size, length, _, _ = self.previous
        if previous_batch_size != batch_size or length == 0:
            return False
        bucket = batch_bucket(batch_size)
        key = (bucket, length)
        return len(self.ratios.get(key, ())) < MIN_PAIRS or self.paired_at[key] < self.steps[bucket] - EXPLORE_EVERY

    def record(self, batch_size: int, length: int, started_at: float, seconds: float,
               verified: list[tuple[int, int]]) -> None:
        """A decode step (no prompt chunk in it) that offered `length` draft positions to each of
        `batch_size` sequences, started at `started_at` (a monotonic clock) and took `seconds`;
        `verified`: each sequence's (drafts verified, drafts accepted)."""
        bucket = batch_bucket(batch_size)
        for i in range(1, self.max_drafts + 1):
            self.offered[i] *= 1 - ACCEPTANCE_DECAY
            self.accepted[i] *= 1 - ACCEPTANCE_DECAY
        for _, num_accepted in verified:
            for i in range(1, length + 1):  # a position without a guess counts as offered and not accepted
                self.offered[i] += 1
                self.accepted[i] += i <= num_accepted
        self.steps[bucket] = self.steps.get(bucket, 0) + 1
        if self.previous is not None:
            previous_batch_size, previous_length, previous_seconds, previous_end = self.previous
            adjacent = started_at - previous_end <= MAX_PAIR_GAP
            if adjacent and previous_batch_size == batch_size and (previous_length == 0) != (length == 0):  # one drafted, one not
                drafting, with_drafts, without = ((length, seconds, previous_seconds) if length
                                                  else (previous_length, previous_seconds, seconds))
                key = (bucket, drafting)
                self.ratios[key] = (self.ratios.get(key, []) + [with_drafts / max(without, 1e-9)])[-RATIO_SAMPLES:]
                self.paired_at[key] = self.steps[bucket]
        self.previous = (batch_size, length, seconds, started_at + seconds)
