"""Verification of draft tokens against the target: pure functions, no model state.

Terms (as in vLLM's rejection sampler):
- draft tokens: the k tokens a proposer guessed after the last committed token;
- accepted tokens: the longest prefix of the drafts that the target agrees with;
- bonus token: the target's own token right after the accepted prefix (on a full accept,
  the token after the last draft). Every step commits accepted + 1 tokens.
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


def position_uniforms(seed: int, first_position: int, count: int) -> torch.Tensor:
    """The uniform random numbers [count] that sample the tokens at output positions first_position...

    Each is a function of (seed, position) alone: however many tokens a step verifies (speculation,
    any draft length, or none), the token at position p is drawn with the same number, so a seeded
    sampled request gives the same text with every method, draft length and batch.
    """
    return torch.tensor([
        torch.rand((), dtype=torch.float64, generator=torch.Generator().manual_seed(_mix(seed, position))).item()
        for position in range(first_position, first_position + count)
    ], dtype=torch.float64)


def _mix(seed: int, position: int) -> int:
    return (seed * 0x9E3779B97F4A7C15 + position) % 2**64  # distinct (seed, position) pairs, distinct seeds


def target_tokens(logits: torch.Tensor, params: SamplingParams, uniforms: torch.Tensor | None = None) -> torch.Tensor:
    """The target's choice at every row of logits [N, V] -> [N]: argmax, or a sample per row drawn with
    that row's uniform number [N] by inverting the cumulative distribution (exact sampling)."""
    if params.temperature == 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.double() / params.temperature, dim=-1)
    if params.top_p < 1:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # keep the smallest set of tokens whose mass reaches top_p (the top token always stays)
        outside = sorted_probs.cumsum(dim=-1) - sorted_probs >= params.top_p
        sorted_probs = sorted_probs.masked_fill(outside, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    # Token i is chosen iff cdf[i-1] <= u * total < cdf[i]: probability probs[i] / total. A token of
    # probability 0 (outside top_p) has an empty interval and is never chosen.
    cdf = probs.cumsum(dim=-1)
    threshold = (uniforms * cdf[:, -1]).unsqueeze(-1)
    return torch.searchsorted(cdf, threshold, right=True).squeeze(-1).clamp(max=probs.shape[-1] - 1)


def accept(drafts: torch.Tensor, logits: torch.Tensor, params: SamplingParams, uniforms: torch.Tensor | None = None) -> list[int]:
    """Tokens to commit after verifying drafts [k] with the target's logits [k + 1, V].

    Row i of the logits is the target's distribution after the committed tokens and drafts[:i].
    The target picks its own token t_i from every row (argmax at T=0, a sample at T>0, drawn with
    row i's uniform number); draft i is accepted iff it equals t_i and all earlier drafts were
    accepted. So the committed tokens are t_0..t_n (n = number accepted, t_n the bonus): each is
    the target's choice given exactly the tokens before it, which makes greedy output identical to
    plain decoding and sampled output distributed exactly as the target's (rejection sampling with
    a one-hot draft); with position_uniforms, a seeded sample is even the same token plain
    decoding draws.
    """
    chosen = target_tokens(logits, params, uniforms)  # [k + 1]
    num_accepted = int((drafts == chosen[:-1]).int().cumprod(dim=0).sum())
    return chosen[: num_accepted + 1].tolist()
