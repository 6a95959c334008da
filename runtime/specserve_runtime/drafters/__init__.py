"""Proposers: one file per method behind one small interface, chosen from a registry.

The engine owns the target and its KV cache. A proposer only guesses tokens; the engine
verifies every guess, so no proposer can change the output, only the speed.
"""

from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from .. import blockquant
from ..config import BUNDLED_DRAFTERS_DIR, DEFAULT_DRAFTER_NAMES, MAX_PROMPT_LOOKUP
from ..errors import DrafterError
from ..model import ModelConfig, Transformer
from ..verify import DraftTree
from .ngram import PromptLookup
from .vocab import DraftHead, draft_token_ids

# The prompt-lookup branch of a model drafter's tree copies what followed the last earlier occurrence of the
# longest suffix of LOOKUP_MIN_NGRAM to LOOKUP_MAX_NGRAM tokens. Shorter matches add rows that are seldom
# accepted; a longer one is a surer copy.
LOOKUP_MIN_NGRAM, LOOKUP_MAX_NGRAM = 3, 6


class Proposer(Protocol):
    """Drafts for one sequence. The engine gives every sequence its own shallow copy of the proposer
    (the drafter's weights are shared) and calls begin() on it: begin() must create the per-sequence
    state anew, never change state that the copies share."""

    tap_layers: tuple[int, ...]  # target layers whose outputs this proposer conditions on
    num_speculative_tokens: int  # the most drafts it proposes per step

    def begin(self, capacity: int) -> None:
        """Start a sequence that holds at most `capacity` tokens."""

    def extend_context(self, taps: torch.Tensor | None) -> None:
        """Target features [T, len(tap_layers) * H] of the tokens just committed to the target's KV cache."""

    def propose(self, tokens: list[int], max_drafts: int) -> list[int] | DraftTree:
        """Up to `max_drafts` guesses of the tokens that follow `tokens` (all committed tokens): a
        chain, or a tree of as many drafts in all."""

    # Optional, for drafters with a model: propose_batch(work) with work a list of (that
    # sequence's proposer copy, its tokens, its max_drafts) returns every sequence's drafts from
    # one drafter forward per pass instead of one per sequence; see propose_all.


def propose_all(prototype: Proposer, work: list[tuple[Proposer, list[int], int]], batched: bool = True
                ) -> list[DraftTree]:
    """Every sequence's drafts for one step, as trees (a chain is one): batched where the method can
    (propose_batch on the engine's proposer, whose weights all the copies share), else one
    propose() per sequence."""
    propose_batch = getattr(prototype, "propose_batch", None)
    if batched and propose_batch is not None:
        proposals = propose_batch(work)
    else:
        proposals = [proposer.propose(tokens, max_drafts) for proposer, tokens, max_drafts in work]
    trees = [drafts if isinstance(drafts, DraftTree) else DraftTree.chain(drafts) for drafts in proposals]
    branch = getattr(prototype, "prompt_lookup", 0)
    if not branch:
        return trees
    # A model drafter's tree, and what prompt lookup copies from the sequence so far as one more branch: where
    # the text repeats itself (code, quotes, lists), a copy runs longer than the drafter's guesses.
    return [tree.with_branch(proposer.lookup.continuation(tokens, min(branch, max_drafts)))
            for tree, (proposer, tokens, max_drafts) in zip(trees, work)]


def int8_drafting() -> bool:
    """Whether drafters run their matrix products on int8 blocks (layers.PackedLinear, where the CPU has
    AVX-512 VNNI): on unless SPECSERVE_DRAFTER_INT8=0. A drafter's numbers change only what it proposes;
    verification by the target's own products decides what is committed."""
    return blockquant.int8_switch("SPECSERVE_DRAFTER_INT8", "1", DrafterError)


class ModelProposer:
    """What the drafters with a model (EAGLE-3, DFlash) share: the frozen target whose embedding and
    LM head they borrow, the drafter, the target features committed since it last drafted, and the
    prompt-lookup branch added to its drafts (propose_all). A subclass creates its per-sequence cache in
    begin(), after this class's, and drafts in propose_batch()."""

    def __init__(self, target: Transformer, drafter: torch.nn.Module, num_speculative_tokens: int,
                 prompt_lookup: int = 0):
        self.target, self.drafter = target, drafter
        self.num_speculative_tokens = num_speculative_tokens
        self.prompt_lookup = prompt_lookup  # tokens of the prompt-lookup branch at the most (0: none)
        self.tap_layers = drafter.config.target_layer_ids
        # The drafter's own rows of the LM head where its checkpoint ships them, else the target's head.
        lm_head = drafter.lm_head if hasattr(drafter, "lm_head") else target.lm_head
        self.head = DraftHead.for_inference(lm_head, draft_token_ids(drafter), int8_drafting())
        self.pending: list[torch.Tensor] = []
        self.lookup_ngrams = (LOOKUP_MAX_NGRAM, LOOKUP_MIN_NGRAM)
        self.lookup: PromptLookup | None = None  # per sequence, made by begin()

    def begin(self, capacity: int) -> None:
        self.lookup = PromptLookup(*self.lookup_ngrams) if self.prompt_lookup else None

    def extend_context(self, taps: torch.Tensor | None) -> None:
        self.pending.append(taps)

    def propose(self, tokens: list[int], max_drafts: int) -> list[int] | DraftTree:
        return self.propose_batch([(self, tokens, max_drafts)])[0]

    def propose_batch(self, work: list[tuple["ModelProposer", list[int], int]]) -> list[list[int] | DraftTree]:
        raise NotImplementedError


class NoDraft:
    """Plain autoregressive decoding: the shared loop with an empty draft verifies one token per step."""

    tap_layers: tuple[int, ...] = ()
    num_speculative_tokens = 0

    def begin(self, capacity: int) -> None:
        pass

    def extend_context(self, taps: torch.Tensor | None) -> None:
        pass

    def propose(self, tokens: list[int], max_drafts: int) -> list[int]:
        return []


@dataclass(frozen=True)
class ProposerOptions:
    drafter: str | None = None  # checkpoint folder, "random", or None for the method's default
    num_speculative_tokens: int | None = None  # drafts per step (dflash: block size - 1)
    mask_token_id: int | None = None  # dflash with a random drafter: the mask token to record
    seed: int = 0
    # dflash, eagle3: the drafts are the drafter's most likely continuations, a tree, not a chain;
    # None: as the drafter's operating point has it when no count is given, else a chain
    draft_tree: bool | None = None
    # dflash, eagle3: up to this many tokens that prompt lookup copies from the sequence, as one more branch of
    # the drafts (0: none); None: as the drafter's operating point has it when no count is given, else none
    prompt_lookup: int | None = None


# Drafters trained by the project for the default target (see each folder's CARD.md), in the speculators layout.
DEFAULT_DRAFTERS = {method: BUNDLED_DRAFTERS_DIR / name for method, name in DEFAULT_DRAFTER_NAMES.items()}


@dataclass(frozen=True)
class OperatingPoint:
    """What measured fastest with a trained drafter (docs/benchmarks.md): the engine's default for it.
    Recorded in the drafter's config.json (checkpoint.operating_point), so it travels with the
    weights: to the runtime images' bundled://NAME folders as well as to `--drafter PATH`."""

    num_speculative_tokens: int
    draft_tree: bool = False
    prompt_lookup: int = 0  # tokens of a prompt-lookup branch added to the drafts (0: none)


def drafter_source(method: str, options: "ProposerOptions") -> str:
    """The drafter to load: the user's choice, else the bundled one for the default target."""
    if options.drafter:
        return options.drafter
    bundled = DEFAULT_DRAFTERS[method]
    if not (bundled / "config.json").is_file():
        raise DrafterError(f"no trained {method} drafter is bundled: pass --drafter PATH or --drafter random")
    return str(bundled)


def check_prompt_lookup(tokens, name: str) -> None:
    if type(tokens) is not int or not 0 <= tokens <= MAX_PROMPT_LOOKUP:
        raise DrafterError(f"{name} is the most tokens a prompt-lookup branch copies, 0..{MAX_PROMPT_LOOKUP}, "
                           f"not {tokens!r}")


def check_layer_ids(layer_ids: tuple[int, ...], num_target_layers: int | None) -> None:
    """Taps come out of the target in layer order, so ids must be strictly increasing and in range (None: a
    target of any depth, checked when they meet: check_matches_target)."""
    ids = list(layer_ids)
    top = num_target_layers - 1 if num_target_layers is not None else float("inf")
    if not ids or ids != sorted(set(ids)) or ids[0] < 0 or ids[-1] > top:
        within = f"0..{top}" if num_target_layers is not None else "0 and up"
        raise DrafterError(f"target_layer_ids {ids} must be strictly increasing within {within}")


def check_matches_target(method: str, drafter_config, target: ModelConfig) -> None:
    """A drafter reads the target's features and shares its embedding and LM head: shapes must agree."""
    check_layer_ids(drafter_config.target_layer_ids, target.num_hidden_layers)
    problems = [
        f"{name} {mine} != target's {theirs}"
        for name, mine, theirs in [
            ("hidden_size", drafter_config.hidden_size, target.hidden_size),
            ("vocab_size", drafter_config.vocab_size, target.vocab_size),
            ("num_target_layers", drafter_config.num_target_layers, target.num_hidden_layers),
        ]
        if mine != theirs and mine is not None
    ]
    if problems:
        raise DrafterError(f"{method} drafter does not match the target model: " + "; ".join(problems))


def _build_ar(target: Transformer, options: ProposerOptions) -> Proposer:
    return NoDraft()


def _build_ngram(target: Transformer, options: ProposerOptions) -> Proposer:
    from .ngram import NgramProposer

    return NgramProposer(num_speculative_tokens=options.num_speculative_tokens or NgramProposer.DEFAULT_TOKENS)


def _build_eagle3(target: Transformer, options: ProposerOptions) -> Proposer:
    from .eagle3 import build_eagle3

    return build_eagle3(target, options)


def _build_dflash(target: Transformer, options: ProposerOptions) -> Proposer:
    from .dflash import build_dflash

    return build_dflash(target, options)


PROPOSERS: dict[str, Callable[[Transformer, ProposerOptions], Proposer]] = {
    "ar": _build_ar,
    "ngram": _build_ngram,
    "eagle3": _build_eagle3,
    "dflash": _build_dflash,
}


def build_proposer(method: str, target: Transformer, options: ProposerOptions = ProposerOptions()) -> Proposer:
    if method not in PROPOSERS:
        raise DrafterError(f"unknown method {method!r}; choose one of {', '.join(PROPOSERS)}")
    if options.num_speculative_tokens is not None and options.num_speculative_tokens < 1:
        raise DrafterError(f"num_speculative_tokens must be >= 1, got {options.num_speculative_tokens}")
    if options.draft_tree and method not in ("dflash", "eagle3"):
        raise DrafterError(f"a draft tree needs a drafter model (dflash, eagle3): method {method!r} drafts a chain")
    if options.prompt_lookup is not None:
        if options.prompt_lookup and method not in ("dflash", "eagle3"):
            raise DrafterError(f"a prompt-lookup branch joins the drafts of a drafter model (dflash, eagle3), not of "
                               f"method {method!r}")
        check_prompt_lookup(options.prompt_lookup, "prompt_lookup")
    return PROPOSERS[method](target, options)
