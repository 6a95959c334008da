"""Matrix products on the GGUF file's own block-quantised weights (blockquant.c).

The default target's float32 weights are decoded from a GGUF file (store.py): every 32 weights
along a row of a layer's matrix are d * q + min of one Q4_1 block, and the embedding's (the tied
LM head's) d * q of one Q8_0 block. `exact_blocks` finds those blocks again, and keeps them only
if they give back every float32 value bit for bit, so the kernel multiplies by exactly the
weights the float32 path does, from 3.6x (Q8_0) to 5.3x (Q4_1) fewer bytes (a one-token step
reads every weight once and is bound by those reads). Other weights (a trained drafter's, a
checkpoint in float32) have no such blocks and keep oneDNN's layout (layers.PackedLinear), except
a drafter's: `int8_blocks` rounds them to Q4_1 (its numbers decide only what it proposes). Where
the CPU has AVX-512 VNNI, products round their rows to int8 too, integer dot products as llama.cpp
computes them: the drafters' always, the target's on its exact blocks (SPECSERVE_TARGET_INT8).

The kernel is plain C with AVX-512 and AVX2 paths chosen at run time (int8 rows: AVX-512 VNNI
only), compiled once per source into the cache on first use (a C compiler is needed then; images
ship it built, Dockerfile). It sums each output in one fixed order whatever the number of rows, so
a row's product has the same bits alone, in a verify block or in a batch. Set
SPECSERVE_BLOCKQUANT=0 to turn it off (SPECSERVE_DRAFTER_INT8=0, SPECSERVE_TARGET_INT8=0: the drafters' or
the target's int8 products only). The same library holds the target's row-exact attention (attention.c)
and its decoder layers (decoder.c).
"""

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from .store import cache_root

log = logging.getLogger(__name__)

# One library: the matrix products, the target's row-exact attention (attention.c) and its decoder layers
# (decoder.c, native.py), with the header they share.
SOURCES = tuple(Path(__file__).with_name(name) for name in ("blockquant.c", "attention.c", "decoder.c"))
HEADER = Path(__file__).with_name("kernels.h")
BLOCK = 32
# The compiler's flags: no -march, the source picks its instruction set per CPU at run time, so
# one build runs on any x86-64 machine. OpenMP resolves to the libgomp torch has already loaded.
CFLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC"]
ISA_NAMES = {3: "AVX-512 VNNI", 2: "AVX-512", 1: "AVX2"}


@dataclass
class Blocks:
    """A [n, k] weight as blocks of 32 along k: Q4_1 (`nibbles`, `scale`, `minimum`) or Q8_0 (`int8`, `scale`)."""
    shape: tuple[int, int]
    scale: torch.Tensor  # [n, k / 32] float32 (float16 values, as in the GGUF file: float32 reads faster)
    minimum: torch.Tensor | None = None  # Q4_1: [n, k / 32] float32
    nibbles: torch.Tensor | None = None  # Q4_1: [n, k / 32, 16] uint8, byte j = q[j] | q[j + 16] << 4
    int8: torch.Tensor | None = None  # Q8_0: [n, k / 32, 32] int8

    @property
    def format(self) -> str:
        return "Q4_1" if self.nibbles is not None else "Q8_0"

    def dequantize(self) -> torch.Tensor:
        if self.nibbles is not None:
            q = torch.cat([self.nibbles & 15, self.nibbles >> 4], dim=-1).float()
            values = q * self.scale[..., None] + self.minimum[..., None]
        else:
            values = self.int8.float() * self.scale[..., None]
        return values.reshape(self.shape)


def exact_blocks(weight: torch.Tensor) -> Blocks | None:
    """The weight as Q4_1 or Q8_0 blocks if every float32 value is exactly one block's value; else None.

    A Q4_1 block's smallest value is its minimum (q = 0) and its largest minimum + 15 d, both
    float16 numbers, so d and the minimum are read off each block; Q8_0's largest magnitude is
    127 d. The blocks are kept only if decoding them gives the weight back bit for bit.
    """
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.shape[1] % BLOCK:
        return None
    for rounded in (q4_1_blocks, q8_0_blocks):
        blocks = rounded(weight)
        if torch.equal(blocks.dequantize(), weight):
            return blocks
    return None


def q4_1_blocks(weight: torch.Tensor) -> Blocks:
    """A float32 [n, k] weight rounded to Q4_1 blocks: d = (max - min) / 15 and the minimum in float16, each
    weight the nearest of min + q d, q in 0..15."""
    rows = weight.detach().reshape(weight.shape[0], -1, BLOCK)
    low, high = rows.amin(-1), rows.amax(-1)
    scale, minimum = ((high - low) / 15).half().float(), low.half().float()
    q = torch.round((rows - minimum[..., None]) / torch.where(scale == 0, 1.0, scale)[..., None]).clamp(0, 15)
    q = q.to(torch.uint8)
    return Blocks(tuple(weight.shape), scale, minimum, nibbles=(q[..., :16] | (q[..., 16:] << 4)).contiguous())


def q8_0_blocks(weight: torch.Tensor) -> Blocks:
    """A float32 [n, k] weight rounded to Q8_0 blocks as llama.cpp rounds it: d = max|w| / 127 in float16."""
    rows = weight.detach().reshape(weight.shape[0], -1, BLOCK)
    scale = (rows.abs().amax(-1) / 127).half().float()
    q = torch.round(rows / torch.where(scale == 0, 1.0, scale)[..., None]).clamp(-127, 127)
    return Blocks(tuple(weight.shape), scale, int8=q.to(torch.int8).contiguous())


@dataclass
class Int8Blocks:
    """The same blocks laid out for int8 activations (blockquant.c, "int8 activations"): per group of
    16 outputs and block of 32 inputs, `weights` [n / 16, k / 32, bytes] uint8 and `scale` (and
    Q4_1's `minimum`) [n / 16, k / 32, 16] float32."""
    shape: tuple[int, int]
    format: str
    weights: torch.Tensor
    scale: torch.Tensor
    minimum: torch.Tensor | None = None

    def kernel_weights(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(q4, q8): the kernel's two weight arguments, the one of the other format None."""
        return (self.weights, None) if self.format == "Q4_1" else (None, self.weights)


GROUP = 16  # outputs per int8 group: the 16 int32 lanes of an AVX-512 register


# How int8_blocks rounds a weight that has no exact blocks (a drafter's): to Q4_1, 0.75 bytes a weight in the int8
# layout against Q8_0's 1.125. A DFlash drafting step is bound by reading its weights, which the target's forward
# has pushed out of the caches: on Q4_1 a DFlash step ran 1.02-1.04x faster for 0.3% of its tau, EAGLE-3 level.
ROUNDING = q4_1_blocks


def int8_blocks(weight: torch.Tensor, exact: Blocks | None) -> Int8Blocks | None:
    """A weight for products on int8 activations: its `exact` blocks where it has them (exact_blocks'
    answer for it), else its values rounded (ROUNDING); None where the int8 kernel does not run (no AVX-512
    VNNI, or a weight that is not float32 [n, k] with n a multiple of 16 and k of 32)."""
    if (not int8_enabled() or weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu"
            or weight.shape[0] % GROUP or weight.shape[1] % BLOCK):
        return None
    return int8_layout(exact or ROUNDING(weight))


def int8_layout(blocks: Blocks) -> Int8Blocks:
    """`blocks` interleaved for the int8 kernel (blockquant.c, "int8 activations"); n a multiple of 16."""
    n, k = blocks.shape
    groups, per_row = n // GROUP, k // BLOCK

    def by_group(values: torch.Tensor) -> torch.Tensor:  # [n, k / 32] -> [n / 16, k / 32, 16]
        return values.reshape(groups, GROUP, per_row).permute(0, 2, 1).contiguous()

    if blocks.nibbles is not None:
        q = torch.cat([blocks.nibbles & 15, blocks.nibbles >> 4], dim=-1)  # [n, k / 32, 32] in 0..15
        # chunk c of 8 inputs, lane i, byte j: q[i][8c + j] low, q[i][8c + 4 + j] high
        q = q.reshape(groups, GROUP, per_row, 4, 2, 4).permute(0, 2, 3, 1, 5, 4)
        weights = (q[..., 0] | (q[..., 1] << 4)).reshape(groups, per_row, 4 * 64)
        return Int8Blocks(blocks.shape, "Q4_1", weights.contiguous(), by_group(blocks.scale), by_group(blocks.minimum))
    q = (blocks.int8.to(torch.int16) + 128).to(torch.uint8)  # unsigned bytes, as VPDPBUSD multiplies them
    weights = q.reshape(groups, GROUP, per_row, 8, 4).permute(0, 2, 3, 1, 4).reshape(groups, per_row, 8 * 64)
    return Int8Blocks(blocks.shape, "Q8_0", weights.contiguous(), by_group(blocks.scale))


def linear(x: torch.Tensor, blocks: Blocks | Int8Blocks, isa: int | None = None) -> torch.Tensor:
    """x @ weight.T for a float32 x of any leading shape (`isa` picks a narrower path, for tests):
    on Int8Blocks, x rounded to int8 per block of 32, as llama.cpp does; on Blocks, x as it is."""
    n, k = blocks.shape
    int8 = isinstance(blocks, Int8Blocks)
    if int8:
        q4, q8 = blocks.kernel_weights()
    else:
        q4, q8 = blocks.nibbles, blocks.int8
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[-1] != k:
        raise ValueError(f"blockquant.linear takes float32 CPU rows of {k} values, not {x.dtype} {tuple(x.shape)}")
    rows = x.reshape(-1, k).contiguous()
    out = torch.empty(rows.shape[0], n, dtype=torch.float32)
    isa = best_isa() if isa is None else isa
    status = library().blockquant_linear(
        isa, int8, rows.data_ptr(), rows.shape[0], k,
        q4.data_ptr() if q4 is not None else None, q8.data_ptr() if q8 is not None else None,
        blocks.scale.data_ptr(), blocks.minimum.data_ptr() if blocks.minimum is not None else None, n, out.data_ptr())
    if status != 0:
        activations = "int8" if int8 else "float32"
        raise ValueError(f"blockquant_linear refused a {blocks.format} [{n}, {k}] product of {activations} rows "
                         f"on ISA {isa}")
    return out.reshape(*x.shape[:-1], n)


def row_kernels(x: torch.Tensor) -> tuple[ctypes.CDLL | None, torch.Tensor]:
    """The kernels and x's rows, contiguous, where blockquant.c's row operations (argmax, top_log_probs, sample) run on
    x: the library loaded and x float32 [N, V] on the CPU; else (None, x), and the caller takes torch's path."""
    kernels = library()
    if kernels is None or x.dim() != 2 or x.dtype != torch.float32 or x.device.type != "cpu":
        return None, x
    return kernels, x.contiguous()


def argmax(x: torch.Tensor) -> torch.Tensor:
    """Each row's argmax of x [N, V] -> int64 [N], the first of equal maxima (torch.argmax's rule): blockquant.c's
    on float32 CPU rows where it runs (AVX-512), else torch's. Why: torch's took 60-90 us a row of the target's
    49,152 logits, and greedy verification takes one a verified row."""
    kernels, rows = row_kernels(x)
    if kernels is None:
        return x.argmax(dim=-1)
    out = torch.empty(rows.shape[0], dtype=torch.int64)
    if kernels.blockquant_argmax(rows.data_ptr(), rows.shape[0], rows.shape[1], out.data_ptr()) != 0:
        return x.argmax(dim=-1)
    return out


def top_log_probs(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's k largest entries of x [N, V] as log-probabilities of the row's softmax, largest first, the first
    of equal ones first -> (values float32 [N, k], their indices int64 [N, k]): blockquant.c's on float32 CPU rows
    where it runs (AVX-512), else torch's log_softmax and a stable sort (topk does not say which of equal values
    comes first). Why: torch's log_softmax and topk took 100-170 us of a drafting step, on caches the step's products
    had evicted."""
    kernels, rows = row_kernels(x)
    if kernels is not None:
        values, indices = torch.empty(rows.shape[0], k), torch.empty(rows.shape[0], k, dtype=torch.int64)
        if kernels.blockquant_top_log_probs(rows.data_ptr(), *rows.shape, k, values.data_ptr(), indices.data_ptr()) == 0:
            return values, indices
    ranked = torch.log_softmax(x.float(), dim=-1).sort(dim=-1, descending=True, stable=True)
    return ranked.values[..., :k], ranked.indices[..., :k]


def sample(x: torch.Tensor, temperature: float, uniforms: torch.Tensor, top_p: float = 1.0) -> torch.Tensor | None:
    """A token of each row of x [N, V] drawn from softmax(x / temperature) with that row's uniform number in [0, 1)
    (float64 [N]), by inverting the cumulative distribution -> int64 [N]; with top_p < 1 from the row's nucleus only
    (the most likely tokens whose mass before them is below top_p, the first of equal ones first), in index order:
    blockquant.c's on float32 CPU rows where it runs (AVX-512), else None (the caller samples in torch; also for a
    row with NaN or +inf). Why: torch's float64 softmax, cumulative sum and search took 270 us a row of the target's
    49,152 logits, and its nucleus 0.4 ms more."""
    kernels, rows = row_kernels(x)
    if kernels is None:
        return None
    weights = uniforms.to(torch.float64).contiguous()
    out = torch.empty(rows.shape[0], dtype=torch.int64)
    if kernels.blockquant_sample(rows.data_ptr(), *rows.shape, 1.0 / temperature, top_p, weights.data_ptr(),
                                 out.data_ptr()) != 0:
        return None
    return out


def int8_switch(name: str, default: str, error: type[Exception]) -> bool:
    """An environment switch for int8 products: 1 on (where the CPU runs them, int8_enabled()), 0 off
    (float32); any other value raises `error`, naming the variable."""
    value = os.environ.get(name, default)
    if value not in ("0", "1"):
        raise error(f"{name} is 1 (int8 products) or 0 (float32 products), not {value!r}")
    return value == "1" and int8_enabled()


@functools.cache  # asked once: linear() runs on every matrix product of a step
def best_isa() -> int:
    """3 for AVX-512 with VNNI, 2 for AVX-512, 1 for AVX2 with FMA, 0 for neither (the kernel then does not run)."""
    kernels = library()
    return kernels.blockquant_best_isa() if kernels else 0


def enabled() -> bool:
    return best_isa() > 0


def int8_enabled() -> bool:
    """Whether products on int8 activations run here (AVX-512 VNNI)."""
    return best_isa() >= 3


def kernel_name() -> str | None:
    """The instruction set the kernel runs here ("AVX-512", "AVX2"), or None where it does not run."""
    return ISA_NAMES.get(best_isa())


def declare(kernels: ctypes.CDLL) -> ctypes.CDLL:
    """The entry points' argument and result types, set on a loaded build of the kernels (this one's, or another
    build of the same sources)."""
    kernels.blockquant_best_isa.restype = ctypes.c_int
    kernels.blockquant_linear.restype = ctypes.c_int
    kernels.blockquant_linear.argtypes = [
        ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    kernels.blockquant_argmax.restype = ctypes.c_int
    kernels.blockquant_argmax.argtypes = [pointer, size, size, pointer]
    kernels.blockquant_top_log_probs.restype = ctypes.c_int
    kernels.blockquant_top_log_probs.argtypes = [pointer, size, size, size, pointer, pointer]
    kernels.blockquant_sample.restype = ctypes.c_int
    kernels.blockquant_sample.argtypes = [pointer, size, size, ctypes.c_float, ctypes.c_double, pointer, pointer]
    kernels.decoder_layers.restype = kernels.dflash_context.restype = ctypes.c_int
    kernels.decoder_layers.argtypes = ([pointer] * 4 + [size] + [pointer] * 2 + [size] + [pointer] * 2 + [size]
                                       + [pointer] * 4 + [ctypes.c_float, pointer, pointer, pointer])
    kernels.dflash_context.argtypes = [pointer] * 5 + [size] + [pointer] * 2 + [size] + [pointer] * 2 + [size] * 2
    kernels.attention_rows.restype = ctypes.c_int  # one sequence's attention alone: for tests and experiments
    kernels.attention_rows.argtypes = [pointer, size, size] * 3 + [pointer] * 5 + [size] * 6 + [pointer] * 3
    return kernels


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels, or None (with the reason logged once) where they cannot run here."""
    if os.environ.get("SPECSERVE_BLOCKQUANT", "1") == "0":
        return None
    try:
        kernels = ctypes.CDLL(str(build()))
    except OSError as exc:  # no compiler, a failed build, a library that does not load
        log.warning("block-quantised kernels unavailable, float32 weights instead: %s", exc)
        return None
    declare(kernels)
    if kernels.blockquant_best_isa() == 0:
        log.warning("block-quantised kernels need AVX-512 or AVX2 with FMA: float32 weights instead")
        return None
    return kernels


def library_name() -> str:
    """blockquant-<the header's and sources' SHA-256, 16 hex digits>.so: a changed file is a new build."""
    digest = hashlib.sha256(b"".join(source.read_bytes() for source in (HEADER, *SOURCES)))
    return f"blockquant-{digest.hexdigest()[:16]}.so"


def source_names() -> str:
    return ", ".join(source.name for source in SOURCES)


def build(compiler: str | None = None) -> Path:
    """The kernels' shared library: prebuilt in $SPECSERVE_KERNELS (images) or the cache, else compiled there now."""
    for folder in (os.environ.get("SPECSERVE_KERNELS"), cache_root() / "kernels"):
        if folder and (Path(folder) / library_name()).is_file():
            return Path(folder) / library_name()
    compiler = compiler or os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        raise OSError(f"no C compiler {compiler!r} on PATH to build {source_names()} (set CC, or build it into "
                      f"$SPECSERVE_KERNELS as the Dockerfile does)")
    target = cache_root() / "kernels" / library_name()
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # built aside, renamed in: concurrent builds are safe
        built = Path(tmp) / target.name
        command = [compiler, *CFLAGS, "-o", str(built), *map(str, SOURCES)]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise OSError(f"{compiler} could not build {source_names()}: {result.stderr.strip()[-2000:]}")
        built.replace(target)
    log.info("built %s with %s", target, compiler)
    return target
