"""The decoding loop: prefill, then draft -> verify -> commit until a stop condition.

One loop serves every method. Plain autoregressive decoding is the same loop with a proposer
that never drafts, so the baseline is measured by the same code as the speculative methods.

The loop is batched (continuous batching, as in vLLM's v1 scheduler): `step` runs one target
forward for every sequence in the batch, and sequences join or leave between steps. Running
sequences go first, each verifying its drafts (a model drafter drafts for all of them in one
forward per pass); what is left of the step's token budget prefills waiting prompts, in chunks,
so a long prompt never stalls the decodes beside it.
Every sequence has its own KV cache and drafter state, and samples the token at each output
position with a random number fixed by its seed and that position, so its output is exactly what
it would be alone.
"""

import copy
import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from .adaptive import DraftLengthChooser, ScheduledDraftLength
from .config import DEFAULT_TOKEN_BUDGET, MAX_PROMPT_LOOKUP, BatchSizeRange
from .drafters import Proposer, propose_all
from .kv_cache import KVCache
from .model import Segment, Transformer
from .verify import DraftTree, SamplingParams, accept, position_uniforms, target_tokens


@dataclass(frozen=True)
class Request:
    prompt_ids: list[int]
    max_new_tokens: int = 128
    sampling: SamplingParams = SamplingParams()
    seed: int = 0
    stop: tuple[str, ...] = ()  # stop strings: generation ends once the text contains one
    ignore_eos: bool = False  # generate past the end-of-sequence token, up to max_new_tokens

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
        if token in self.eos_ids and not self.request.ignore_eos:
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


@dataclass
class Sequence:
    """One request inside the engine: its tokens, caches and progress."""

    request: Request
    stats: Result
    stopper: StopChecker
    cache: KVCache
    proposer: Proposer  # this sequence's own copy: drafter state is per sequence
    capacity: int
    tokens: list[int]  # prompt + committed tokens
    num_prefilled: int = 0  # prompt tokens already in the cache
    finish_reason: str | None = None
    started: float = field(default_factory=time.perf_counter)
    first_token_at: float = 0.0

    @property
    def prefilling(self) -> bool:
        return self.num_prefilled < len(self.request.prompt_ids)


class Engine:
    def __init__(self, target: Transformer, tokenizer, proposer: Proposer, eos_ids: set[int],
                 token_budget: int = DEFAULT_TOKEN_BUDGET, adaptive: bool = False,
                 schedule: list[BatchSizeRange] | None = None):
        """The drafts per sequence each step: by the batch size from `schedule` if one is given, else chosen from
        measurements if `adaptive` (adaptive.py), else what the proposer is set to."""
        if token_budget < 1:
            raise ValueError(f"the token budget per step must be >= 1, got {token_budget}")
        self.target, self.tokenizer, self.proposer, self.eos_ids = target, tokenizer, proposer, eos_ids
        self.token_budget = token_budget
        # Plain decoding (no drafts) has nothing to adapt.
        adaptive = adaptive and proposer.num_speculative_tokens > 0
        self.chooser = (ScheduledDraftLength(schedule, proposer.num_speculative_tokens) if schedule else
                        DraftLengthChooser(proposer.num_speculative_tokens) if adaptive else None)
        self.draft_length: int | None = None  # the adaptive choice of the last step (None: no sequence decoded in it)
        self.batch_drafts = True  # False: one propose() per sequence (bench --kernels times both)

    def add(self, request: Request, stats: Result | None = None) -> Sequence:
        """A new sequence, ready to join the next step; `stats`, if given, is filled as it runs."""
        # Room for the prompt, every new token and one step's drafts past the last one: a block, or a tree and the
        # copy prompt lookup adds beside it.
        capacity = len(request.prompt_ids) + request.max_new_tokens + 64 + MAX_PROMPT_LOOKUP
        proposer = copy.copy(self.proposer)  # shares the drafter's weights; begin() gives it fresh state
        proposer.begin(capacity)
        return Sequence(request, stats or Result.empty(request), StopChecker(self.tokenizer, self.eos_ids, request),
                        self.target.new_cache(capacity), proposer, capacity, list(request.prompt_ids))

    def step(self, batch: list[Sequence]) -> list[Step | None]:
        """One target forward for the batch. Returns, per sequence, what it committed, or None for a
        prompt still being prefilled. A finished sequence must leave the batch."""
        if any(sequence.finish_reason for sequence in batch):
            raise ValueError("a finished sequence cannot take another step")
        started, budget = time.perf_counter(), self.token_budget
        decoding = [sequence for sequence in batch if not sequence.prefilling]
        decode_only = len(decoding) == len(batch)  # no prompt in the batch: the chooser can time the step
        # The adaptive choice, or None: the proposer's own length.
        length = self.chooser.choose(len(decoding), decode_only) if self.chooser and decoding else None
        self.draft_length = length
        work: list[tuple[Sequence, Segment, DraftTree | None]] = []  # (sequence, its new tokens, drafts)
        proposals = propose_all(self.proposer, [(s.proposer, s.tokens, self._draft_limit(s, length)) for s in decoding],
                                self.batch_drafts)
        for sequence, drafts in zip(decoding, proposals):  # running sequences first: verify [last token, drafts...]
            # The last committed token is the tree's root: its row of logits verifies the first drafts.
            parents = None if drafts.is_chain else [-1] + [parent + 1 for parent in drafts.parents]
            new_tokens = torch.tensor(sequence.tokens[-1:] + drafts.tokens)
            work.append((sequence, Segment(new_tokens, sequence.cache, 1 + len(drafts), parents), drafts))
            budget -= 1 + len(drafts)
        for sequence in batch:
            if sequence.prefilling and budget > 0:
                start = sequence.num_prefilled
                chunk = sequence.request.prompt_ids[start : start + budget]
                completes_prompt = start + len(chunk) == len(sequence.request.prompt_ids)
                work.append((sequence, Segment(torch.tensor(chunk), sequence.cache, int(completes_prompt)), None))
                budget -= len(chunk)
        segments = [segment for _, segment, _ in work]
        outputs = self.target.forward_batch(segments, self.proposer.tap_layers)
        steps = {}
        for (sequence, segment, drafts), out in zip(work, outputs):
            if drafts is None:
                steps[id(sequence)] = self._prefilled(sequence, segment.num_tokens, out)
            else:
                steps[id(sequence)] = self._verified(sequence, drafts, out)
        if length is not None and decode_only:
            verified = [(steps[id(s)].num_draft_tokens, steps[id(s)].num_accepted) for s in decoding]
            self.chooser.record(len(decoding), length, started, time.perf_counter() - started, verified)
        return [steps.get(id(sequence)) for sequence in batch]

    def stream(self, request: Request, stats: Result | None = None) -> Iterator[Step]:
        """Yield each target forward's committed tokens for one request decoded alone."""
        sequence = self.add(request, stats)
        while sequence.finish_reason is None:
            (step,) = self.step([sequence])
            if step is not None:
                yield step

    def generate(self, request: Request) -> Result:
        result = Result.empty(request)
        for _ in self.stream(request, result):
            pass
        return result

    def _draft_limit(self, sequence: Sequence, length: int | None) -> int:
        """The most drafts worth verifying: not past max_new_tokens or the cache, nor the chosen length."""
        remaining = sequence.request.max_new_tokens - len(sequence.stopper.token_ids)
        room = sequence.capacity - sequence.cache.length - 2
        return min(remaining - 1, room) if length is None else min(remaining - 1, room, length)

    def _prefilled(self, sequence: Sequence, num_tokens: int, out) -> Step | None:
        sequence.proposer.extend_context(out.taps)
        sequence.num_prefilled += num_tokens
        if sequence.prefilling:
            return None
        first = target_tokens(out.logits, sequence.request.sampling, self._uniforms(sequence, 1)).tolist()
        sequence.tokens += first
        sequence.first_token_at = time.perf_counter()
        sequence.stats.prefill_seconds = sequence.first_token_at - sequence.started
        return self._commit(sequence, first, 0, 0)

    def _verified(self, sequence: Sequence, drafts: DraftTree, out) -> Step:
        request = sequence.request
        uniforms = self._uniforms(sequence, 1 + max(drafts.depths, default=0))
        committed, accepted = accept(drafts, out.logits, request.sampling, uniforms)
        num_accepted = len(accepted)
        # The cache now holds the last committed token and every draft; keep that token and the
        # accepted branch, moved to follow it. The bonus token is not in the cache yet: it opens
        # the next block. The drafter's context grows by the same tokens' target features.
        root = sequence.cache.length - len(drafts) - 1
        sequence.cache.keep(root + 1, [root + 1 + index for index in accepted])
        if out.taps is not None:  # a chain's accepted rows lead its block: a view, not a copy (every step pays this)
            chain = accepted == list(range(num_accepted))
            sequence.proposer.extend_context(out.taps[: 1 + num_accepted] if chain else
                                             out.taps[[0] + [1 + index for index in accepted]])
        sequence.tokens += committed
        _record(sequence.stats, len(drafts), num_accepted)
        return self._commit(sequence, committed, len(drafts), num_accepted)

    def _uniforms(self, sequence: Sequence, count: int) -> torch.Tensor | None:
        """Random numbers for the next `count` output positions of a sampled request (none for greedy)."""
        request = sequence.request
        if request.sampling.temperature == 0:
            return None
        return position_uniforms(request.seed, len(sequence.tokens) - len(request.prompt_ids), count)

    def _commit(self, sequence: Sequence, committed: list[int], num_draft_tokens: int, num_accepted: int) -> Step:
        stopper, emitted = sequence.stopper, []
        for token in committed:
            before = len(stopper.token_ids)
            sequence.finish_reason = stopper.add(token)
            emitted += stopper.token_ids[before:]
            if sequence.finish_reason:
                stats = sequence.stats
                stats.decode_seconds = time.perf_counter() - sequence.first_token_at
                stats.token_ids, stats.text, stats.finish_reason = stopper.token_ids, stopper.text(), sequence.finish_reason
                break
        return Step(emitted, num_draft_tokens, num_accepted, sequence.finish_reason)


def _record(stats: Result, num_draft_tokens: int, num_accepted: int) -> None:
    stats.target_forwards += 1
    if num_draft_tokens:
        stats.num_drafts += 1
        stats.num_draft_tokens += num_draft_tokens
        stats.num_accepted_tokens += num_accepted
        stats.accepted_per_position += [0] * (num_draft_tokens - len(stats.accepted_per_position))
        for position in range(num_accepted):
            stats.accepted_per_position[position] += 1

