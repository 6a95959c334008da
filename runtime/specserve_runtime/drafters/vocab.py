"""A drafter's vocabulary: the target tokens it may propose.

Drafters share the target's frozen LM head, and scoring all 49,152 SmolLM2 tokens for every
drafted slot costs more than the drafter's own layers. A drafter may instead score only the
tokens the target actually says, ranked by frequency in the distilled responses (EAGLE-3's
reduced draft vocabulary). A token outside it can never be drafted: that costs acceptance
where the target would say it, never correctness, since the target verifies every draft.

Stored as `speculators` stores it (the layout vLLM loads): `d2t[i]` is the target id of draft
token i minus i, and `t2d` marks the target ids that are in the draft vocabulary.
"""

from collections import Counter
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import DrafterError
from ..layers import PackedLinear

IGNORE = -100  # cross-entropy's ignore_index: a label the draft vocabulary cannot express


def frequency_ranked(responses: Iterable[list[int]], size: int, vocab_size: int) -> torch.Tensor:
    """The `size` most frequent response tokens (ties and unseen tokens by id), sorted by id."""
    if not 0 < size <= vocab_size:
        raise DrafterError(f"draft vocabulary size must be within 1..{vocab_size}, got {size}")
    counts = Counter(token for response in responses for token in response)
    seen = sorted(counts, key=lambda token: (-counts[token], token))
    unseen = (token for token in range(vocab_size) if token not in counts)
    ranked = seen[:size] + [next(unseen) for _ in range(max(size - len(seen), 0))]
    return torch.tensor(sorted(ranked), dtype=torch.long)


def add_vocab_buffers(module: nn.Module, vocab_size: int, draft_vocab_size: int | None) -> None:
    """Register d2t / t2d on a drafter whose config asks for a reduced vocabulary (loaded with the weights)."""
    if draft_vocab_size is None or draft_vocab_size == vocab_size:
        return
    if not 0 < draft_vocab_size < vocab_size:
        raise DrafterError(f"draft_vocab_size must be within 1..{vocab_size}, got {draft_vocab_size}")
    module.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long))
    module.register_buffer("t2d", torch.zeros(vocab_size, dtype=torch.bool))


def set_draft_vocab(module: nn.Module, token_ids: torch.Tensor) -> None:
    """Fill a drafter's d2t / t2d from sorted target token ids."""
    module.d2t.copy_(token_ids - torch.arange(token_ids.numel()))
    module.t2d.zero_()
    module.t2d[token_ids] = True


def draft_token_ids(module: nn.Module) -> torch.Tensor | None:
    """Target ids of the draft vocabulary, or None when the drafter scores the whole vocabulary."""
    d2t = getattr(module, "d2t", None)
    return None if d2t is None else d2t + torch.arange(d2t.numel())


class DraftHead:
    """The target's LM head restricted to a draft vocabulary (the rows are copied once)."""

    def __init__(self, lm_head_weight: torch.Tensor, token_ids: torch.Tensor | None):
        """lm_head_weight: the target's head, or a drafter's own, already cut to the draft vocabulary's rows
        (inference only: training's labels need the target's whole vocabulary, to_draft)."""
        self.token_ids = token_ids
        cut = token_ids is not None and lm_head_weight.shape[0] != token_ids.numel()
        self.weight = lm_head_weight.detach()[token_ids].contiguous() if cut else lm_head_weight
        if cut:
            self.to_draft_table = torch.full((lm_head_weight.shape[0],), IGNORE, dtype=torch.long)
            self.to_draft_table[token_ids] = torch.arange(token_ids.numel())
        self.linear: nn.Module | None = None  # inference only, see for_inference()

    @classmethod
    def for_inference(cls, lm_head: nn.Module, token_ids: torch.Tensor | None,
                      int8_activations: bool = False) -> "DraftHead":
        """A head that scores with a packed weight: the target's own LM head for the whole vocabulary,
        else the draft rows packed once; on int8 blocks if `int8_activations` (PackedLinear). Why:
        torch's F.linear on the few rows a draft step scores (2-8) took 5x oneDNN's time on a packed
        weight, 0.75 against 0.15 ms for 2 rows of the 8,192-token head."""
        head = cls(lm_head.weight, token_ids)
        own = token_ids is not None or int8_activations
        head.linear = PackedLinear(head.weight, int8_activations) if own else lm_head
        return head

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.linear is None:  # training: gradients flow to `hidden`
            return F.linear(hidden, self.weight)
        return self.linear(hidden.reshape(-1, hidden.shape[-1])).view(*hidden.shape[:-1], -1)

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.token_ids is None else self.token_ids[draft_ids]

    def to_draft(self, target_ids: torch.Tensor) -> torch.Tensor:
        """Training labels: target ids -> draft ids, IGNORE where the draft vocabulary lacks the token."""
        return target_ids if self.token_ids is None else self.to_draft_table[target_ids]
