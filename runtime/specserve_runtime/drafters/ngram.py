"""Prompt-lookup drafting: no model, just copy what followed the last n-gram the last time it appeared."""

import torch


class NgramProposer:
    DEFAULT_TOKENS = 4
    tap_layers: tuple[int, ...] = ()

    def __init__(self, num_speculative_tokens: int = DEFAULT_TOKENS, max_ngram: int = 3, min_ngram: int = 1):
        self.num_speculative_tokens = num_speculative_tokens
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def begin(self, capacity: int) -> None:
        pass

    def extend_context(self, taps: torch.Tensor | None) -> None:
        pass

    def propose(self, tokens: list[int], max_drafts: int) -> list[int]:
        k = min(self.num_speculative_tokens, max_drafts)
        if k <= 0:
            return []
        # Longest suffix first; for each length the most recent earlier match wins.
        for n in range(min(self.max_ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            suffix = tokens[-n:]
            for start in range(len(tokens) - n - 1, -1, -1):
                if tokens[start : start + n] == suffix:
                    return tokens[start + n : start + n + k]
        return []
