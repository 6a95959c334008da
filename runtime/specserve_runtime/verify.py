"""Verification of draft tokens against the target: pure functions, no model state.

Terms (as in vLLM's rejection sampler):
- draft tokens: the k tokens a proposer guessed after the last committed token;
- accepted tokens: the longest prefix of the drafts that the target agrees with;
- bonus token: the target's own token right after the accepted prefix (on a full accept,
  the token after the last draft). Every step commits accepted + 1 tokens.

Drafts form a tree (a chain is the tree in which each draft follows the one before): the target
verifies every branch in one forward, and the accepted prefix is the longest branch it agrees with.
"""

from dataclasses import dataclass, field
from typing import Callable

import torch

from . import blockquant


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclass(frozen=True)
class DraftTree:
    """Draft tokens and, for each, the index of the draft it follows (-1: the last committed token).

    Every parent comes before its children, and siblings hold different tokens.
    """

    tokens: list[int]
    parents: list[int]
    depths: list[int] = field(init=False, repr=False)  # draft i is the depths[i]-th token after the committed ones

    def __post_init__(self):
        if len(self.tokens) != len(self.parents):
            raise ValueError(f"{len(self.tokens)} draft tokens but {len(self.parents)} parents")
        object.__setattr__(self, "depths", tree_depths(self.parents))

    @classmethod
    def chain(cls, tokens: list[int]) -> "DraftTree":
        return cls(list(tokens), list(range(-1, len(tokens) - 1)))

    @property
    def is_chain(self) -> bool:
        return self.parents == list(range(-1, len(self.tokens) - 1))

    def __len__(self) -> int:
        return len(self.tokens)

    def with_branch(self, chain: list[int]) -> "DraftTree":
        """This tree and `chain` as one more branch from the root: the chain's tokens follow the tree's
        nodes as far as they agree (a shared prefix is verified once), then hang below as new nodes."""
        tokens, parents = list(self.tokens), list(self.parents)
        children = {(parent, token): index for index, (token, parent) in enumerate(zip(tokens, parents))}
        node = -1
        for token in chain:
            if (node, token) not in children:
                tokens.append(token)
                parents.append(node)
                children[(node, token)] = len(tokens) - 1
            node = children[(node, token)]
        return DraftTree(tokens, parents)

    def accepted(self, target_token: Callable[[int], int | None]) -> list[int]:
        """The drafts accepted, root first, when the target's token after row r (0: the committed
        tokens, 1 + i: draft i) is target_token(r): from the root, move to the child that holds the
        target's token until no child does."""
        child = {(parent + 1, token): index + 1 for index, (token, parent) in enumerate(zip(self.tokens, self.parents))}
        rows = [0]
        while (row := child.get((rows[-1], target_token(rows[-1])))) is not None:
            rows.append(row)
        return [row - 1 for row in rows[1:]]


def tree_depths(parents: list[int]) -> list[int]:
    """How many tokens past what precedes a tree each of its tokens is (1 for a child of -1)."""
    depths: list[int] = []
    for index, parent in enumerate(parents):
        if not -1 <= parent < index:
            raise ValueError(f"token {index} of a tree follows {parent}: a parent must come before its child")
        depths.append(1 + (depths[parent] if parent >= 0 else 0))
    return depths


def position_uniforms(seed: int, first_position: int, count: int) -> torch.Tensor:
    """The uniform random numbers [count] that sample the tokens at output positions first_position...

    Each is a function of (seed, position) alone: however many tokens a step verifies (speculation,
    any draft length, or none), the token at position p is drawn with the same number, so a seeded
    sampled request gives the same text with every method, draft length and batch (up to float
    rounding at the edge between two tokens; see accept).
    """
    stream = _splitmix64(seed % 2**64)  # every 64-bit seed its own stream (torch's CPU generator keeps 32 bits)
    return torch.tensor([(_splitmix64(stream ^ position) >> 11) * 2.0**-53  # 53 random bits: a double in [0, 1)
                         for position in range(first_position, first_position + count)], dtype=torch.float64)


def _splitmix64(value: int) -> int:
    """SplitMix64's output function: a bijection on 64-bit integers that scrambles every bit of its input."""
    value = (value + 0x9E3779B97F4A7C15) % 2**64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) % 2**64
    return value ^ (value >> 31)


def target_tokens(logits: torch.Tensor, params: SamplingParams, uniforms: torch.Tensor | None = None) -> torch.Tensor:
    """The target's choice at every row of logits [N, V] -> [N]: argmax, or a sample per row drawn with
    that row's uniform number [N] by inverting the cumulative distribution (exact sampling), over top_p's nucleus
    where top_p < 1: in blockquant.c where it runs (blockquant.sample), else as below."""
    if params.temperature == 0:
        return blockquant.argmax(logits)
    if (chosen := blockquant.sample(logits, params.temperature, uniforms, params.top_p)) is not None:
        return chosen
    probs = torch.softmax(logits.double() / params.temperature, dim=-1)
    if params.top_p < 1:
        probs = nucleus(probs, params.top_p)
    # Token i is chosen iff cdf[i-1] <= u * total < cdf[i]: probability probs[i] / total. A token of
    # probability 0 (outside top_p) has an empty interval and is never chosen.
    cdf = probs.cumsum(dim=-1)
    threshold = (uniforms * cdf[:, -1]).unsqueeze(-1)
    return torch.searchsorted(cdf, threshold, right=True).squeeze(-1).clamp(max=probs.shape[-1] - 1)


NUCLEUS_FIRST = 64  # the most likely tokens nucleus() looks among first


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """probs [N, V] with every token outside its row's nucleus set to 0: the smallest set of most likely tokens
    whose mass reaches top_p (the top token always stays). Found among the k most likely tokens (a partial
    selection), k doubled until, in every row, the k-th is outside: then so is every less likely one. Why: a sort
    of the whole vocabulary cost about 5 ms a row of 49,152 probabilities, as much as the target's forward."""
    vocabulary = probs.shape[-1]
    k = min(NUCLEUS_FIRST, vocabulary)
    while True:
        top, ids = probs.topk(k, dim=-1)  # most likely first
        before = top.cumsum(dim=-1) - top  # the mass of the tokens more likely than each
        if k == vocabulary or bool((before[:, -1] >= top_p).all()):
            break
        k = min(2 * k, vocabulary)
    return torch.zeros_like(probs).scatter_(-1, ids, top.masked_fill(before >= top_p, 0.0))


def accept(drafts: DraftTree, logits: torch.Tensor, params: SamplingParams,
           uniforms: torch.Tensor | None = None) -> tuple[list[int], list[int]]:
    """Tokens to commit after verifying a draft tree with the target's logits [1 + len(drafts), V],
    and the indices of the drafts accepted (the branch kept, root first).

    Row 0 of the logits is the target's distribution after the committed tokens, row 1 + i its
    distribution after draft i and the drafts on the branch that leads to it. Walking down from the
    root, the target picks its own token t from the current row (argmax at T=0, a sample at T>0,
    drawn with the uniform number of that row's output position, `uniforms[depth]`); if a child
    of the current node holds t, the walk moves to it, else t is the bonus token and the walk
    stops. So every committed token is the target's choice given exactly the tokens before it,
    whatever the drafts were: greedy output is identical to plain decoding, and sampled output is
    distributed exactly as the target's (rejection sampling with one-hot drafts); with
    position_uniforms, a seeded sample is even the same token plain decoding draws, unless its
    uniform number falls within float rounding (about 1e-6) of the edge between two tokens: a
    verify forward's logits differ from a one-token decode's in their last bits.
    """
    depths = [0] + drafts.depths  # of each row
    row_uniforms = None if uniforms is None else uniforms[depths]
    chosen = target_tokens(logits, params, row_uniforms).tolist()
    accepted = drafts.accepted(chosen.__getitem__)
    return [chosen[row] for row in [0] + [index + 1 for index in accepted]], accepted
