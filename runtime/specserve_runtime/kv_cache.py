"""A preallocated key/value cache for one sequence, with rollback by cropping."""

import torch


class KVCache:
    """Keys and values of every layer, [layers, kv_heads, capacity, head_dim].

    `length` counts the positions whose keys and values are valid. A forward of T new tokens
    writes slots [length, length + T) in every layer and then advances `length` by T.
    Rejected draft positions are dropped with `crop`: their slots stay allocated and are
    overwritten by the next forward, so rollback costs nothing. A draft tree's accepted branch
    is not contiguous in the slots the forward wrote: `keep` moves it down first.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int, dtype=torch.float32):
        shape = (num_layers, num_kv_heads, capacity, head_dim)
        self.k = torch.zeros(shape, dtype=dtype)
        self.v = torch.zeros(shape, dtype=dtype)
        self.capacity = capacity
        self.length = 0

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k/v [1, kv_heads, T, D] after `length`; return all valid keys/values of the layer."""
        self.check_room(k.shape[2])
        end = self.length + k.shape[2]
        self.k[layer, :, self.length : end] = k[0]
        self.v[layer, :, self.length : end] = v[0]
        return self.k[layer, :, :end].unsqueeze(0), self.v[layer, :, :end].unsqueeze(0)

    def check_room(self, num_new: int) -> None:
        """Raise unless `num_new` slots fit after `length` (a forward writes them before advancing)."""
        if self.length + num_new > self.capacity:
            raise ValueError(f"KV cache overflow: {self.length + num_new} positions needed, capacity {self.capacity}")

    def get(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """All valid keys/values of a layer, [1, kv_heads, length, D]."""
        return self.k[layer, :, : self.length].unsqueeze(0), self.v[layer, :, : self.length].unsqueeze(0)

    def advance(self, num_tokens: int) -> None:
        self.length += num_tokens

    def crop(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot crop a cache of length {self.length} to {length}")
        self.length = length

    def keep(self, start: int, slots: list[int]) -> None:
        """Keep, after the first `start` positions, only `slots` (ascending, all >= start), moved
        down to start, start + 1, ...: the accepted branch of a draft tree."""
        if any(slot < start or slot >= self.length for slot in slots) or slots != sorted(set(slots)):
            raise ValueError(f"cannot keep slots {slots} after {start} in a cache of length {self.length}")
        end = start + len(slots)
        if slots != list(range(start, end)):  # a chain's accepted drafts are in place already
            index = torch.tensor(slots)
            self.k[:, :, start:end] = self.k[:, :, index]  # indexing copies: overlapping ranges are safe
            self.v[:, :, start:end] = self.v[:, :, index]
        self.crop(end)
