"""A draft-length schedule (numSpeculativeTokensPerBatchSize) from measured curves. Pure and torch-free: `specserve
bench --propose-schedule` and the operator (spec.speculationHealth.schedule) both call `propose`.

Input: per draft length k (0: plain decoding), the per-request decode rate against concurrency (a performance
table's curve: `specserve bench --concurrency ... --emit-performance`, or a revision's measured windows). At a
batch of b requests a replica generates b x rate_k(b) tokens per second, so per batch size the k with the highest
rate has the most tokens per dollar. It also has the lowest time per token at that batch size: tokens per dollar
and latency order the draft lengths the same way there, so the schedule cannot trade the SLO for cost; the SLO
decides how many replicas serve (the autoscaler), the schedule how each of them decodes.

Between measured concurrencies the rates are linear; below the first and above the last they hold their end
values, so the last measured choice covers every larger batch (the schedule's open range). The schedule never
drafts more at a larger batch: each extra request makes a verify step's extra tokens dearer (the target's forward
turns from reading weights to arithmetic) while what a draft yields stays the same, so a longer length that wins
only at a larger batch than a shorter one is measurement noise, not a regime.
"""

from bisect import bisect_right
from collections.abc import Mapping, Sequence

from .config import BatchSizeRange, scheduled_tokens
from .performance import CurvePoint


def rate(curve: Sequence[CurvePoint], concurrency: float) -> float:
    """Tokens per second of each request at this concurrency: linear between the points, held past the ends."""
    return linear([p.concurrency for p in curve], [p.tokens_per_second_per_request for p in curve], concurrency)


def linear(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """ys against increasing xs at x: linear between the points, held past the ends (a performance curve's reading,
    here and in the simulator's fleet)."""
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    i = bisect_right(xs, x)
    return ys[i - 1] + (ys[i] - ys[i - 1]) * (x - xs[i - 1]) / (xs[i] - xs[i - 1])


def highest_concurrency(curves: Mapping[int, Sequence[CurvePoint]]) -> int:
    """The batch sizes a schedule is chosen or read at: 1 up to the highest concurrency measured."""
    return max(1, max(int(point.concurrency) for curve in curves.values() for point in curve))


def best_length(curves: Mapping[int, Sequence[CurvePoint]], batch_size: int, longest: int | None = None) -> int:
    """The draft length (at most `longest`) with the highest rate at this batch size; on a tie the fewer drafts."""
    lengths = [k for k in curves if longest is None or k <= longest]
    return max(lengths, key=lambda k: (rate(curves[k], batch_size), -k))


def propose(curves: Mapping[int, Sequence[CurvePoint]]) -> list[BatchSizeRange]:
    """The schedule that drafts, at every batch size up to the highest measured concurrency, the draft length with
    the most tokens per second there among those no longer than the smaller batches', and the last one beyond:
    consecutive batch sizes with one length share a range."""
    if not curves or not any(curves.values()):
        raise ValueError("a schedule needs at least one measured curve")
    ranges: list[BatchSizeRange] = []
    for batch_size in range(1, highest_concurrency(curves) + 1):
        k = best_length(curves, batch_size, ranges[-1].num_speculative_tokens if ranges else None)
        if ranges and ranges[-1].num_speculative_tokens == k:
            ranges[-1].max_batch_size = batch_size
        else:
            ranges.append(BatchSizeRange(min_batch_size=batch_size, max_batch_size=batch_size, num_speculative_tokens=k))
    ranges[-1].max_batch_size = None
    return ranges


def scheduled_curve(curves: Mapping[int, Sequence[CurvePoint]], schedule: Sequence[BatchSizeRange]) -> list[CurvePoint]:
    """What a replica drafting by `schedule` does: at each batch size up to the highest measured concurrency, the
    rate and time to first token of the length the schedule drafts there (a length it names must be measured)."""
    missing = sorted({r.num_speculative_tokens for r in schedule} - set(curves))
    if missing:
        raise ValueError(f"no measured curve for draft length(s) {missing} of the schedule {describe(schedule)}")
    return [CurvePoint.model_validate({"concurrency": b, "tokensPerSecondPerRequest": rate(curve, b),
                                       "ttftMs": linear([p.concurrency for p in curve], [p.ttft_ms for p in curve], b)})
            for b in range(1, highest_concurrency(curves) + 1) for curve in [curves[scheduled_tokens(list(schedule), b)]]]


def describe(schedule: Sequence[BatchSizeRange]) -> str:
    """The command line's form (config.parse_schedule reads it back): 1-4:3,5-:0."""
    return ",".join(f"{r.min_batch_size}-{'' if r.max_batch_size is None else r.max_batch_size}:{r.num_speculative_tokens}"
                    for r in schedule)
