"""Fixtures: tiny random targets saved as real Hugging Face folders, and the real SmolLM2 target."""

import pytest
import torch

from specserve_runtime import blockquant
from specserve_runtime.model import load_target


def save_tiny_hf_model(folder, model_type="llama", vocab_size=96, **overrides):
    """A randomly initialised transformers model of the given architecture, saved with save_pretrained."""
    from transformers import AutoConfig, AutoModelForCausalLM

    settings = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rope_theta=10000.0,
        tie_word_embeddings=model_type == "llama",
        eos_token_id=2,
        initializer_range=0.2,  # wide enough that greedy output varies and sampling has many live tokens
    )
    settings.update(overrides)
    config = AutoConfig.for_model(model_type, **settings)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    return model.eval()


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_hf_model(folder, "llama")
    return folder


@pytest.fixture(scope="session")
def tiny_llama(tiny_llama_dir):
    return load_target(tiny_llama_dir)


def gguf_values(weight: torch.Tensor, fmt: str) -> torch.Tensor:
    """The float32 values a GGUF file's Q4_1 or Q8_0 blocks of this weight decode to (llama.cpp's quantisers)."""
    rows = weight.reshape(weight.shape[0], -1, 32)
    if fmt == "Q4_1":
        low = rows.amin(-1, keepdim=True)
        scale = ((rows.amax(-1, keepdim=True) - low) / 15).half().float()
        q = torch.round((rows - low) / torch.where(scale == 0, 1.0, scale)).clamp(0, 15)
        return (q * scale + low.half().float()).reshape(weight.shape)
    scale = (rows.abs().amax(-1, keepdim=True) / 127).half().float()
    q = torch.round(rows / torch.where(scale == 0, 1.0, scale)).clamp(-127, 127)
    return (q * scale).reshape(weight.shape)


def save_tiny_blocks_model(folder, model_type="llama", **overrides):
    """A tiny model with weights as the default target's GGUF file stores them: layers in Q4_1, the embedding and
    any LM head in Q8_0; so its PackedLinears run the block-quantised kernels (blockquant.py). Its norms' weights
    are random too (transformers initialises them to ones), so that mixing two of them up changes its outputs."""
    model = save_tiny_hf_model(folder, model_type, **overrides)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() == 2:
                parameter.copy_(gguf_values(parameter, "Q8_0" if "embed_tokens" in name or "lm_head" in name else "Q4_1"))
            else:
                parameter.uniform_(0.5, 1.5, generator=generator)
    model.save_pretrained(folder)
    return model


@pytest.fixture(scope="session")
def tiny_llama_blocks_dir(tmp_path_factory):
    """The tiny llama with GGUF block weights (save_tiny_blocks_model)."""
    folder = tmp_path_factory.mktemp("tiny-llama-blocks")
    save_tiny_blocks_model(folder, "llama")
    return folder


def load_with_target_int8(folder, value: str):
    with pytest.MonkeyPatch.context() as env:
        env.setenv("SPECSERVE_TARGET_INT8", value)
        return load_target(folder)


@pytest.fixture(scope="session")
def tiny_llama_blocks(tiny_llama_blocks_dir):
    """Its products on the blocks with float32 activations (SPECSERVE_TARGET_INT8=0), attention by SDPA."""
    return load_with_target_int8(tiny_llama_blocks_dir, "0")


@pytest.fixture(scope="session")
def tiny_llama_int8(tiny_llama_blocks_dir):
    """Its products on the blocks with int8 activations, the engine's default where the CPU has AVX-512 VNNI,
    in decoder.c's layers (native.py)."""
    if not blockquant.int8_enabled():
        pytest.skip("int8 activations need AVX-512 VNNI")
    return load_with_target_int8(tiny_llama_blocks_dir, "1")


@pytest.fixture(params=["tiny_llama", "tiny_llama_blocks", "tiny_llama_int8"])
def tiny_target(request):
    """Each tiny llama in turn: float32 weights (oneDNN's products), then GGUF block values (blockquant's), with
    float32 and with int8 activations."""
    return request.getfixturevalue(request.param)


class ByteTokenizer:
    """Enough of a tokenizer for the engine's stop handling on tiny models: token id i is chr(65 + i)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(65 + i) for i in ids)


@pytest.fixture(scope="session")
def smollm2():
    """The real default target (slow tests only): `make test` pulls it first."""
    from specserve_runtime.loader import load_model

    return load_model("SmolLM2-135M-Instruct")
