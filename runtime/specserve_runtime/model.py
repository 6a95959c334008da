"""The target transformer (Llama and Qwen3 architectures) with hidden-state taps.

A forward over T new tokens appends their keys/values to a KVCache and returns the logits
and, on request, the outputs of chosen decoder layers ("taps"): the context features that
the DFlash and EAGLE-3 drafters condition on. Layer id i means the output of decoder layer i
(0-based), i.e. Hugging Face's `hidden_states[i + 1]`.
"""

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from .errors import ModelError
from .kv_cache import KVCache
from .layers import MLP, Attention, RMSNorm, RotaryEmbedding, causal_mask, fuse_projections

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

    def forward(self, x, cos, sin, cache: KVCache, layer: int, mask):
        q, k, v = self.self_attn.query_key_value(self.input_layernorm(x), cos, sin)
        k, v = cache.write(layer, k, v)
        x = x + self.self_attn.output(q, k, v, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


@dataclass
class TargetOutput:
    logits: torch.Tensor  # [T, V] (or [1, V] when only the last position was asked for)
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

    def new_cache(self, capacity: int) -> KVCache:
        cfg = self.config
        return KVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, capacity, self.lm_head.weight.dtype)

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,  # [T] new tokens, placed right after the cached ones
        cache: KVCache,
        tap_layers: tuple[int, ...] = (),
        last_logits_only: bool = False,
    ) -> TargetOutput:
        start, num_new = cache.length, tokens.shape[0]
        cos, sin = self.rotary(torch.arange(start, start + num_new))
        mask = causal_mask(num_new, start + num_new)
        x = self.embed_tokens(tokens)  # [T, H]
        taps = []
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, cache, i, mask)
            if i in tap_layers:
                taps.append(x)
        cache.advance(num_new)
        if last_logits_only:
            x = x[-1:]
        return TargetOutput(self.lm_head(self.norm(x)), torch.cat(taps, dim=-1) if taps else None)


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
    # The target only ever runs inference: fewer, larger matrix products.
    return fuse_projections(model.eval().requires_grad_(False))
