"""EAGLE-3 style drafter: fused low/mid/high target features + token embedding -> one decoder layer.

Position j of the drafter pairs the embedding of token j+1 with the target's feature at token j
and predicts token j+2. Past the committed tokens the drafter has no target feature, so it feeds
its own output hidden state instead and drafts k tokens one after another: a chain of its top
guesses, or a tree of its most likely branches (DraftsBestFirst). The target's embedding and LM
head are shared and frozen.
"""

import heapq
import itertools
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path

import torch
from torch import nn

from .. import blockquant, native
from ..kv_cache import KVCache
from ..layers import MLP, Attention, RMSNorm, RotaryEmbedding, causal_mask, fuse_projections
from ..model import ModelConfig, Transformer
from ..verify import DraftTree
from . import (
    DrafterError,
    ModelProposer,
    ProposerOptions,
    check_layer_ids,
    check_matches_target,
    checkpoint,
    drafter_source,
    int8_drafting,
)
from .vocab import add_vocab_buffers

DEFAULT_TOKENS = 4


def feature_layer_ids(num_target_layers: int) -> tuple[int, int, int]:
    """Low, middle and high target layers (0-based layer outputs): early, middle, and 3 from the top."""
    return (1, (num_target_layers - 1) // 2, num_target_layers - 3)


@dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int
    num_target_layers: int | None  # None: not recorded (the speculators layout); checked against the target
    target_layer_ids: tuple[int, ...]
    draft_vocab_size: int | None = None  # None: the drafter scores the target's whole vocabulary
    max_position_embeddings: int = 8192  # what vLLM's copy of the layer is told; RoPE itself has no limit here

    def __post_init__(self):
        check_layer_ids(self.target_layer_ids, self.num_target_layers)

    @classmethod
    def for_target(cls, target: ModelConfig, draft_vocab_size: int | None = None) -> "Eagle3Config":
        return cls(
            hidden_size=target.hidden_size,
            intermediate_size=target.intermediate_size,
            num_attention_heads=target.num_attention_heads,
            num_key_value_heads=target.num_key_value_heads,
            head_dim=target.head_dim,
            rms_norm_eps=target.rms_norm_eps,
            rope_theta=target.rope_theta,
            vocab_size=target.vocab_size,
            num_target_layers=target.num_hidden_layers,
            target_layer_ids=feature_layer_ids(target.num_hidden_layers),
            draft_vocab_size=draft_vocab_size,
        )

    def to_json(self) -> dict:
        return {"architectures": ["Eagle3DraftModel"], **asdict(self), "target_layer_ids": list(self.target_layer_ids)}

    @classmethod
    def from_json(cls, raw: dict) -> "Eagle3Config":
        """config.json in the speculators layout (to_speculators) or in training's own (to_json)."""
        if checkpoint.is_speculators(raw):
            return cls.from_speculators(raw)
        if raw.get("architectures") != ["Eagle3DraftModel"]:
            raise DrafterError(f"not an EAGLE-3 drafter: architectures={raw.get('architectures')}")
        missing = [f.name for f in fields(cls) if f.name not in raw and f.default is MISSING]
        if missing:
            raise DrafterError(f"EAGLE-3 config.json lacks {', '.join(missing)}")
        values = {f.name: raw[f.name] for f in fields(cls) if f.name in raw}
        return cls(**{**values, "target_layer_ids": tuple(raw["target_layer_ids"])})

    # The speculators layout's EAGLE-3 variants that this drafter computes: one Llama layer whose residual is the
    # feature before its norm (vLLM's norm_before_residual false), no norms around fc, the hidden state fed back
    # before the final norm.
    VARIANT = {"norm_before_residual": False, "norm_before_fc": False, "fc_norm": False, "norm_output": False}

    @classmethod
    def from_speculators(cls, raw: dict) -> "Eagle3Config":
        layer = checkpoint.speculators_layer(raw, "eagle3", ("eagle_aux_hidden_state_layer_ids",))
        given = {name: raw.get(name, name == "norm_before_residual") for name in cls.VARIANT}  # vLLM's defaults
        other = {name: value for name, value in given.items() if value != cls.VARIANT[name]}
        if layer["num_hidden_layers"] != 1 or layer.get("model_type", "llama") != "llama" or other:
            raise DrafterError(f"an EAGLE-3 drafter of one Llama layer with {cls.VARIANT} is what the embedded engine "
                               f"runs, not num_hidden_layers={layer['num_hidden_layers']}, "
                               f"model_type={layer.get('model_type')!r}, {other}")
        vocab_size, draft_vocab_size = layer["vocab_size"], raw.get("draft_vocab_size") or layer["vocab_size"]
        return cls(
            **{name: layer[name] for name in ("hidden_size", "intermediate_size", "num_attention_heads",
                                              "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta",
                                              "vocab_size")},
            num_target_layers=None,
            # vLLM taps the input of layer i, this drafter's target_layer_ids the output of layer i (model.py)
            target_layer_ids=tuple(i - 1 for i in raw["eagle_aux_hidden_state_layer_ids"]),
            draft_vocab_size=draft_vocab_size if draft_vocab_size < vocab_size else None,
            max_position_embeddings=layer.get("max_position_embeddings", 8192),
        )

    def to_speculators(self, verifier_name_or_path: str, verifier_architectures: list[str],
                       speculative_tokens: int | None = None) -> dict:
        """config.json in the `speculators` layout, the format vLLM loads (`speculative_tokens` drafts a step,
        by default DEFAULT_TOKENS)."""
        layer = {
            "model_type": "llama",
            "hidden_act": "silu",
            "attention_bias": False,
            "tie_word_embeddings": False,
            "num_hidden_layers": 1,
            **{f.name: getattr(self, f.name) for f in fields(self)
               if f.name in checkpoint.LAYER_FIELDS + ("head_dim", "rope_theta", "max_position_embeddings")},
        }
        return checkpoint.speculators_layout("eagle3", layer, speculative_tokens or DEFAULT_TOKENS, verifier_name_or_path,
                                             verifier_architectures, {
                                                 "draft_vocab_size": self.draft_vocab_size or self.vocab_size,
                                                 "target_hidden_size": self.hidden_size,
                                                 "eagle_aux_hidden_state_layer_ids": [i + 1 for i in self.target_layer_ids],
                                                 **self.VARIANT,
                                             })


class Eagle3Layer(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        h = cfg.hidden_size
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)  # on the token embeddings
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)  # on the features
        # Attention reads [embedding ; feature], 2H wide, and writes back H.
        self.self_attn = Attention(
            2 * h, h, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, False, cfg.rms_norm_eps
        )
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.mlp = MLP(h, cfg.intermediate_size)

    def fuse(self, embeds: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.input_layernorm(embeds), self.hidden_norm(features)], dim=-1)  # [T, 2H]

    def finish(self, features: torch.Tensor, attention_out: torch.Tensor) -> torch.Tensor:
        h = features + attention_out  # the residual stream is the feature's, not the embedding's
        return h + self.mlp(self.post_attention_layernorm(h))

    def forward(self, embeds, features, cos, sin, caches: list[KVCache], sizes: list[int], masks=None):
        """embeds, features [N, H]: the new positions of len(caches) sequences end to end (sizes);
        masks: each sequence's attention mask, None for causal."""
        q, k, v = self.self_attn.query_key_value(self.fuse(embeds, features), cos, sin)
        masks = masks or [causal_mask(size, cache.length + size) for cache, size in zip(caches, sizes)]
        attended = []
        for cache, mask, q_s, k_s, v_s in zip(caches, masks, q.split(sizes, 2), k.split(sizes, 2), v.split(sizes, 2)):
            k_all, v_all = cache.write(0, k_s, v_s)
            attended.append(self.self_attn.attend(q_s, k_all, v_all, mask))
        return self.finish(features, self.self_attn.project_out(torch.cat(attended, dim=2)))


class Eagle3Drafter(nn.Module):
    def __init__(self, config: Eagle3Config):
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.fc = nn.Linear(len(config.target_layer_ids) * h, h, bias=False)
        self.midlayer = Eagle3Layer(config)
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta)
        add_vocab_buffers(self, config.vocab_size, config.draft_vocab_size)
        self.native_layers: native.NativeLayers | None = None  # decoder.c for drafting, on int8 products (build_eagle3)

    def forward(self, embeds: torch.Tensor, features: torch.Tensor, caches: list[KVCache], sizes: list[int],
                positions: list[int] | None = None, masks: list[torch.Tensor | None] | None = None) -> torch.Tensor:
        """embeds, features [N, H]: the next sizes[i] drafter positions of sequence i, end to end ->
        hidden states [N, H] (before the norm). One matrix product per weight for all sequences;
        attention per sequence, on its own cache. Positions and masks: the cache's next slots,
        causal, unless given (a draft tree's nodes)."""
        if positions is None:
            positions = [cache.length + i for cache, size in zip(caches, sizes) for i in range(size)]
        if self.native_layers is None:
            hidden = self.midlayer(embeds, features, *self.rotary(torch.tensor(positions)), caches, sizes, masks)
        else:  # decoder.c, in place on a copy of the features; a mask [size, cache.length + size] splits at the cache
            hidden = features.clone(memory_format=torch.contiguous_format)
            batch = [(cache, torch.ones(size, size, dtype=torch.bool).tril(), None) if mask is None
                     else (cache, mask[:, cache.length :], mask[:, : cache.length])
                     for cache, size, mask in zip(caches, sizes, masks or [None] * len(caches))]
            cos, sin = self.rotary.tables(max(positions) + 1)
            self.native_layers.run(hidden, cos, sin, torch.tensor(positions), batch, embeds=embeds.contiguous())
        for cache, size in zip(caches, sizes):
            cache.advance(size)
        return hidden


class DraftsBestFirst:
    """One sequence's drafts, grown best first: each new draft is the most likely continuation not
    yet drafted, by the drafter's probability of its whole branch (the product of its tokens'
    conditional probabilities). Candidates are (-log-probability, order, parent draft, token);
    only drafts the drafter has read (expand) propose children, so a parent precedes its children.
    A chain is the tree whose drafts each propose one child, their top guess."""

    def __init__(self, num_context: int):
        self.num_context = num_context  # drafter cache slots of the committed tokens, visible to every draft
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.slots: dict[int, int] = {}  # draft -> the drafter cache slot of its keys/values, once read
        self.hidden: dict[int, torch.Tensor] = {}  # draft (-1: the committed tokens) -> the state that guessed its children
        self.log_probs = {-1: 0.0}  # draft -> log-probability of its branch
        self.candidates: list[tuple[float, int, int, int]] = []
        self.order = itertools.count()

    def expand(self, draft: int, hidden: torch.Tensor, log_probs: list[float], tokens: list[int]) -> None:
        self.hidden[draft] = hidden
        for log_prob, token in zip(log_probs, tokens):
            candidate = (-(self.log_probs[draft] + log_prob), next(self.order), draft, token)
            heapq.heappush(self.candidates, candidate)

    def take_best(self) -> None:
        cost, _, parent, token = heapq.heappop(self.candidates)
        self.log_probs[len(self.tokens)] = -cost
        self.tokens.append(token)
        self.parents.append(parent)

    def read_newest(self, slot: int) -> tuple[int, torch.Tensor, int, torch.Tensor | None]:
        """The drafter's input for the newest draft, whose keys/values go to `slot`: its token, the
        state that guessed it, its position, and its attention mask over slots 0..slot (None: all)."""
        draft = len(self.tokens) - 1
        self.slots[draft] = slot
        ancestors, parent = [], self.parents[draft]
        while parent >= 0:
            ancestors.append(self.slots[parent])
            parent = self.parents[parent]
        mask = None
        if len(ancestors) < slot - self.num_context:  # other branches were read before it: hide them
            mask = torch.zeros(1, slot + 1, dtype=torch.bool)
            mask[0, : self.num_context] = True
            mask[0, ancestors + [slot]] = True
        # One position past its parent's; the committed tokens' last sits at num_context - 1.
        position = self.num_context + len(ancestors)
        return self.tokens[draft], self.hidden[self.parents[draft]], position, mask


class Eagle3Proposer(ModelProposer):
    cache: KVCache | None = None  # per sequence: the drafter layer's keys/values, made by begin()
    num_context = 0  # drafter positions backed by real target features

    def __init__(self, target: Transformer, drafter: "Eagle3Drafter", num_speculative_tokens: int, tree: bool = False,
                 prompt_lookup: int = 0):
        super().__init__(target, drafter, num_speculative_tokens, prompt_lookup)
        self.tree = tree  # draft a tree (DraftsBestFirst), the same number of drafter forwards as a chain

    def begin(self, capacity: int) -> None:
        super().begin(capacity)
        cfg = self.drafter.config
        self.cache = KVCache(1, cfg.num_key_value_heads, cfg.head_dim, capacity, native.cache_dtype(self.drafter.native_layers))
        self.pending, self.num_context = [], 0

    @torch.inference_mode()
    def propose_batch(self, work: list[tuple["Eagle3Proposer", list[int], int]]) -> list[list[int] | DraftTree]:
        """Drafts for many sequences ((its proposer, its committed tokens, most drafts) each): one
        drafter forward per draft after the first for all the sequences still drafting."""
        drafts: list[list[int] | DraftTree] = [[] for _ in work]
        drafting = [(i, proposer, tokens, limit) for i, (proposer, tokens, max_drafts) in enumerate(work)
                    if proposer.pending and (limit := min(proposer.num_speculative_tokens, max_drafts)) > 0]
        if not drafting:
            return drafts
        # First pass: each sequence's features committed since its last step. Positions past
        # num_context were fed the drafter's own guesses last step: drop them.
        embeds, features, sizes = [], [], []
        for _, proposer, tokens, _ in drafting:
            proposer.cache.crop(proposer.num_context)
            taps = torch.cat(proposer.pending)
            proposer.pending = []
            start, end = proposer.num_context, proposer.num_context + taps.shape[0]  # end == len(tokens) - 1
            embeds.append(torch.tensor(tokens[start + 1 : end + 1]))
            features.append(taps)
            sizes.append(taps.shape[0])
            proposer.num_context = end
        caches = [proposer.cache for _, proposer, _, _ in drafting]
        hidden = self.drafter(self.target.embed_tokens(torch.cat(embeds)), self.drafter.fc(torch.cat(features)),
                              caches, sizes)
        hidden = hidden[torch.tensor(sizes).cumsum(0) - 1]  # each sequence's last position: [S, H]
        # Then one draft at a time: each draft, with the hidden state that guessed it, is an input,
        # and the hidden state it gives guesses its children.
        grown = [DraftsBestFirst(proposer.num_context) for _, proposer, _, _ in drafting]
        read = [(k, -1) for k in range(len(drafting))]  # (sequence, draft) of each row of `hidden`
        width = max(limit for _, _, _, limit in drafting) if self.tree else 1
        while True:
            log_probs, ids = blockquant.top_log_probs(self.head.logits(self.drafter.norm(hidden)), width)
            log_probs, guesses = log_probs.tolist(), self.head.to_target(ids).tolist()
            going = []
            for row, (k, draft) in enumerate(read):
                grown[k].expand(draft, hidden[row], log_probs[row], guesses[row])
                grown[k].take_best()
                if len(grown[k].tokens) < drafting[k][3]:
                    going.append(k)
            if not going:
                break
            inputs = [grown[k].read_newest(drafting[k][1].cache.length) for k in going]
            tokens, states, positions, masks = zip(*inputs)
            hidden = self.drafter(self.target.embed_tokens(torch.tensor(tokens)), torch.stack(states),
                                  [drafting[k][1].cache for k in going], [1] * len(going), list(positions), list(masks))
            read = [(k, len(grown[k].tokens) - 1) for k in going]
        for (i, _, _, _), tree in zip(drafting, grown):
            drafts[i] = DraftTree(tree.tokens, tree.parents) if self.tree else tree.tokens
        return drafts


def load_eagle3(folder: str | Path) -> Eagle3Drafter:
    return checkpoint.load(folder, lambda config: Eagle3Drafter(Eagle3Config.from_json(config)))


def save_eagle3(drafter: Eagle3Drafter, folder: str | Path, dtype: torch.dtype | None = None) -> Path:
    return checkpoint.save(drafter, drafter.config.to_json(), folder, dtype)


def build_eagle3(target: Transformer, options: ProposerOptions) -> Eagle3Proposer:
    source = drafter_source("eagle3", options)
    if source == "random":
        drafter = checkpoint.seeded(lambda: Eagle3Drafter(Eagle3Config.for_target(target.config)), options.seed)
    else:
        drafter = load_eagle3(source)
    check_matches_target("eagle3", drafter.config, target.config)
    fuse_projections(drafter, int8_activations=int8_drafting())
    if native.runs([drafter.midlayer], drafter.config.head_dim):
        drafter.native_layers = native.NativeLayers([drafter.midlayer], drafter.config)
    point = checkpoint.operating_point(source, options, DEFAULT_TOKENS)
    return Eagle3Proposer(target, drafter, point.num_speculative_tokens, point.draft_tree, point.prompt_lookup)
