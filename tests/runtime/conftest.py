"""Fixtures: tiny random targets saved as real Hugging Face folders, and the real SmolLM2 target."""

import pytest
import torch

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


class ByteTokenizer:
    """Enough of a tokenizer for the engine's stop handling on tiny models: token id i is chr(65 + i)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(65 + i) for i in ids)


@pytest.fixture(scope="session")
def smollm2():
    """The real default target (slow tests only): `make test` pulls it first."""
    from specserve_runtime.loader import load_model

    return load_model("SmolLM2-135M-Instruct")
