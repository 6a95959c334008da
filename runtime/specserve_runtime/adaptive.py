"""How many tokens to draft per sequence in the next step, chosen from measurements under the current load.

Speculation pays when the extra tokens a step verifies cost less than the drafts it gets accepted.
Both sides move with load: a bigger batch makes each extra verified token dearer (the step stops
being memory-bound), and the cost curve differs by machine (docs/benchmarks.md: on one CPU
verifying 3 tokens costs 1.1x a plain step, on another 2.1x, and 4 tokens cost less than 3). So the
rule measures instead of modelling: for each batch size (in buckets 1, 2, 3-4, 5-8, ...) it keeps
the committed tokens per second of every draft length 0..K, a moving average over the decode steps
that used it, and uses the best. Every untried length is tried once first, and every EXPLORE_EVERY
steps of a bucket the least recently measured length is tried again, so the table follows changes
in load and in the text being generated. Length 0 (plain decoding) is always a candidate: a loaded
server does not stay slower than plain decoding, apart from those exploring steps.

Only the speed changes: every draft is still verified, so the output is the same at any length.
"""

EXPLORE_EVERY = 32  # decode steps of a batch-size bucket between two exploring steps
SMOOTHING = 0.2  # weight of the newest measurement in the moving average


def batch_bucket(batch_size: int) -> int:
    """1, 2, 4, 8, ...: the smallest power of two >= batch_size."""
    return 1 << (batch_size - 1).bit_length()


class DraftLengthChooser:
    def __init__(self, max_drafts: int):
        if max_drafts < 1:
            raise ValueError(f"adaptive speculation needs a proposer that drafts, got max_drafts={max_drafts}")
        self.max_drafts = max_drafts
        self.rates: dict[tuple[int, int], float] = {}  # (bucket, length) -> committed tokens per second
        self.measured_at: dict[tuple[int, int], int] = {}  # (bucket, length) -> the bucket's step count then
        self.steps: dict[int, int] = {}  # bucket -> decode steps measured

    def choose(self, batch_size: int) -> int:
        bucket = batch_bucket(batch_size)
        lengths = range(self.max_drafts, -1, -1)  # untried lengths from the longest: the proposer's own setting first
        untried = [length for length in lengths if (bucket, length) not in self.rates]
        if untried:
            return untried[0]
        if self.steps[bucket] % EXPLORE_EVERY == EXPLORE_EVERY - 1:
            return min(lengths, key=lambda length: self.measured_at[(bucket, length)])
        return max(lengths, key=lambda length: self.rates[(bucket, length)])

    def record(self, batch_size: int, length: int, committed_tokens: int, seconds: float) -> None:
        """A decode step (no prompt chunk in it) that drafted up to `length` tokens per sequence."""
        bucket, rate = batch_bucket(batch_size), committed_tokens / max(seconds, 1e-9)
        key = (bucket, length)
        self.rates[key] = rate if key not in self.rates else (1 - SMOOTHING) * self.rates[key] + SMOOTHING * rate
        self.steps[bucket] = self.steps.get(bucket, 0) + 1
        self.measured_at[key] = self.steps[bucket]
