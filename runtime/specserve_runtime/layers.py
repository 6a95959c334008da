"""Transformer building blocks shared by the target model and both drafters.

Tensors for one sequence carry no batch axis: hidden states are [T, H] and attention
works on [1, heads, T, head_dim] so that SDPA's grouped-query support can be used.
"""

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from . import blockquant

BLOCKQUANT_MAX_ROWS = 8  # past it oneDNN is faster


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class MLP(nn.Module):
    """SwiGLU feed-forward, as in Llama and Qwen3."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.gate_up: PackedLinear | None = None  # set by fuse_projections()

    def fuse_projections(self, int8_activations: bool = False) -> None:
        """Inference: gate and up in one matrix product (their weights become views of the fused one)."""
        self.gate_up = PackedLinear(_fuse(self.gate_proj, self.up_proj), int8_activations)
        self.down_proj = PackedLinear(self.down_proj.weight, int8_activations)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is None:
            gate, up = self.gate_proj(x), self.up_proj(x)
        else:
            gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


def _fuse(*linears: nn.Linear) -> torch.Tensor:
    """One weight for several bias-free Linears on the same input; each keeps a view of its rows."""
    fused = torch.cat([linear.weight.detach() for linear in linears])
    for linear, rows in zip(linears, fused.split([linear.out_features for linear in linears])):
        linear.weight = nn.Parameter(rows, requires_grad=False)
    return fused


class PackedLinear(nn.Module):
    """An inference-only, bias-free linear map that also keeps its weight in faster layouts.

    Why: a decode step's matrix products are most of its time, and rows are what verifying
    drafts and batching sequences add. Three layouts, the first that applies:
    - int8 blocks: each row of x rounded to int8 per block of 32 as llama.cpp does, integer dot
      products (blockquant.c), every row count. A drafter's weights (int8_activations) are rounded
      to Q4_1 blocks (its head, the target's rows, keeps their exact Q8_0 blocks): its numbers change
      only what it proposes, never what verification commits. The target's, only where they are the GGUF file's blocks exactly (int8_target_products),
      with row-exact attention beside them (attention.c): each row's product has the same bits
      whatever the rows beside it, so verification computes plain decoding's logits;
    - the GGUF file's own blocks (blockquant.py), where the weight's float32 values are exactly
      Q4_1 or Q8_0 blocks (the default target's are): the same values from 3.6x (Q8_0) to 5.3x
      (Q4_1) fewer bytes, each row's product the same bits whatever the rows beside it; up to
      BLOCKQUANT_MAX_ROWS rows, past which the kernel's float32 FMAs cost more than oneDNN's GEMM;
    - oneDNN's blocked layout, prepacked once: torch's float32 F.linear runs MKL's GEMM, which on
      the AVX2 AMD EPYC we measured costs about 2x for 2 rows and 3x for 3 rows what it costs for
      1, while oneDNN's kernels cost the same for 1-3 rows and 1.6x for 8.
    The plain weight stays: views, the tied embedding and the drafters' heads read it. Results
    equal F.linear's up to float32 rounding (another summation order).
    """

    def __init__(self, weight: torch.Tensor, int8_activations: bool = False):
        super().__init__()
        if isinstance(weight, nn.Parameter):
            self.weight = weight  # a parameter keeps its state_dict name and its ties
        else:
            self.register_buffer("weight", weight, persistent=False)  # a fused weight is not in checkpoints
        self.out_features = weight.shape[0]
        self.packed = _onednn_layout(weight)
        self.blocks = blockquant.exact_blocks(weight) if blockquant.enabled() else None
        self.int8_blocks = blockquant.int8_blocks(weight, self.blocks) if int8_activations else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if self.int8_blocks is not None and rows > 0 and x.dtype == torch.float32:
            return blockquant.linear(x, self.int8_blocks)
        if self.blocks is not None and 0 < rows <= BLOCKQUANT_MAX_ROWS and x.dtype == torch.float32:
            return blockquant.linear(x, self.blocks)
        if self.packed is None or rows == 0:  # oneDNN's linear refuses an empty input
            return F.linear(x, self.weight)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")


def _onednn_layout(weight: torch.Tensor) -> torch.Tensor | None:
    if weight.dtype != torch.float32 or weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def fuse_projections(model: nn.Module, int8_activations: bool = False) -> nn.Module:
    """Inference only: fuse every attention's q/k/v and every MLP's gate/up (gradients would not reach the views),
    and give every matrix product a packed weight (the layers', the LM head, a drafter's feature projection).
    `int8_activations`: every product on int8 blocks where the CPU runs them (PackedLinear), for a drafter."""
    for module in list(model.modules()):  # a list: fusing replaces child modules
        if isinstance(module, (Attention, MLP)):
            module.fuse_projections(int8_activations)
        else:  # (an attention's or MLP's own Linears stay: views of its fused weights, read by separate_projections)
            for name, child in list(module.named_children()):
                if type(child) is nn.Linear and child.bias is None:  # the parameter, its name and ties are kept:
                    setattr(module, name, PackedLinear(child.weight, int8_activations))
    return model


def int8_target_products(model: nn.Module) -> bool:
    """Put every product of a fused target on int8 activations if every weight is the GGUF file's own
    blocks (PackedLinear.blocks: then only the activations are rounded, per block of 32 as llama.cpp
    rounds them, and each row's product keeps the same bits whatever the rows beside it); whether it did.
    Other weights would be rounded too, a model of their own: they stay float32."""
    linears = [m for m in model.modules() if isinstance(m, PackedLinear)]
    int8 = [blockquant.int8_blocks(m.weight, m.blocks) if m.blocks is not None else None for m in linears]
    if not linears or any(blocks is None for blocks in int8):
        return False
    for module, blocks in zip(linears, int8):
        module.int8_blocks = blocks
    return True


@contextlib.contextmanager
def separate_projections(model: nn.Module):
    """Run a fused model with its q/k/v and gate/up matrix products issued one by one (the weights are shared)."""
    fused = [(m, name, getattr(m, name)) for m in model.modules() for name in ("qkv", "gate_up")
             if getattr(m, name, None) is not None]
    for module, name, _ in fused:
        setattr(module, name, None)
    try:
        yield
    finally:
        for module, name, linear in fused:
            setattr(module, name, linear)


@contextlib.contextmanager
def weight_layouts(model: nn.Module, blocks: bool = False, onednn: bool = False, int8: bool = False):
    """Run a model's PackedLinears with only the layouts named (for side-by-side timing and tests):
    by default none, i.e. torch's F.linear on the plain weight. Without int8, decoder.c's layers are off too
    (a model's `native_layers`: they read the int8 blocks themselves), so its torch layers run."""
    saved = [(m, m.blocks, m.packed, m.int8_blocks) for m in model.modules() if isinstance(m, PackedLinear)]
    native = [(m, m.native_layers) for m in model.modules() if getattr(m, "native_layers", None) is not None]
    for module, kept_blocks, kept_packed, kept_int8 in saved:
        module.blocks = kept_blocks if blocks else None
        module.packed = kept_packed if onednn else None
        module.int8_blocks = kept_int8 if int8 else None
    for module, layers in native:
        module.native_layers = layers if int8 else None
    try:
        yield
    finally:
        for module, kept_blocks, kept_packed, kept_int8 in saved:
            module.blocks, module.packed, module.int8_blocks = kept_blocks, kept_packed, kept_int8
        for module, layers in native:
            module.native_layers = layers


class RotaryEmbedding(nn.Module):
    """Rotary position tables (Hugging Face's rotate-half convention), indexed by absolute position."""

    def __init__(self, head_dim: int, theta: float, scaling: dict | None = None):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        if scaling:
            inv_freq = _scale_inv_freq(inv_freq, scaling)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.register_buffer("cos", torch.empty(0, head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(0, head_dim), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> (cos, sin), each [T, head_dim]."""
        cos, sin = self.tables(int(positions.max()) + 1)
        return cos[positions], sin[positions]

    def tables(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole tables (cos, sin) [at least `length`, head_dim], grown to cover positions 0..length-1: decoder.c
        reads each row's position in them, so no rows are gathered for it."""
        if length > self.cos.shape[0]:
            self._grow(max(length, 2 * self.cos.shape[0], 1024))
        return self.cos, self.sin

    def _grow(self, length: int) -> None:
        freqs = torch.outer(torch.arange(length, dtype=torch.float32), self.inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos, self.sin = emb.cos(), emb.sin()


def _scale_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":  # Llama 3.1+: long wavelengths slowed down, short ones kept
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        mid = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        out = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        return torch.where((wavelen <= old_len / low) & (wavelen >= old_len / high), mid, out)
    raise ValueError(f"unsupported rope scaling type {kind!r} (supported: default, linear, llama3)")


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [1, heads, T, D]; cos/sin [T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def causal_mask(num_queries: int, num_keys: int) -> torch.Tensor | None:
    """Boolean mask for queries that are the last `num_queries` of `num_keys` positions.

    Query i sits at absolute position num_keys - num_queries + i and may see keys up to and
    including itself. A single query sees everything, so it needs no mask.
    """
    if num_queries == 1:
        return None
    offset = num_keys - num_queries
    q = torch.arange(num_queries).unsqueeze(1)
    k = torch.arange(num_keys).unsqueeze(0)
    return k <= q + offset


def tree_mask(parents: list[int], num_cached: int) -> torch.Tensor:
    """Boolean mask for new tokens that form a tree after `num_cached` cached positions (parents[i]:
    the new token that token i follows, -1 for the cached ones): each sees the cached positions,
    its ancestors and itself, never another branch."""
    size = len(parents)
    rows: list[list[bool]] = []  # the new tokens each sees, as Python lists: one torch operation, not two a token
    for index, parent in enumerate(parents):  # parents come first, so their rows are complete
        row = list(rows[parent]) if parent >= 0 else [False] * size
        row[index] = True
        rows.append(row)
    new = torch.tensor(rows, dtype=torch.bool).view(size, size)
    return torch.cat([torch.ones(size, num_cached, dtype=torch.bool), new], dim=1) if num_cached else new


class Attention(nn.Module):
    """Grouped-query attention projections; how keys and values are gathered is the caller's choice."""

    def __init__(
        self,
        in_features: int,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        qk_norm: bool,
        eps: float,
    ):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = nn.Linear(in_features, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(in_features, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(in_features, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False)
        # Qwen3 normalises every query and key head before RoPE; Llama does not.
        self.q_norm = RMSNorm(head_dim, eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, eps) if qk_norm else None
        self.qkv: PackedLinear | None = None  # set by fuse_projections()

    def fuse_projections(self, int8_activations: bool = False) -> None:
        """Inference: queries, keys and values in one matrix product."""
        self.qkv = PackedLinear(_fuse(self.q_proj, self.k_proj, self.v_proj), int8_activations)
        self.o_proj = PackedLinear(self.o_proj.weight, int8_activations)

    def _heads(self, x: torch.Tensor, num_heads: int) -> torch.Tensor:
        return x.view(x.shape[0], num_heads, self.head_dim).transpose(0, 1).unsqueeze(0)

    def query(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return self._query_heads(self.q_proj(x), cos, sin)

    def key_value(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        if self.qkv is None:
            k, v = self.k_proj(x), self.v_proj(x)
        else:  # the queries come along unused: on the few rows a step adds (DFlash's context), one
            _, k, v = self._fused_qkv(x)  # packed product costs less than two plain ones
        return self._key_value_heads(k, v, cos, sin)

    def query_key_value(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        if self.qkv is None:
            return self.query(x, cos, sin), *self.key_value(x, cos, sin)
        q, k, v = self._fused_qkv(x)
        return self._query_heads(q, cos, sin), *self._key_value_heads(k, v, cos, sin)

    def _fused_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.qkv(x).split([self.q_proj.out_features, self.k_proj.out_features, self.v_proj.out_features], dim=-1)

    def _query_heads(self, q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q = self._heads(q, self.num_heads)  # [1, heads, T, D]
        if self.q_norm is not None:
            q = self.q_norm(q)
        return apply_rope(q, cos, sin)

    def _key_value_heads(self, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        k, v = self._heads(k, self.num_kv_heads), self._heads(v, self.num_kv_heads)  # [1, kv_heads, T, D]
        if self.k_norm is not None:
            k = self.k_norm(k)
        return apply_rope(k, cos, sin), v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None):
        """Queries [1, heads, T, D] over keys/values [1, kv_heads, S, D] -> attended values [1, heads, T, D].
        Keys and values read from a cache of decoder.c's float16 (native.CACHE_DTYPE) attend in the queries' dtype."""
        return F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, enable_gqa=True)

    def project_out(self, attended: torch.Tensor) -> torch.Tensor:
        """Attended values [1, heads, T, D] -> [T, H]."""
        return self.o_proj(attended.squeeze(0).transpose(0, 1).reshape(attended.shape[2], -1))
