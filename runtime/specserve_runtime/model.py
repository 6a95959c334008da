"""The target transformer (Llama and Qwen3 architectures) with hidden-state taps.

A forward over T new tokens appends their keys/values to a KVCache and returns the logits
and, on request, the outputs of chosen decoder layers ("taps"): the context features that
the DFlash and EAGLE-3 drafters condition on. Layer id i means the output of decoder layer i
(0-based), i.e. Hugging Face's `hidden_states[i + 1]`.

A batched forward runs several sequences at once, as vLLM does: their new tokens are laid end
to end (no padding), so every matrix product reads the weights once for the whole batch, and
only attention runs per sequence, against that sequence's own KV cache.
"""

import itertools
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from . import blockquant, native
from .errors import ModelError
from .kv_cache import KVCache
from .layers import (
    MLP,
    Attention,
    RMSNorm,
    RotaryEmbedding,
    causal_mask,
    fuse_projections,
    int8_target_products,
    tree_mask,
)
from .native import NativeLayers
from .verify import tree_depths

SUPPORTED_ARCHITECTURES = {"llama": False, "qwen3": True}  # model_type -> per-head q/k norm


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    tie_word_embeddings: bool
    max_position_embeddings: int

    @property
    def qk_norm(self) -> bool:
        return SUPPORTED_ARCHITECTURES[self.model_type]

    @classmethod
    def from_hf(cls, hf: dict) -> "ModelConfig":
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise ModelError(f"unsupported model_type {model_type!r}; supported: {sorted(SUPPORTED_ARCHITECTURES)}")
        # transformers 5 moved rope settings into rope_parameters; 4.x keeps rope_theta/rope_scaling.
        rope = hf.get("rope_parameters") or {}
        scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        heads = hf["num_attention_heads"]
        return cls(
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads", heads),
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", hf.get("rope_theta", 10000.0)),
            rope_scaling=scaling,
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
        )


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer: causal attention over the KV cache, then a SwiGLU MLP."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h = cfg.hidden_size
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.self_attn = Attention(
            h, h, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.qk_norm, cfg.rms_norm_eps
        )
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.mlp = MLP(h, cfg.intermediate_size)

    def forward(self, x, cos, sin, batch: list["Segment"], layer: int, masks: list) -> torch.Tensor:
        """x [N, H]: the new tokens of every segment, end to end; masks: each segment's mask()."""
        x = x + self._attention(self.input_layernorm(x), cos, sin, batch, layer, masks)
        return x + self.mlp(self.post_attention_layernorm(x))

    def _attention(self, h, cos, sin, batch: list["Segment"], layer: int, masks: list) -> torch.Tensor:
        """RoPE in torch, then SDPA over each segment's rows at once, against its cache -> [N, H]."""
        q, k, v = self.self_attn.query_key_value(h, cos, sin)  # [1, heads, N, D]
        sizes = [segment.num_tokens for segment in batch]
        attended = []
        for segment, mask, q_s, k_s, v_s in zip(batch, masks, q.split(sizes, 2), k.split(sizes, 2), v.split(sizes, 2)):
            k_all, v_all = segment.cache.write(layer, k_s, v_s)
            attended.append(self.self_attn.attend(q_s, k_all, v_all, mask))
        return self.self_attn.project_out(torch.cat(attended, dim=2))


@dataclass
class Segment:
    """One sequence's part of a batched forward: new tokens placed right after its cached ones."""

    tokens: torch.Tensor  # [T]
    cache: KVCache
    num_logits: int  # logits for the last this-many new tokens: all of a verify block, the last of a prompt, or none
    parents: list[int] | None = None  # new tokens that form a tree: the new token each follows (-1: the cached
    # ones), parents first. None: each follows the one before.

    @property
    def num_tokens(self) -> int:
        return self.tokens.shape[0]

    def positions(self) -> list[int]:
        """Each new token's position: its own sequence's, so a tree's siblings share one."""
        start = self.cache.length
        if self.parents is None:
            return list(range(start, start + self.num_tokens))
        return [start - 1 + depth for depth in tree_depths(self.parents)]

    def mask(self) -> torch.Tensor | None:
        if self.parents is None:
            return causal_mask(self.num_tokens, self.cache.length + self.num_tokens)
        return tree_mask(self.parents, self.cache.length)

    def visible(self) -> torch.Tensor:
        """[T, T] bool: the new tokens each new token sees besides the cached ones (mask()'s last T columns)."""
        if self.parents is None:
            return torch.ones(self.num_tokens, self.num_tokens, dtype=torch.bool).tril()
        return tree_mask(self.parents, 0)


@dataclass
class TargetOutput:
    logits: torch.Tensor  # [num_logits, V]: the last rows of the segment's new tokens
    taps: torch.Tensor | None  # [T, len(tap_layers) * H]: tapped layer outputs, concatenated


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.native_layers: NativeLayers | None = None  # decoder.c instead of the torch layers (load_target)

    @property
    def activations(self) -> str:
        """What its matrix products multiply the weights by: "int8" rows (decoder.c's layers) or "float32"."""
        return "int8" if self.native_layers is not None else "float32"

    @property
    def cache_dtype(self) -> torch.dtype:
        """Its caches' keys and values: decoder.c's float16 where its layers run in C, else its weights' dtype."""
        return native.cache_dtype(self.native_layers, self.lm_head.weight.dtype)

    def new_cache(self, capacity: int) -> KVCache:
        cfg = self.config
        return KVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, capacity, self.cache_dtype)

    def forward(
        self,
        tokens: torch.Tensor,  # [T] new tokens, placed right after the cached ones
        cache: KVCache,
        tap_layers: tuple[int, ...] = (),
        last_logits_only: bool = False,
    ) -> TargetOutput:
        """One sequence: a batch of one."""
        (out,) = self.forward_batch([Segment(tokens, cache, 1 if last_logits_only else tokens.shape[0])], tap_layers)
        return out

    @torch.inference_mode()
    def forward_batch(self, batch: list[Segment], tap_layers: tuple[int, ...] = ()) -> list[TargetOutput]:
        """Every segment's logits (its last `num_logits` rows) and taps; each cache grows by its segment."""
        sizes = [segment.num_tokens for segment in batch]
        # Each token's position continues its own sequence, so RoPE and the masks are per segment.
        positions = [position for segment in batch for position in segment.positions()]
        x = self.embed_tokens(torch.cat([segment.tokens for segment in batch]))  # [N, H]
        ends = list(itertools.accumulate(sizes))
        rows = [row for segment, end in zip(batch, ends) for row in range(end - segment.num_logits, end)]
        if self.native_layers is not None:
            kept = None  # a prompt's rows before its last lend the last layer only their keys and values
            if len(rows) < len(x) and self.config.num_hidden_layers - 1 not in tap_layers:
                kept = torch.zeros(len(x), dtype=torch.bool)
                kept[rows] = True
            segments = [(s.cache, s.visible(), None) for s in batch]
            cos, sin = self.rotary.tables(max(positions) + 1)
            # The LM head in the same call (its int8 blocks are there whenever decoder.c's layers are), unless the
            # last layer is tapped in a prompt: then every row is normed, and only the rows read go through the head.
            every_row_read = kept is not None or len(rows) == len(x)
            head = self.lm_head.int8_blocks if every_row_read else None
            taps, out = self.native_layers.run(x, cos, sin, torch.tensor(positions), segments, tap_layers, kept=kept,
                                               norm=self.norm, head=head)
            logits = out if head is not None else self.lm_head(out[rows])
        else:
            cos, sin = self.rotary(torch.tensor(positions))
            masks = [segment.mask() for segment in batch]
            tapped_outputs = []
            for i, layer in enumerate(self.layers):
                x = layer(x, cos, sin, batch, i, masks)
                if i in tap_layers:
                    tapped_outputs.append(x)
            taps = torch.cat(tapped_outputs, dim=-1) if tapped_outputs else None
            logits = self.lm_head(self.norm(x[rows]))
        logits = logits.split([segment.num_logits for segment in batch])
        tapped = taps.split(sizes) if taps is not None else [None] * len(batch)
        for segment in batch:
            segment.cache.advance(segment.num_tokens)
        return [TargetOutput(*out) for out in zip(logits, tapped)]


def load_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of a Hugging Face folder (single or sharded safetensors)."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelError(f"no *.safetensors weights in {folder}")
    state = {}
    for file in files:
        try:
            state.update(load_file(file))
        except Exception as exc:  # safetensors raises its own error types for truncated files
            raise ModelError(f"cannot read {file}: {exc}") from exc
    return state


def load_target(folder: str | Path, dtype=torch.float32) -> Transformer:
    """Load a Llama- or Qwen3-architecture model from a Hugging Face folder."""
    folder = Path(folder)
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ModelError(f"{folder} is not a Hugging Face model folder (no config.json)")
    cfg = ModelConfig.from_hf(json.loads(config_file.read_text()))
    with torch.device("meta"):
        model = Transformer(cfg)
    state = {name.removeprefix("model."): t.to(dtype) for name, t in load_state_dict(folder).items()}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
        state["lm_head.weight"] = state["embed_tokens.weight"]
    missing = set(model.state_dict()) - set(state)
    if missing:
        raise ModelError(f"{folder}: weights missing for {sorted(missing)[:5]}")
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    # The target only ever runs inference: fewer, larger matrix products, on packed weights.
    model = fuse_projections(model.eval().requires_grad_(False))
    # On int8 rows, with decoder.c's layers, whose row-exact attention keeps a verified row's bits those of a
    # one-token step (head vectors of whole 16-float registers).
    if (blockquant.int8_switch("SPECSERVE_TARGET_INT8", "1", ModelError) and cfg.head_dim % 16 == 0
            and int8_target_products(model)):
        model.native_layers = NativeLayers(model.layers, cfg)
    return model
