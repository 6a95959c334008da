"""The decoding loop: prefill, then draft -> verify -> commit until a stop condition.

One loop serves every method. Plain autoregressive decoding is the same loop with a proposer
that never drafts, so the baseline is measured by the same code as the speculative methods.
"""

import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from .drafters import Proposer
from .model import Transformer
from .verify import SamplingParams, accept, target_tokens


@dataclass(frozen=True)
class Request:
    prompt_ids: list[int]
    max_new_tokens: int = 128
    sampling: SamplingParams = SamplingParams()
    seed: int = 0
    stop: tuple[str, ...] = ()  # stop strings: generation ends once the text contains one

    def __post_init__(self):
        if not self.prompt_ids:
            raise ValueError("the prompt is empty")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass
class Step:
    """What one target forward committed (the first step is the prefill's token)."""

    token_ids: list[int]  # tokens emitted to the user (EOS and anything past a stop are withheld)
    num_draft_tokens: int
    num_accepted: int
    finish_reason: str | None  # None while running, then "stop" or "length"


@dataclass
class Result:
    token_ids: list[int]
    text: str
    finish_reason: str
    prompt_tokens: int
    target_forwards: int  # verify forwards after the prefill
    num_drafts: int  # forwards that verified at least one draft token
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_position: list[int] = field(default_factory=list)  # accepted counts by draft position
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0

    @classmethod
    def empty(cls, request: "Request") -> "Result":
        return cls([], "", "", len(request.prompt_ids), 0, 0, 0, 0)

    @property
    def acceptance_length(self) -> float:
        """Tokens committed per verify forward, the target's own (bonus) token included."""
        return 1 + self.num_accepted_tokens / self.target_forwards if self.target_forwards else 0.0


class StopChecker:
    """Feeds committed tokens one by one and says when and why generation ends."""

    def __init__(self, tokenizer, eos_ids: set[int], request: Request):
        self.tokenizer, self.eos_ids, self.request = tokenizer, eos_ids, request
        self.token_ids: list[int] = []
        self.stop_at: int | None = None  # character offset of a matched stop string

    def add(self, token: int) -> str | None:
        if token in self.eos_ids:
            return "stop"
        self.token_ids.append(token)
        if self.request.stop and self._find_stop() is not None:
            return "stop"
        if len(self.token_ids) >= self.request.max_new_tokens:
            return "length"
        return None

    def _find_stop(self) -> int | None:
        text = self.text(truncate=False)
        hits = [i for i in (text.find(s) for s in self.request.stop) if i >= 0]
        self.stop_at = min(hits) if hits else None
        return self.stop_at

    def text(self, truncate: bool = True) -> str:
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        return text[: self.stop_at] if truncate and self.stop_at is not None else text


class Engine:
    def __init__(self, target: Transformer, tokenizer, proposer: Proposer, eos_ids: set[int]):
        self.target, self.tokenizer, self.proposer, self.eos_ids = target, tokenizer, proposer, eos_ids

    def stream(self, request: Request, stats: Result | None = None) -> Iterator[Step]:
        """Yield each target forward's committed tokens; `stats`, if given, is filled as it goes."""
        target, proposer = self.target, self.proposer
        stats = stats or Result.empty(request)
        stopper = StopChecker(self.tokenizer, self.eos_ids, request)
        generator = torch.Generator().manual_seed(request.seed)
        # Room for the prompt, every new token and one block of drafts past the last one.
        capacity = len(request.prompt_ids) + request.max_new_tokens + 64
        cache = target.new_cache(capacity)
        proposer.begin(capacity)

        started = time.perf_counter()
        out = target(torch.tensor(request.prompt_ids), cache, proposer.tap_layers, last_logits_only=True)
        proposer.extend_context(out.taps)
        tokens = list(request.prompt_ids) + target_tokens(out.logits, request.sampling, generator).tolist()
        stats.prefill_seconds = time.perf_counter() - started
        step = _commit(stopper, tokens[-1:], 0, 0)
        yield step

        started = time.perf_counter()
        while step.finish_reason is None:
            remaining = request.max_new_tokens - len(stopper.token_ids)
            drafts = proposer.propose(tokens, max_drafts=min(remaining - 1, capacity - cache.length - 2))
            # Verify [last committed token, drafts...] in one forward at positions cache.length...
            out = target(torch.tensor(tokens[-1:] + drafts), cache, proposer.tap_layers)
            committed = accept(torch.tensor(drafts, dtype=torch.long), out.logits, request.sampling, generator)
            num_accepted = len(committed) - 1
            # The cache now holds the whole block; keep the last committed token and the accepted
            # drafts. The bonus token is not in the cache yet: it opens the next block.
            cache.crop(cache.length - len(drafts) + num_accepted)
            proposer.extend_context(None if out.taps is None else out.taps[: num_accepted + 1])
            tokens += committed
            _record(stats, len(drafts), num_accepted)
            step = _commit(stopper, committed, len(drafts), num_accepted)
            yield step
        stats.decode_seconds = time.perf_counter() - started
        stats.token_ids, stats.text, stats.finish_reason = stopper.token_ids, stopper.text(), step.finish_reason

    def generate(self, request: Request) -> Result:
        result = Result.empty(request)
        for _ in self.stream(request, result):
            pass
        return result


def _commit(stopper: StopChecker, committed: list[int], num_draft_tokens: int, num_accepted: int) -> Step:
    emitted, finish_reason = [], None
    for token in committed:
        before = len(stopper.token_ids)
        finish_reason = stopper.add(token)
        emitted += stopper.token_ids[before:]
        if finish_reason:
            break
    return Step(emitted, num_draft_tokens, num_accepted, finish_reason)


def _record(stats: Result, num_draft_tokens: int, num_accepted: int) -> None:
    stats.target_forwards += 1
    if num_draft_tokens:
        stats.num_drafts += 1
        stats.num_draft_tokens += num_draft_tokens
        stats.num_accepted_tokens += num_accepted
        stats.accepted_per_position += [0] * (num_draft_tokens - len(stats.accepted_per_position))
        for position in range(num_accepted):
            stats.accepted_per_position[position] += 1

