"""Decoder layers in C (decoder.c): every layer, for every segment of a batched forward, in one call.

load_target builds them where every matrix product of the target runs on int8 blocks (layers.int8_target_products)
and its head vectors are whole AVX-512 registers; Transformer.forward_batch then calls `run` instead of looping
over its torch layers. The C layers read the same packed weights and norm parameters the modules hold (no copy),
and compute each row alone, in one fixed order, so a verify block's rows are plain decoding's bits. A DFlash
drafter's layers and its context projection, and an EAGLE-3 drafter's layer, on int8 products too, run the same
way (dflash.DFlashDrafter's draft_slots and project_context, eagle3.Eagle3Drafter.forward).
"""

import ctypes

import torch

from . import blockquant
from .blockquant import Int8Blocks
from .kv_cache import KVCache
from .layers import RMSNorm

pointer, size = ctypes.c_void_p, ctypes.c_int64
# The caches the C layers read and write hold keys and values as float16: a step of many sequences, or of one
# over a long prefix, is bound by reading them.
CACHE_DTYPE = torch.float16


def cache_dtype(layers: "NativeLayers | None", otherwise: torch.dtype = torch.float32) -> torch.dtype:
    """The dtype of the caches that `layers` read and write: CACHE_DTYPE for decoder.c's, `otherwise` for torch's."""
    return CACHE_DTYPE if layers is not None else otherwise


def check_cache(cache: KVCache) -> None:
    if cache.k.dtype != CACHE_DTYPE or cache.v.dtype != CACHE_DTYPE:
        raise ValueError(f"decoder.c's caches hold {CACHE_DTYPE}, not {cache.k.dtype}")


def bool_bytes(mask: torch.Tensor, shape: tuple[int, ...], name: str) -> torch.Tensor:
    """A bool mask of this shape, contiguous, whose bytes decoder.c reads (torch stores a bool as one byte, 0 or 1:
    no conversion to uint8 is needed)."""
    if mask.dtype != torch.bool or mask.shape != shape:
        raise ValueError(f"{name} is a bool mask {shape}, not {mask.dtype} {tuple(mask.shape)}")
    return mask.contiguous()


def check_tables(cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> None:
    for table in (cos, sin):
        if table.dtype != torch.float32 or not table.is_contiguous() or table.dim() != 2 or table.shape[1] != head_dim:
            raise ValueError(f"RoPE tables are contiguous float32 [positions, {head_dim}], not {table.dtype} "
                             f"{tuple(table.shape)}")
    if cos.shape != sin.shape:
        raise ValueError(f"the cos and sin tables differ in shape: {tuple(cos.shape)} and {tuple(sin.shape)}")


class Int8Weight(ctypes.Structure):  # decoder.c's int8_weight
    _fields_ = [("q4", pointer), ("q8", pointer), ("scale", pointer), ("minimum", pointer), ("n_out", size), ("k", size)]

    @classmethod
    def of(cls, blocks: Int8Blocks) -> "Int8Weight":
        q4, q8 = blocks.kernel_weights()
        return cls(q4.data_ptr() if q4 is not None else None, q8.data_ptr() if q8 is not None else None,
                   blocks.scale.data_ptr(), blocks.minimum.data_ptr() if blocks.minimum is not None else None,
                   *blocks.shape)


class LayerWeights(ctypes.Structure):  # decoder.c's layer_weights
    _fields_ = [("input_norm", pointer), ("post_norm", pointer), ("q_norm", pointer), ("k_norm", pointer),
                ("hidden_norm", pointer), ("qkv", Int8Weight), ("o", Int8Weight), ("gate_up", Int8Weight),
                ("down", Int8Weight)]


class SegmentView(ctypes.Structure):  # decoder.c's segment
    _fields_ = [("k", pointer), ("v", pointer), ("capacity", size), ("cached", size), ("rows", size),
                ("visible", pointer), ("cached_visible", pointer)]


class ModelShape(ctypes.Structure):  # decoder.c's model_shape
    _fields_ = [("layers", size), ("hidden", size), ("heads", size), ("kv_heads", size), ("head_dim", size),
                ("intermediate", size), ("eps", ctypes.c_float)]


def runs(layers, head_dim: int) -> bool:
    """Whether decoder.c can run these fused decoder layers: every product on int8 blocks, whole-register heads."""
    linears = [linear for layer in layers for linear in (layer.self_attn.qkv, layer.self_attn.o_proj,
                                                         layer.mlp.gate_up, layer.mlp.down_proj)]
    return head_dim % 16 == 0 and all(linear is not None and linear.int8_blocks is not None for linear in linears)


class NativeLayers:
    """Fused decoder layers (model.DecoderLayer: the target's, a DFlash drafter's; an EAGLE-3 drafter's layer) as
    decoder.c reads them: pointers into the modules' own tensors, which the model keeps alive (it holds this object)."""

    def __init__(self, layers, cfg):
        """layers: the fused layers, every product on int8 blocks (runs()); cfg: their sizes (a model.ModelConfig,
        an Eagle3Config)."""
        self.shape = ModelShape(len(layers), cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                                cfg.head_dim, cfg.intermediate_size, cfg.rms_norm_eps)
        self.layers = (LayerWeights * len(layers))()
        for weights, layer in zip(self.layers, layers):
            attention, mlp = layer.self_attn, layer.mlp
            norms = (layer.input_layernorm, layer.post_attention_layernorm, attention.q_norm, attention.k_norm,
                     getattr(layer, "hidden_norm", None))
            weights.input_norm, weights.post_norm, weights.q_norm, weights.k_norm, weights.hidden_norm = (
                norm.weight.data_ptr() if norm is not None else None for norm in norms)
            for name, linear in (("qkv", attention.qkv), ("o", attention.o_proj), ("gate_up", mlp.gate_up),
                                 ("down", mlp.down_proj)):
                setattr(weights, name, Int8Weight.of(linear.int8_blocks))

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
            batch: list[tuple[KVCache, torch.Tensor, torch.Tensor | None]], tap_layers: tuple[int, ...] = (),
            embeds: torch.Tensor | None = None, kept: torch.Tensor | None = None, norm: RMSNorm | None = None,
            head: Int8Blocks | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """x [N, H] (the segments' new rows end to end) through every layer, in place, each row at its position
        (int64 [N]) of the RoPE tables cos/sin [P, D] (RotaryEmbedding.tables). batch: per segment, its cache,
        `visible` [T, T] bool, the new rows each new row sees, and `cached_visible` [T, cache.length] bool, the cached
        slots each sees, or None: all; its rows' keys and values go into the cache after its length (which is the
        caller's to advance, or not). embeds [N, H]: an EAGLE-3 layer's token embeddings, x being its features.
        kept [N] bool, or None (all): the rows whose output the caller reads; the others skip the last layer's
        output projection and MLP, and come out of it as they went in (the last layer cannot be tapped then).
        norm: the model's norm after its last layer, applied here to the kept rows for its LM head, so that no torch
        operation runs between the layers and the head (right after the layers' products, on caches they evicted,
        torch's RMSNorm took 4-6 times its warm time). head (with norm): the
        LM head those rows then go through in the same call (its int8 blocks, H wide), for the same reason.
        -> (the tapped layers' outputs side by side in layer order [N, taps * H], or None;
            the kept rows, in order, through `norm` [kept rows, H] and then `head` [kept rows, its outputs], or None
            without a norm)."""
        for rows in (x, embeds) if embeds is not None else (x,):
            if rows.dtype != torch.float32 or not rows.is_contiguous() or rows.shape != (x.shape[0], self.shape.hidden):
                raise ValueError(f"decoder_layers take contiguous float32 rows of {self.shape.hidden}, not "
                                 f"{rows.dtype} {tuple(rows.shape)}")
        check_tables(cos, sin, self.shape.head_dim)
        if positions.dtype != torch.int64 or positions.shape != (x.shape[0],) or not positions.is_contiguous():
            raise ValueError(f"positions are contiguous int64 [{x.shape[0]}], not {positions.dtype} {tuple(positions.shape)}")
        masks = []  # kept alive through the call; decoder.c reads a bool tensor's bytes (0 or 1) as they are
        for cache, visible, cached_visible in batch:
            check_cache(cache)
            cache.check_room(visible.shape[0])
            rows = visible.shape[0]
            masks.append([bool_bytes(visible, (rows, rows), "visible"),
                          bool_bytes(cached_visible, (rows, cache.length), "cached_visible")
                          if cached_visible is not None else None])
        segments = (SegmentView * len(batch))(*(
            SegmentView(cache.k.data_ptr(), cache.v.data_ptr(), cache.capacity, cache.length, visible.shape[0],
                        visible.data_ptr(), cached_visible.data_ptr() if cached_visible is not None else None)
            for (cache, _, _), (visible, cached_visible) in zip(batch, masks)))
        tapped = bytes(layer in tap_layers for layer in range(self.shape.layers))
        taps = torch.empty(x.shape[0], sum(tapped) * self.shape.hidden) if any(tapped) else None
        if kept is not None:
            kept = bool_bytes(kept, (x.shape[0],), "kept")  # kept alive through the call
        normed = None
        if norm is not None:
            if norm.weight.shape != (self.shape.hidden,) or norm.weight.dtype != torch.float32:
                raise ValueError(f"the final norm's weight must be float32 [{self.shape.hidden}], not "
                                 f"{norm.weight.dtype} {tuple(norm.weight.shape)}")
            normed = torch.empty(int(kept.sum()) if kept is not None else x.shape[0], self.shape.hidden)
        logits = head_weight = None
        if head is not None:
            if norm is None:
                raise ValueError("an LM head in decoder_layers needs the final norm before it")
            if head.shape[1] != self.shape.hidden:
                raise ValueError(f"an LM head in decoder_layers takes {self.shape.hidden} values a row, not {head.shape[1]}")
            head_weight = Int8Weight.of(head)
            logits = torch.empty(normed.shape[0], head.shape[0])
        status = blockquant.library().decoder_layers(
            ctypes.byref(self.layers), ctypes.byref(self.shape), x.data_ptr(),
            embeds.data_ptr() if embeds is not None else None, x.shape[0], cos.data_ptr(), sin.data_ptr(), cos.shape[0],
            positions.data_ptr(), segments, len(batch), tapped, taps.data_ptr() if taps is not None else None,
            kept.data_ptr() if kept is not None else None, norm.weight.data_ptr() if norm is not None else None,
            norm.eps if norm is not None else 0.0, normed.data_ptr() if normed is not None else None,
            ctypes.byref(head_weight) if head_weight is not None else None,
            logits.data_ptr() if logits is not None else None)
        if status != 0:
            raise ValueError(f"decoder_layers refused {x.shape[0]} rows in {len(batch)} segments: status {status}")
        return taps, logits if logits is not None else normed

    def write_context(self, fc: Int8Blocks, hidden_norm: torch.Tensor, features: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor, cache: KVCache) -> None:
        """A DFlash drafter's context (decoder.c's dflash_context): features [T, k] of T newly committed tokens ->
        fc, hidden_norm, then each layer's keys (RoPE at the positions after the cache's length, of the tables
        cos/sin [P, D]) and values into the cache after its length, which the caller advances."""
        check_cache(cache)
        check_tables(cos, sin, self.shape.head_dim)
        cache.check_room(features.shape[0])
        features = features.contiguous()
        status = blockquant.library().dflash_context(
            ctypes.byref(self.layers), ctypes.byref(self.shape), ctypes.byref(Int8Weight.of(fc)), hidden_norm.data_ptr(),
            features.data_ptr(), features.shape[0], cos.data_ptr(), sin.data_ptr(), cos.shape[0], cache.k.data_ptr(),
            cache.v.data_ptr(), cache.capacity, cache.length)
        if status != 0:
            raise ValueError(f"dflash_context refused {features.shape[0]} rows of {features.shape[1]}: status {status}")
