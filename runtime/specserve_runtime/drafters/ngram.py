"""Prompt-lookup drafting: no model, just copy what followed the last n-gram the last time it appeared.

PromptLookup finds it; NgramProposer drafts with it alone, and a model drafter (EAGLE-3, DFlash) can add
its answer to its own draft tree as one more branch (drafters.ModelProposer, prompt_lookup).
"""

import torch


class PromptLookup:
    """One sequence's n-grams (max_ngram down to min_ngram tokens), each at the last place it ended.

    continuation(tokens, k) is the k tokens that followed the most recent earlier occurrence of the
    longest suffix of `tokens` that occurred before (a scan from the end for each length, as prompt
    lookup decoding does), found in a dictionary instead: the n-grams of the tokens committed since
    the last call are added to it, so a step costs what its new tokens cost, not the sequence's length.
    `tokens` must extend the ones of the previous call (a sequence's committed tokens only grow).
    """

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"prompt lookup matches n-grams of min_ngram..max_ngram tokens, 1 <= min <= max; "
                             f"got {min_ngram}..{max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.last_end: dict[tuple[int, ...], int] = {}  # n-gram -> the position of its last token
        self.indexed = 0  # the n-grams ending before this position are in last_end

    def continuation(self, tokens: list[int], count: int) -> list[int]:
        # Every n-gram but those ending at the last token: the suffix itself is no earlier occurrence.
        for end in range(self.indexed, len(tokens) - 1):
            for n in range(self.min_ngram, min(self.max_ngram, end + 1) + 1):
                self.last_end[tuple(tokens[end - n + 1 : end + 1])] = end
        self.indexed = max(self.indexed, len(tokens) - 1)
        if count <= 0:
            return []
        for n in range(min(self.max_ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            end = self.last_end.get(tuple(tokens[-n:]))
            if end is not None:
                return tokens[end + 1 : end + 1 + count]
        return []


class NgramProposer:
    DEFAULT_TOKENS = 4
    tap_layers: tuple[int, ...] = ()

    def __init__(self, num_speculative_tokens: int = DEFAULT_TOKENS, max_ngram: int = 3, min_ngram: int = 1):
        self.num_speculative_tokens = num_speculative_tokens
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.lookup = PromptLookup(max_ngram, min_ngram)

    def begin(self, capacity: int) -> None:
        self.lookup = PromptLookup(self.max_ngram, self.min_ngram)

    def extend_context(self, taps: torch.Tensor | None) -> None:
        pass

    def propose(self, tokens: list[int], max_drafts: int) -> list[int]:
        return self.lookup.continuation(tokens, min(self.num_speculative_tokens, max_drafts))
