"""DFlash: a block-diffusion drafter that drafts a whole block in one forward.

The drafter is a few Qwen3-style decoder layers of the target's width. Context features
(outputs of several target layers, fused by fc + RMSNorm, one vector per committed token)
enter every draft layer as extra keys/values; queries come only from the block
[last committed token, MASK x (B-1)], which attends to all context and to itself with no
causal mask. The target's embedding and LM head are shared and frozen: a checkpoint ships
neither, and they are applied here, in the proposer, not inside the drafter.

The proposer drafts the block's most likely tokens, one per slot, or, as a draft tree, the most
likely prefixes of the block (draft_tree): the same forward, more of its guesses verified.
"""

import heapq
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
from torch import nn

from .. import blockquant, native
from ..kv_cache import KVCache
from ..layers import RMSNorm, RotaryEmbedding, fuse_projections
from ..model import DecoderLayer, ModelConfig, Transformer
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
from .vocab import DraftHead, add_vocab_buffers

DEFAULT_BLOCK_SIZE = 8
# SmolLM2 has no mask token and no free embedding row. <empty_output> (id 16) is a special token
# of its Jupyter pre-training data: never produced by the chat template, never end-of-sequence.
MASK_TOKEN = "<empty_output>"


def target_layer_ids(num_target_layers: int, num_taps: int) -> list[int]:
    """Target layers to tap, spread evenly from layer 1 to N-3 (z-lab's formula, Python rounding)."""
    if num_taps == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_taps - 1)) for i in range(num_taps)]


@dataclass(frozen=True)
class DFlashConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int
    max_position_embeddings: int
    block_size: int
    num_target_layers: int | None  # None: not recorded (the speculators layout); checked against the target
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    draft_vocab_size: int | None = None  # None: the drafter scores the target's whole vocabulary

    def __post_init__(self):
        if self.block_size < 2:
            raise DrafterError(f"block_size must be >= 2 (the last token plus at least one mask), got {self.block_size}")
        check_layer_ids(self.target_layer_ids, self.num_target_layers)

    @classmethod
    def for_target(
        cls,
        target: ModelConfig,
        num_layers: int,
        block_size: int,
        mask_token_id: int,
        num_taps: int | None = None,
        draft_vocab_size: int | None = None,
    ) -> "DFlashConfig":
        return cls(
            hidden_size=target.hidden_size,
            intermediate_size=target.intermediate_size,
            num_hidden_layers=num_layers,
            num_attention_heads=target.num_attention_heads,
            num_key_value_heads=target.num_key_value_heads,
            head_dim=target.head_dim,
            rms_norm_eps=target.rms_norm_eps,
            rope_theta=target.rope_theta,
            vocab_size=target.vocab_size,
            max_position_embeddings=target.max_position_embeddings,
            block_size=block_size,
            num_target_layers=target.num_hidden_layers,
            target_layer_ids=tuple(target_layer_ids(target.num_hidden_layers, num_taps or num_layers)),
            mask_token_id=mask_token_id,
            draft_vocab_size=draft_vocab_size,
        )

    def layer_config(self) -> ModelConfig:
        return ModelConfig(
            model_type="qwen3",
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            rope_scaling=None,
            tie_word_embeddings=False,
            max_position_embeddings=self.max_position_embeddings,
        )

    def _qwen3_fields(self) -> dict:
        fixed = {"block_size", "num_target_layers", "target_layer_ids", "mask_token_id", "draft_vocab_size"}
        qwen3 = {k: v for k, v in asdict(self).items() if k not in fixed}
        return {
            "model_type": "qwen3",
            "hidden_act": "silu",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "tie_word_embeddings": False,
            "rope_scaling": None,
            **qwen3,
        }

    def to_zlab(self) -> dict:
        """config.json in z-lab's layout (as z-lab/Qwen3-8B-DFlash-b16 ships it, plus a reduced vocabulary's size)."""
        reduced = {"draft_vocab_size": self.draft_vocab_size} if self.draft_vocab_size else {}
        return {
            "architectures": ["DFlashDraftModel"],
            **self._qwen3_fields(),
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "dflash_config": {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids)},
            **reduced,
            "dtype": "float32",
        }

    @classmethod
    def from_zlab(cls, raw: dict) -> "DFlashConfig":
        if raw.get("architectures") != ["DFlashDraftModel"]:
            raise DrafterError(f"not a DFlash drafter: architectures={raw.get('architectures')}")
        dflash = raw.get("dflash_config") or {}
        values = {**raw, **dflash}
        values.setdefault("head_dim", raw.get("hidden_size", 0) // max(raw.get("num_attention_heads", 1), 1))
        values.setdefault("rope_theta", (raw.get("rope_parameters") or {}).get("rope_theta", 1e6))
        values.setdefault("max_position_embeddings", 40960)
        values.setdefault("draft_vocab_size", None)
        names = [f.name for f in fields(cls)]
        missing = [n for n in names if n not in values]
        if missing:
            raise DrafterError(f"DFlash config.json lacks {', '.join(missing)}")
        values["target_layer_ids"] = tuple(values["target_layer_ids"])
        return cls(**{n: values[n] for n in names})

    @classmethod
    def from_speculators(cls, raw: dict) -> "DFlashConfig":
        """config.json in the speculators layout (to_speculators). It does not say how many layers the target
        has: num_target_layers stays None, and the target is checked when the drafter meets it."""
        layer = checkpoint.speculators_layer(raw, "dflash", ("aux_hidden_state_layer_ids", "mask_token_id"))
        vocab_size = layer["vocab_size"]
        draft_vocab_size = raw.get("draft_vocab_size") or vocab_size
        drafts = raw.get("speculators_config", {}).get("proposal_methods", [{}])[0].get("speculative_tokens")
        return cls(
            **{name: layer[name] for name in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                              "num_attention_heads", "num_key_value_heads", "head_dim",
                                              "rms_norm_eps", "rope_theta", "vocab_size")},
            max_position_embeddings=layer.get("max_position_embeddings", 40960),
            block_size=raw.get("block_size") or (drafts or 0) + 1,
            num_target_layers=None,
            # speculators indexes hidden_states with the embedding output at 0, z-lab the first layer
            target_layer_ids=tuple(i - 1 for i in raw["aux_hidden_state_layer_ids"]),
            mask_token_id=raw["mask_token_id"],
            draft_vocab_size=draft_vocab_size if draft_vocab_size < vocab_size else None,
        )

    @classmethod
    def from_config(cls, raw: dict) -> "DFlashConfig":
        return cls.from_speculators(raw) if checkpoint.is_speculators(raw) else cls.from_zlab(raw)

    def to_speculators(self, verifier_name_or_path: str, verifier_architectures: list[str],
                       speculative_tokens: int | None = None) -> dict:
        """config.json in the `speculators` layout, the format vLLM loads (`speculative_tokens` drafts a step, by
        default the whole block's)."""
        return checkpoint.speculators_layout("dflash", self._qwen3_fields(), speculative_tokens or self.block_size - 1,
                                             verifier_name_or_path,
                                             verifier_architectures, {
                                                 "draft_vocab_size": self.draft_vocab_size or self.vocab_size,
                                                 "block_size": self.block_size,
                                                 "aux_hidden_state_layer_ids": [i + 1 for i in self.target_layer_ids],
                                                 "mask_token_id": self.mask_token_id,
                                             })


class DFlashLayer(DecoderLayer):
    def forward(self, x, cos, sin, contexts: list[tuple[torch.Tensor, torch.Tensor]], mask=None):
        """x [N, H]: the blocks of len(contexts) sequences end to end, the same number of rows each;
        contexts: each sequence's context keys/values for this layer."""
        q, k, v = self.self_attn.query_key_value(self.input_layernorm(x), cos, sin)
        size = x.shape[0] // len(contexts)
        attended = []
        for (context_k, context_v), q_s, k_s, v_s in zip(contexts, q.split(size, 2), k.split(size, 2), v.split(size, 2)):
            # Keys/values are [context ; block]. No causal mask: the block sees all context and itself.
            # (Training packs many blocks into one forward; its mask keeps each block to its own view.)
            k_s, v_s = torch.cat([context_k, k_s], dim=2), torch.cat([context_v, v_s], dim=2)
            attended.append(self.self_attn.attend(q_s, k_s, v_s, mask))
        x = x + self.self_attn.project_out(torch.cat(attended, dim=2))
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.config = config
        layer_cfg = config.layer_config()
        h = config.hidden_size
        self.fc = nn.Linear(len(config.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(layer_cfg) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta)
        add_vocab_buffers(self, config.vocab_size, config.draft_vocab_size)
        self.native_layers: native.NativeLayers | None = None  # decoder.c for drafting, on int8 products (build_dflash)

    def context_kv(self, taps: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Target taps [C, L*H] at absolute positions [C] -> per draft layer, context keys/values."""
        context = self.hidden_norm(self.fc(taps))  # [C, H]: the same vectors enter every layer
        cos, sin = self.rotary(positions)
        return [layer.self_attn.key_value(context, cos, sin) for layer in self.layers]

    def project_context(self, pending: list[tuple[KVCache, torch.Tensor]]) -> None:
        """Inference: each sequence's newly committed target taps [C, L*H] projected into its context keys/values,
        written after its cache's length, which then covers them."""
        sizes = [taps.shape[0] for _, taps in pending]
        if self.native_layers is not None:  # each sequence's rows at the positions after its cache's length
            for (cache, taps), size in zip(pending, sizes):
                tables = self.rotary.tables(cache.length + size)
                self.native_layers.write_context(self.fc.int8_blocks, self.hidden_norm.weight, taps, *tables, cache)
        else:  # all sequences' rows in one pass through the products
            positions = [torch.arange(cache.length, cache.length + size) for (cache, _), size in zip(pending, sizes)]
            projected = self.context_kv(torch.cat([taps for _, taps in pending]), torch.cat(positions))
            for layer, (k, v) in enumerate(projected):
                for (cache, _), k_s, v_s in zip(pending, k.split(sizes, 2), v.split(sizes, 2)):
                    cache.write(layer, k_s, v_s)
        for (cache, _), size in zip(pending, sizes):
            cache.advance(size)

    def forward(self, block_embeds: torch.Tensor, positions: torch.Tensor, contexts: list, mask=None) -> torch.Tensor:
        """Block embeddings [N, H] at positions [N] -> normalised hidden states [N, H] for the LM head.
        contexts: per sequence, its context_kv; the N rows are the sequences' blocks end to end, so
        every matrix product runs once for all of them and only attention runs per sequence."""
        cos, sin = self.rotary(positions)
        x = block_embeds
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, [context_kv[i] for context_kv in contexts], mask)
        return self.norm(x)

    def draft_slots(self, block_embeds: torch.Tensor, caches: list[KVCache], slots: int,
                    head: DraftHead | None = None) -> torch.Tensor:
        """Inference: the blocks of len(caches) sequences, end to end, each placed right after its context (the
        cache's keys/values) -> the normalised hidden states [len(caches), slots, H] of each block's slots
        1..slots, the ones that draft, as forward() computes them (slots at most the block's B - 1: a tree may
        have more nodes than the block has slots); with `head`, their logits by it [len(caches), slots, V], in
        decoder.c's same call where the head is on int8 blocks.
        decoder.c works in place: block_embeds [N, H] (contiguous float32) are overwritten."""
        block_size = block_embeds.shape[0] // len(caches)
        slots = min(slots, block_size - 1)
        positions = [cache.length + slot for cache in caches for slot in range(block_size)]
        if self.native_layers is None:
            contexts = [[cache.get(layer) for layer in range(len(self.layers))] for cache in caches]
            x = self(block_embeds, torch.tensor(positions), contexts)
            hidden = x.view(len(caches), block_size, -1)[:, 1 : 1 + slots]
            return head.logits(hidden) if head is not None else hidden
        # decoder.c: each block row sees all of its context and all of its block, no mask. The block's keys and
        # values go into the cache's slots after the context, which the cache's length never covers: the next
        # context projection overwrites them. The last layer's output is computed for the drafting slots only: the
        # others (the last token's row, the slots past the deepest draft) lend it only their keys and values.
        cos, sin = self.rotary.tables(max(positions) + 1)
        everything = torch.ones(block_size, block_size, dtype=torch.bool)
        drafting = torch.tensor([0 < slot <= slots for _ in caches for slot in range(block_size)])
        segments = [(cache, everything, None) for cache in caches]
        blocks = getattr(head.linear, "int8_blocks", None) if head is not None else None
        _, out = self.native_layers.run(block_embeds, cos, sin, torch.tensor(positions), segments, kept=drafting,
                                        norm=self.norm, head=blocks)
        out = out.view(len(caches), slots, -1)
        return head.logits(out) if head is not None and blocks is None else out


def draft_tree(log_probs: torch.Tensor, ids: torch.Tensor, num_nodes: int) -> DraftTree:
    """The `num_nodes` most likely prefixes of a block, as a tree, from each slot's most likely tokens `ids`
    [slots, k] and their log-probabilities [slots, k] by the drafter, largest first (blockquant.top_log_probs
    with k = min(num_nodes, V): no tree of num_nodes needs a slot's guess past its num_nodes-th).

    DFlash predicts every slot in one forward, from the context and the mask tokens, not from the
    guesses before it: slot k's distribution is the drafter's marginal for the token k places
    ahead. Taking the slots as independent, a prefix's probability is the product of its tokens'.
    Best-first search adds the most likely prefix not yet in the tree; a prefix is never more
    likely than the one it extends, nor than its next more likely sibling, so both join before it,
    and every node's parent precedes it. A chain of the slots' top tokens is the tree whose every
    slot is sure; where slot 1 hesitates, its second guess outranks slot 3's first.
    """
    scores, ids = log_probs.tolist(), ids.tolist()
    tokens: list[int] = []
    parents: list[int] = []
    # Frontier of prefixes not yet in the tree: (-log-probability, slot, rank at that slot, parent node).
    frontier = [(-scores[0][0], 0, 0, -1)]
    while frontier and len(tokens) < num_nodes:
        cost, slot, rank, parent = heapq.heappop(frontier)
        tokens.append(ids[slot][rank])
        parents.append(parent)
        if rank + 1 < len(ids[slot]):  # the next sibling: the same parent, the slot's next guess
            heapq.heappush(frontier, (cost + scores[slot][rank] - scores[slot][rank + 1], slot, rank + 1, parent))
        if slot + 1 < len(ids):  # the first child: this prefix, then the next slot's top guess
            heapq.heappush(frontier, (cost - scores[slot + 1][0], slot + 1, 0, len(tokens) - 1))
    return DraftTree(tokens, parents)


class DFlashProposer(ModelProposer):
    context_cache: KVCache | None = None  # per sequence: the projected target features, made by begin()

    def __init__(self, target: Transformer, drafter: "DFlashDrafter", num_speculative_tokens: int, tree: bool = False,
                 prompt_lookup: int = 0):
        """`tree`: draft the `num_speculative_tokens` most likely prefixes of the block (draft_tree),
        not one token per slot."""
        super().__init__(target, drafter, num_speculative_tokens, prompt_lookup)
        self.tree = tree

    def begin(self, capacity: int) -> None:
        super().begin(capacity)
        cfg = self.drafter.config  # room for a block after the context (DFlashDrafter.draft_slots)
        self.context_cache = KVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim,
                                     capacity + cfg.block_size, native.cache_dtype(self.drafter.native_layers))
        self.pending = []

    @torch.inference_mode()
    def propose_batch(self, work: list[tuple["DFlashProposer", list[int], int]]) -> list[list[int]]:
        """Drafts for many sequences ((its proposer, its committed tokens, most drafts) each): one
        drafter forward for all of their new context, one for all of their blocks. A sequence that
        drafts nothing this step (adaptive speculation chose 0) keeps its features pending: they
        are projected, all at once, when it next drafts, so a drafter that is not drafting costs
        nothing but the target's taps."""
        counts = [min(proposer.num_speculative_tokens, max_drafts) for proposer, _, max_drafts in work]
        drafting = [(proposer, tokens) for (proposer, tokens, _), count in zip(work, counts) if count > 0]
        if not drafting:
            return [[] for _ in work]
        self._project_context([proposer for proposer, _ in drafting])
        # The context covers every committed token but the last, so each block starts at that token.
        cfg, block_size = self.drafter.config, self.drafter.config.block_size
        embeddings = self.target.embed_tokens.weight
        # Each block: that token, then mask tokens, embedded in a new tensor (draft_slots overwrites it).
        block_embeds = embeddings[cfg.mask_token_id].repeat(len(drafting) * block_size, 1)
        block_embeds[::block_size] = embeddings[[tokens[-1] for _, tokens in drafting]]
        caches = [proposer.context_cache for proposer, _ in drafting]
        # Slot i (i >= 1) predicts the token i places after the last committed one. No draft, chain
        # or tree, reaches deeper than its sequence's count.
        logits = self.drafter.draft_slots(block_embeds, caches, max(counts), self.head)
        if self.tree:  # every drafting sequence's slots' most likely guesses, in one call
            width = min(max(counts), logits.shape[-1])
            log_probs, ids = (top.view(*logits.shape[:2], width)
                              for top in blockquant.top_log_probs(logits.view(-1, logits.shape[-1]), width))
            drafted = iter(zip(log_probs, ids))  # one per sequence with a count above 0
            trees = [draft_tree(*(top[:count, :count] for top in next(drafted)), count) if count > 0 else None
                     for count in counts]
            return [DraftTree(self.head.to_target(torch.tensor(tree.tokens)).tolist(), tree.parents) if tree else []
                    for tree in trees]
        guesses = iter(self.head.to_target(logits.argmax(dim=-1)).tolist())
        return [next(guesses)[:count] if count > 0 else [] for count in counts]

    def _project_context(self, proposers: list["DFlashProposer"]) -> None:
        """Project the target features committed since the last step into each sequence's context
        keys/values, for all sequences at once (DFlashDrafter.project_context); they never change afterwards."""
        pending = [proposer for proposer in proposers if proposer.pending]
        if pending:
            self.drafter.project_context([(proposer.context_cache, torch.cat(proposer.pending)) for proposer in pending])
        for proposer in pending:
            proposer.pending = []


def random_drafter(config: DFlashConfig, seed: int) -> DFlashDrafter:
    return checkpoint.seeded(lambda: DFlashDrafter(config), seed)


def load_dflash(folder: str | Path) -> DFlashDrafter:
    """A DFlash drafter in z-lab's layout or the speculators layout."""
    return checkpoint.load(folder, lambda config: DFlashDrafter(DFlashConfig.from_config(config)))


def save_dflash(drafter: DFlashDrafter, folder: str | Path, dtype: torch.dtype | None = None) -> Path:
    return checkpoint.save(drafter, drafter.config.to_zlab(), folder, dtype)


def build_dflash(target: Transformer, options: ProposerOptions) -> DFlashProposer:
    source = drafter_source("dflash", options)
    if source == "random":
        if options.mask_token_id is None:
            raise DrafterError("a random DFlash drafter needs a mask token id")
        block_size = options.num_speculative_tokens + 1 if options.num_speculative_tokens else DEFAULT_BLOCK_SIZE
        config = DFlashConfig.for_target(target.config, 2, block_size, options.mask_token_id)
        drafter = random_drafter(config, options.seed)
    else:
        drafter = load_dflash(source)
    check_matches_target("dflash", drafter.config, target.config)
    fuse_projections(drafter, int8_activations=int8_drafting())
    if native.runs(drafter.layers, drafter.config.head_dim) and drafter.fc.int8_blocks is not None:
        drafter.native_layers = native.NativeLayers(drafter.layers, drafter.config.layer_config())
    max_drafts = drafter.config.block_size - 1
    point = checkpoint.operating_point(source, options, max_drafts)
    if point.num_speculative_tokens > max_drafts and not point.draft_tree:  # a tree's drafts spread over the block's slots
        raise DrafterError(f"num_speculative_tokens {point.num_speculative_tokens} exceeds the drafter's block size - 1 ({max_drafts})")
    return DFlashProposer(target, drafter, point.num_speculative_tokens, point.draft_tree, point.prompt_lookup)
