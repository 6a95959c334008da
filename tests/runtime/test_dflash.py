"""DFlash drafter: layer-id formula, z-lab checkpoint layout, speculators (vLLM) export, context caching,
draft trees, the operating point a checkpoint records."""

import itertools
import json

import pytest
import torch
from safetensors.torch import save_file

from specserve_runtime import blockquant
from specserve_runtime.drafters.checkpoint import export_speculators
from specserve_runtime.drafters import DrafterError, ProposerOptions, build_proposer
from specserve_runtime.drafters.dflash import (
    DFlashConfig,
    load_dflash,
    random_drafter,
    save_dflash,
    draft_tree,
    target_layer_ids,
)
from specserve_runtime.kv_cache import KVCache
from specserve_runtime.model import load_target
from specserve_runtime.native import CACHE_DTYPE

from .conftest import save_tiny_hf_model

# z-lab/Qwen3-8B-DFlash-b16's config.json with every field it ships, sizes scaled down 64x so that
# random weights of the right shapes stay small. The layer ids and block size are the real ones.
SCALED_QWEN3_8B_DFLASH_B16 = {
    "architectures": ["DFlashDraftModel"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
    "block_size": 16,
    "bos_token_id": 151643,
    "dflash_config": {"mask_token_id": 2369, "target_layer_ids": [1, 9, 17, 25, 33]},
    "dtype": "bfloat16",
    "eos_token_id": 151645,
    "head_dim": 16,
    "hidden_act": "silu",
    "hidden_size": 64,
    "initializer_range": 0.02,
    "intermediate_size": 192,
    "layer_types": ["full_attention"] * 5,
    "max_position_embeddings": 40960,
    "max_window_layers": 5,
    "model_type": "qwen3",
    "num_attention_heads": 4,
    "num_hidden_layers": 5,
    "num_key_value_heads": 1,
    "num_target_layers": 36,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "transformers_version": "4.57.1",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 2374,
}


def zlab_weight_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """The tensors a z-lab DFlash checkpoint ships, by name (no embedding, no LM head)."""
    h, d, inter = cfg["hidden_size"], cfg["head_dim"], cfg["intermediate_size"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    shapes = {
        "fc.weight": (h, len(cfg["dflash_config"]["target_layer_ids"]) * h),
        "hidden_norm.weight": (h,),
        "norm.weight": (h,),
    }
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "self_attn.q_norm.weight": (d,),
            p + "self_attn.k_norm.weight": (d,),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        }
    return shapes


def test_target_layer_ids_formula():
    assert target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B, as z-lab ships it
    assert target_layer_ids(30, 2) == [1, 27]
    assert target_layer_ids(30, 5) == [1, 8, 14, 20, 27]  # round(7.5) = 8, round(20.5) = 20
    assert target_layer_ids(30, 1) == [15]


def test_zlab_config_with_random_weights_loads(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(SCALED_QWEN3_8B_DFLASH_B16))
    generator = torch.Generator().manual_seed(0)
    weights = {
        name: torch.randn(shape, generator=generator).to(torch.bfloat16)
        for name, shape in zlab_weight_shapes(SCALED_QWEN3_8B_DFLASH_B16).items()
    }
    save_file(weights, tmp_path / "model.safetensors")
    drafter = load_dflash(tmp_path)
    cfg = drafter.config
    assert (cfg.block_size, cfg.num_target_layers, cfg.mask_token_id) == (16, 36, 2369)
    assert cfg.target_layer_ids == (1, 9, 17, 25, 33) and cfg.num_hidden_layers == 5
    torch.testing.assert_close(drafter.fc.weight, weights["fc.weight"].float())
    context_kv = drafter.context_kv(torch.randn(7, 5 * 64), torch.arange(7))
    hidden = drafter(torch.randn(16, 64), torch.arange(7, 23), [context_kv])
    assert hidden.shape == (16, 64) and torch.isfinite(hidden).all()


def test_checkpoint_with_wrong_shapes_is_rejected(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(SCALED_QWEN3_8B_DFLASH_B16))
    shapes = zlab_weight_shapes(SCALED_QWEN3_8B_DFLASH_B16)
    shapes["fc.weight"] = (64, 3 * 64)
    save_file({name: torch.zeros(shape) for name, shape in shapes.items()}, tmp_path / "model.safetensors")
    with pytest.raises(DrafterError, match=r"fc.weight has shape \[64, 192\], config implies \[64, 320\]"):
        load_dflash(tmp_path)


def test_config_without_required_fields_is_rejected():
    raw = dict(SCALED_QWEN3_8B_DFLASH_B16, dflash_config={"target_layer_ids": [1, 9]})
    with pytest.raises(DrafterError, match="lacks mask_token_id"):
        DFlashConfig.from_zlab(raw)
    with pytest.raises(DrafterError, match="block_size must be >= 2"):
        DFlashConfig.from_zlab(dict(SCALED_QWEN3_8B_DFLASH_B16, block_size=1))


def tiny_drafter(target, block_size=8, seed=0):
    config = DFlashConfig.for_target(target.config, num_layers=2, block_size=block_size, mask_token_id=95)
    drafter = random_drafter(config, seed)
    with torch.no_grad():  # norms start at 1; perturb them so a swapped norm would show
        for name, param in drafter.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(0.1 * torch.randn(param.shape))
    return drafter


def test_save_and_load_round_trip(tmp_path, tiny_llama):
    drafter = tiny_drafter(tiny_llama)
    save_dflash(drafter, tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["architectures"] == ["DFlashDraftModel"]
    assert saved["dflash_config"] == {"mask_token_id": 95, "target_layer_ids": [1, 3]}
    loaded = load_dflash(tmp_path)
    assert loaded.config == drafter.config
    for name, tensor in drafter.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor, rtol=0, atol=0)


def test_proposer_with_cached_context_matches_one_full_forward(tiny_llama):
    """The proposer projects context K/V incrementally; drafts must equal a forward over all context at once."""
    drafter = tiny_drafter(tiny_llama)
    tokens = torch.randint(0, 96, (12,), generator=torch.Generator().manual_seed(4))
    taps = tiny_llama(tokens, tiny_llama.new_cache(32), tap_layers=drafter.config.target_layer_ids).taps
    proposer = build_proposer("dflash", tiny_llama, ProposerOptions("random", 7, mask_token_id=95))
    proposer.drafter = drafter
    proposer.begin(64)
    for chunk in (taps[:5], taps[5:6], taps[6:11]):  # context arrives over several steps
        proposer.extend_context(chunk)
    drafts = proposer.propose(tokens.tolist(), max_drafts=7)
    block = torch.tensor([int(tokens[-1])] + [95] * 7)
    hidden = drafter(tiny_llama.embed_tokens(block), torch.arange(11, 19), [drafter.context_kv(taps[:11], torch.arange(11))])
    assert drafts == tiny_llama.lm_head(hidden[1:]).argmax(-1).tolist()


def test_a_sequence_that_drafts_nothing_leaves_its_context_pending_until_it_drafts(tiny_llama):
    """Adaptive speculation at 0 drafts: no drafter work for the step (the context is projected when
    the sequence next drafts, all of it at once), and the drafts then are those of a proposer that
    projected every step."""
    drafter = tiny_drafter(tiny_llama)
    tokens = torch.randint(0, 96, (12,), generator=torch.Generator().manual_seed(5))
    taps = tiny_llama(tokens, tiny_llama.new_cache(32), tap_layers=drafter.config.target_layer_ids).taps
    lazy, eager = (build_proposer("dflash", tiny_llama, ProposerOptions("random", 7, mask_token_id=95)) for _ in range(2))
    for proposer in (lazy, eager):
        proposer.drafter = drafter
        proposer.begin(64)
    calls = []
    hook = drafter.register_forward_hook(lambda module, args, out: calls.append(args[0].shape[0]))
    try:
        for end, chunk in ((5, taps[:5]), (6, taps[5:6]), (11, taps[6:11])):
            lazy.extend_context(chunk)
            eager.extend_context(chunk)
            calls.clear()
            assert lazy.propose(tokens[: end + 1].tolist(), max_drafts=0) == []
            assert lazy.context_cache.length == 0 and not calls  # nothing projected, no drafter forward
            eager.propose(tokens[: end + 1].tolist(), max_drafts=7)
            assert eager.context_cache.length == end
        calls.clear()
        drafts = lazy.propose(tokens.tolist(), max_drafts=7)
    finally:
        hook.remove()
    assert lazy.context_cache.length == 11 and calls == [8]  # the whole context projected, then one block
    assert drafts == eager.propose(tokens.tolist(), max_drafts=7)


@pytest.mark.skipif(not blockquant.int8_enabled(), reason="decoder.c's layers need AVX-512 VNNI")
def test_drafting_in_c_layers_computes_what_the_torch_layers_compute(tiny_llama):
    """A DFlash drafter on int8 products projects its context and drafts in decoder.c (each block row over all of
    its context and its block, no mask): two sequences with contexts of 11 and 5 tokens (the first projected in
    two steps), against the torch layers on the same products (a last-bit difference may round one int8
    activation a step apart: test_model's test_native_layers_compute_what_the_torch_layers_compute); drafting
    leaves each context cache as it was."""
    proposer = build_proposer("dflash", tiny_llama, ProposerOptions("random", 7, mask_token_id=95))
    drafter, head = proposer.drafter, proposer.head
    native = drafter.native_layers
    assert native is not None and head.linear.int8_blocks is not None
    tokens = torch.randint(0, 96, (12,), generator=torch.Generator().manual_seed(6))
    taps = tiny_llama(tokens, tiny_llama.new_cache(32), tap_layers=drafter.config.target_layer_ids).taps
    cfg = drafter.config
    blocks = torch.tensor([[int(tokens[10])] + [95] * 7, [int(tokens[4])] + [95] * 7]).flatten()

    def draft(layers):
        drafter.native_layers = layers
        caches = [KVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, n + cfg.block_size,
                          CACHE_DTYPE) for n in (11, 5)]  # decoder.c's; the torch layers read them back as float32
        drafter.project_context([(caches[0], taps[:7]), (caches[1], taps[:5])])
        drafter.project_context([(caches[0], taps[7:11])])
        return caches, drafter.draft_slots(tiny_llama.embed_tokens(blocks), caches, cfg.block_size - 1)

    try:
        expected_caches, expected = draft(None)
        caches, hidden = draft(native)
        context = [(cache.k[:, :, : cache.length].clone(), cache.v[:, :, : cache.length].clone()) for cache in caches]
        assert torch.equal(hidden, drafter.draft_slots(tiny_llama.embed_tokens(blocks), caches, 7))  # nothing kept
        # Drafting fewer slots runs the last layer's MLP on those rows alone: the same bits for them.
        assert torch.equal(hidden[:, :3], drafter.draft_slots(tiny_llama.embed_tokens(blocks), caches, 3))
        # With the head, in the same call: the head's own product on those rows, bit for bit.
        logits = drafter.draft_slots(tiny_llama.embed_tokens(blocks), caches, 3, head)
        assert logits.shape == (2, 3, head.weight.shape[0]) and torch.equal(logits, head.logits(hidden[:, :3]))
    finally:
        drafter.native_layers = native
    for cache, want, (k, v) in zip(caches, expected_caches, context):
        assert cache.length == want.length and torch.equal(cache.k[:, :, : cache.length], k)
        for ours, theirs in ((k, want.k[:, :, : want.length]), (v, want.v[:, :, : want.length])):
            torch.testing.assert_close(ours, theirs, rtol=0, atol=0.05 * theirs.abs().max().item())
    torch.testing.assert_close(hidden, expected, rtol=0, atol=0.05 * expected.abs().max().item())


def test_drafter_for_another_target_is_rejected(tmp_path, tiny_llama):
    save_dflash(tiny_drafter(tiny_llama), tmp_path / "drafter")
    save_tiny_hf_model(tmp_path / "other", hidden_size=32, num_attention_heads=2, num_key_value_heads=1)
    other = load_target(tmp_path / "other")
    with pytest.raises(DrafterError, match="hidden_size 64 != target's 32"):
        build_proposer("dflash", other, ProposerOptions(str(tmp_path / "drafter")))


def speculators_draft_logits(model, taps, block_ids, context_len):
    """Draft logits computed with the speculators package's own DFlashDraftModel modules."""
    context = model.hidden_norm(model.fc(taps))[None]  # [1, C, H]
    x = model.embed_tokens(block_ids)[None]  # [1, B, H]
    positions = torch.arange(context_len + block_ids.shape[0])[None]
    position_embeddings = model.rotary_emb(x, positions)
    for layer in model.layers:
        x = layer(hidden_states=x, target_hidden=context, attention_mask=None, position_embeddings=position_embeddings)
    return model.lm_head(model.norm(x))[0]


def load_with_speculators(folder):
    """speculators' DFlashDraftModel runs on CPU only with eager (or sdpa) attention in its layer config."""
    from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig

    config = DFlashSpeculatorConfig.from_pretrained(folder)
    config.transformer_layer_config._attn_implementation = "eager"
    return DFlashDraftModel.from_pretrained(folder, config=config).eval()


def test_speculators_loads_the_export_and_computes_the_same_draft_logits(tmp_path, tiny_llama_dir, tiny_llama):
    from speculators.convert.dflash import DFlashConverter

    drafter = tiny_drafter(tiny_llama)
    export_speculators(drafter, tmp_path / "speculators", str(tiny_llama_dir), ["LlamaForCausalLM"])
    theirs = load_with_speculators(tmp_path / "speculators")

    tokens = torch.randint(0, 96, (9,), generator=torch.Generator().manual_seed(5))
    taps = tiny_llama(tokens, tiny_llama.new_cache(32), tap_layers=drafter.config.target_layer_ids).taps
    block = torch.tensor([int(tokens[-1])] + [95] * 7)
    ours = tiny_llama.lm_head(drafter(tiny_llama.embed_tokens(block), torch.arange(9, 17), [drafter.context_kv(taps, torch.arange(9))]))
    with torch.no_grad():
        expected = speculators_draft_logits(theirs, taps, block, context_len=9)
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)

    # speculators' own converter accepts the z-lab layout we save and validates what it writes.
    save_dflash(drafter, tmp_path / "zlab")
    DFlashConverter().convert(tmp_path / "zlab", tmp_path / "converted", base_model=str(tiny_llama_dir))
    converted = load_with_speculators(tmp_path / "converted")
    assert converted.config.aux_hidden_state_layer_ids == [2, 4]
    with torch.no_grad():
        torch.testing.assert_close(speculators_draft_logits(converted, taps, block, 9), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("num_nodes", [1, 3, 6, 10])
def test_draft_tree_holds_the_most_likely_prefixes_of_the_block(num_nodes):
    slots, vocab = 4, 5
    logits = torch.randn(slots, vocab, generator=torch.Generator().manual_seed(num_nodes))
    tree = draft_tree(*blockquant.top_log_probs(logits, min(num_nodes, vocab)), num_nodes)
    log_probs = torch.log_softmax(logits, -1)
    # Each node's prefix (its branch's tokens, root first) and that prefix's log-probability.
    prefixes = []
    for node, parent in enumerate(tree.parents):
        prefixes.append((prefixes[parent] if parent >= 0 else ()) + (tree.tokens[node],))
    assert len(set(prefixes)) == len(prefixes) == num_nodes  # siblings differ: no prefix twice
    every_prefix = [p for depth in range(1, slots + 1) for p in itertools.product(range(vocab), repeat=depth)]
    def score(prefix):
        return sum(float(log_probs[slot, token]) for slot, token in enumerate(prefix))
    best = sorted(every_prefix, key=score, reverse=True)[:num_nodes]
    assert sorted(prefixes) == sorted(best)


def test_a_draft_tree_needs_a_drafter_model(tiny_llama):
    with pytest.raises(DrafterError, match="a draft tree needs a drafter model"):
        build_proposer("ngram", tiny_llama, ProposerOptions(num_speculative_tokens=3, draft_tree=True))


def record_operating_point(folder, point):
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "specserve_operating_point": point}))


def test_a_drafter_runs_at_the_operating_point_its_config_records_unless_asked_for_a_count(tmp_path, tiny_llama):
    save_dflash(tiny_drafter(tiny_llama), tmp_path)
    unrecorded = build_proposer("dflash", tiny_llama, ProposerOptions(str(tmp_path)))
    assert (unrecorded.num_speculative_tokens, unrecorded.tree) == (7, False)  # the whole block, a chain
    record_operating_point(tmp_path, {"num_speculative_tokens": 4, "draft_tree": True})
    recorded = build_proposer("dflash", tiny_llama, ProposerOptions(str(tmp_path)))
    assert (recorded.num_speculative_tokens, recorded.tree) == (4, True)
    chain = build_proposer("dflash", tiny_llama, ProposerOptions(str(tmp_path), draft_tree=False))
    assert (chain.num_speculative_tokens, chain.tree) == (4, False)  # the recorded count, as a chain
    counted = build_proposer("dflash", tiny_llama, ProposerOptions(str(tmp_path), 2))
    assert (counted.num_speculative_tokens, counted.tree) == (2, False)
    counted_tree = build_proposer("dflash", tiny_llama, ProposerOptions(str(tmp_path), 6, draft_tree=True))
    assert (counted_tree.num_speculative_tokens, counted_tree.tree) == (6, True)


@pytest.mark.parametrize("point", [
    {"num_speculative_tokens": 0}, {"num_speculative_tokens": True}, {"num_speculative_tokens": "4"},
    {"draft_tree": True}, {"num_speculative_tokens": 4, "draft_tree": 1}, {"num_speculative_tokens": 4, "trees": 2}, [4],
])
def test_a_malformed_recorded_operating_point_is_refused_with_the_file_named(tmp_path, tiny_llama, point):
    save_dflash(tiny_drafter(tiny_llama), tmp_path)
    record_operating_point(tmp_path, point)
    with pytest.raises(DrafterError, match=rf"drafter {tmp_path}: config.json's specserve_operating_point must be"):
        build_proposer("dflash", tiny_llama, ProposerOptions(str(tmp_path)))
