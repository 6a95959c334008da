"""The target model against transformers' own implementation, and the KV cache's rollback."""

import pytest
import torch
import torch.nn.functional as F

from specserve_runtime import blockquant
from specserve_runtime.errors import ModelError
from specserve_runtime.kv_cache import KVCache
from specserve_runtime.layers import RMSNorm, RotaryEmbedding, apply_rope, causal_mask, tree_mask
from specserve_runtime.model import Segment, load_target
from specserve_runtime.native import CACHE_DTYPE
from specserve_runtime.verify import tree_depths

from .conftest import load_with_target_int8, save_tiny_blocks_model, save_tiny_hf_model

needs_vnni = pytest.mark.skipif(not blockquant.int8_enabled(), reason="decoder.c's layers need AVX-512 VNNI")


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_logits_and_taps_match_transformers(tmp_path, model_type):
    hf = save_tiny_hf_model(tmp_path, model_type)
    ours = load_target(tmp_path)
    tokens = torch.randint(0, 96, (23,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(tokens[None], output_hidden_states=True)
    out = ours(tokens, ours.new_cache(64), tap_layers=(0, 3, 5))
    torch.testing.assert_close(out.logits, expected.logits[0], atol=1e-4, rtol=1e-4)
    # Tap i is the output of decoder layer i, which is transformers' hidden_states[i + 1]
    # (the last entry is after the final norm, so the last layer is compared before it).
    hidden = expected.hidden_states
    torch.testing.assert_close(out.taps[:, :64], hidden[1][0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.taps[:, 64:128], hidden[4][0], atol=1e-4, rtol=1e-4)


def test_incremental_forward_matches_full_forward(tiny_llama):
    tokens = torch.randint(0, 96, (20,), generator=torch.Generator().manual_seed(2))
    full = tiny_llama(tokens, tiny_llama.new_cache(32)).logits
    cache = tiny_llama.new_cache(32)
    pieces = [tiny_llama(chunk, cache).logits for chunk in (tokens[:7], tokens[7:8], tokens[8:15], tokens[15:])]
    torch.testing.assert_close(torch.cat(pieces), full, atol=1e-5, rtol=1e-5)
    assert cache.length == 20


def test_crop_discards_rejected_positions(tiny_llama):
    """After verifying a block and cropping to the accepted prefix, the next forward sees only that prefix."""
    prefix = torch.randint(0, 96, (10,), generator=torch.Generator().manual_seed(3))
    rejected = torch.tensor([5, 6, 7, 8])
    follow = torch.tensor([40, 41])
    cache = tiny_llama.new_cache(32)
    tiny_llama(prefix, cache)
    tiny_llama(rejected, cache)  # a block of drafts, written into the cache...
    cache.crop(10 + 1)  # ...of which only the first was accepted
    after_crop = tiny_llama(follow, cache).logits
    clean = tiny_llama(torch.cat([prefix, rejected[:1], follow]), tiny_llama.new_cache(32)).logits[-2:]
    torch.testing.assert_close(after_crop, clean, atol=1e-5, rtol=1e-5)


# A draft tree after the last committed token (index 0): 0 -> 1 -> 3 -> 5, 0 -> 2 -> 4, 1 -> 6.
TREE_TOKENS = torch.tensor([11, 21, 22, 31, 32, 41, 33])
TREE_PARENTS = [-1, 0, 0, 1, 2, 3, 1]


def _branch(node: int) -> list[int]:
    """The tree's nodes from the root down to `node`."""
    branch = [node]
    while TREE_PARENTS[branch[0]] >= 0:
        branch.insert(0, TREE_PARENTS[branch[0]])
    return branch


def test_a_tree_forward_gives_every_node_the_logits_of_its_own_branch(tiny_llama):
    prefix = torch.randint(0, 96, (9,), generator=torch.Generator().manual_seed(4))
    cache = tiny_llama.new_cache(32)
    tiny_llama(prefix, cache)
    (tree,) = tiny_llama.forward_batch([Segment(TREE_TOKENS, cache, len(TREE_TOKENS), TREE_PARENTS)], (2,))
    for node in range(len(TREE_TOKENS)):
        chain = torch.cat([prefix, TREE_TOKENS[_branch(node)]])
        alone = tiny_llama(chain, tiny_llama.new_cache(32), tap_layers=(2,))
        torch.testing.assert_close(tree.logits[node], alone.logits[-1], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(tree.taps[node], alone.taps[-1], atol=1e-4, rtol=1e-4)


def test_keeping_a_branch_leaves_the_cache_as_if_only_that_branch_was_decoded(tiny_llama):
    prefix = torch.randint(0, 96, (9,), generator=torch.Generator().manual_seed(5))
    follow = torch.tensor([40, 41])
    branch = _branch(5)  # 0, 1, 3, 5: not contiguous among the tree's slots
    cache = tiny_llama.new_cache(32)
    tiny_llama(prefix, cache)
    tiny_llama.forward_batch([Segment(TREE_TOKENS, cache, 0, TREE_PARENTS)])
    cache.keep(9, [9 + node for node in branch])
    assert cache.length == 9 + len(branch)
    after_keep = tiny_llama(follow, cache).logits
    clean = tiny_llama(torch.cat([prefix, TREE_TOKENS[branch], follow]), tiny_llama.new_cache(32)).logits[-2:]
    torch.testing.assert_close(after_keep, clean, atol=1e-5, rtol=1e-5)


def test_tree_mask_lets_each_token_see_the_cache_its_ancestors_and_itself():
    mask = tree_mask([-1, 0, 0, 1], num_cached=2)
    assert mask.int().tolist() == [
        [1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 0, 0],
        [1, 1, 1, 0, 1, 0],  # a sibling of the token before: not its ancestor
        [1, 1, 1, 1, 0, 1],
    ]


def test_kv_cache_bounds():
    cache = KVCache(num_layers=1, num_kv_heads=1, head_dim=2, capacity=4)
    k = torch.zeros(1, 1, 3, 2)
    cache.write(0, k, k)
    cache.advance(3)
    with pytest.raises(ValueError, match="overflow"):
        cache.write(0, k, k)
    with pytest.raises(ValueError, match="cannot crop"):
        cache.crop(4)
    with pytest.raises(ValueError, match="cannot keep"):
        cache.keep(1, [2, 1])  # slots must ascend
    with pytest.raises(ValueError, match="cannot keep"):
        cache.keep(1, [3])  # past the valid positions
    cache.crop(1)
    assert cache.length == 1 and cache.get(0)[0].shape == (1, 1, 1, 2)


def test_causal_mask_offsets_queries_to_their_absolute_positions():
    mask = causal_mask(num_queries=3, num_keys=5)  # queries at positions 2, 3, 4
    assert mask.tolist() == [
        [True, True, True, False, False],
        [True, True, True, True, False],
        [True, True, True, True, True],
    ]
    assert causal_mask(1, 9) is None


def test_unsupported_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'"):
        load_target(tmp_path)


def test_missing_weights_are_named(tmp_path):
    save_tiny_hf_model(tmp_path, "llama")
    (tmp_path / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="cannot read"):
        load_target(tmp_path)


def test_fused_projections_share_storage_and_compute_the_same(tiny_llama):
    """load_target fuses q/k/v and gate/up; a drafter fused the same way drafts the same tokens."""
    import copy

    from specserve_runtime.drafters.dflash import DFlashConfig, random_drafter
    from specserve_runtime.layers import PackedLinear, fuse_projections

    attention, mlp = tiny_llama.layers[0].self_attn, tiny_llama.layers[0].mlp
    assert attention.q_proj.weight.data_ptr() == attention.qkv.weight.data_ptr()  # views: no extra memory
    assert mlp.up_proj.weight.data_ptr() == mlp.gate_up.weight[mlp.gate_proj.out_features :].data_ptr()

    drafter = random_drafter(DFlashConfig.for_target(tiny_llama.config, 2, 4, mask_token_id=95), seed=1)
    fused = fuse_projections(copy.deepcopy(drafter))
    taps = torch.randn(6, 2 * tiny_llama.config.hidden_size)
    embeds, positions = torch.randn(4, tiny_llama.config.hidden_size), torch.arange(6, 10)
    separate = drafter(embeds, positions, [drafter.context_kv(taps, torch.arange(6))])
    torch.testing.assert_close(fused(embeds, positions, [fused.context_kv(taps, torch.arange(6))]), separate)
    assert drafter.layers[0].mlp.gate_up is None and fused.layers[0].mlp.gate_up is not None
    assert isinstance(fused.fc, PackedLinear) and fused.state_dict().keys() == drafter.state_dict().keys()
    for (k, v), (k_separate, v_separate) in zip(fused.context_kv(taps, torch.arange(6)),
                                                drafter.context_kv(taps, torch.arange(6))):
        torch.testing.assert_close((k, v), (k_separate, v_separate))  # keys/values through the fused q/k/v product


def test_packed_linears_compute_what_f_linear_computes(tiny_llama):
    """load_target packs every matrix product (the LM head too, still tied to the embedding)."""
    from specserve_runtime.layers import PackedLinear, weight_layouts

    assert tiny_llama.lm_head.weight is tiny_llama.embed_tokens.weight
    packed = [m for m in tiny_llama.modules() if isinstance(m, PackedLinear)]
    assert len(packed) == 1 + 4 * tiny_llama.config.num_hidden_layers  # qkv, o, gate_up, down per layer
    assert all(m.packed is not None for m in packed) == torch.backends.mkldnn.is_available()
    for rows in (0, 1, 3, 8):
        x = torch.randn(rows, tiny_llama.config.hidden_size)
        torch.testing.assert_close(tiny_llama.lm_head(x), x @ tiny_llama.lm_head.weight.T, rtol=1e-4, atol=1e-4)
    tokens = torch.tensor([5, 17, 42, 8])
    logits = tiny_llama(tokens, tiny_llama.new_cache(8)).logits
    with weight_layouts(tiny_llama):
        assert all(m.packed is None for m in packed)
        plain = tiny_llama(tokens, tiny_llama.new_cache(8)).logits
    assert all(m.packed is not None for m in packed) == torch.backends.mkldnn.is_available()
    torch.testing.assert_close(logits, plain, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("parents", [None, [-1, 0, 0, 2, 1]], ids=["chain", "tree"])
@pytest.mark.parametrize("target", ["tiny_llama_blocks", "tiny_llama_int8"])
def test_every_verified_row_has_the_bits_of_a_one_token_step(request, target, parents):
    """What keeps greedy speculative output plain decoding's on int8 activations: a verify block's row of logits
    is computed exactly as the one-token step at its place computes it (decoder.c: row-invariant products,
    row-exact attention), for a chain and for a tree's branches. On float32 activations (SDPA's batched
    attention) a row may differ in the last bits, harmless there."""
    model = request.getfixturevalue(target)
    assert (model.native_layers is not None) == (target == "tiny_llama_int8")
    prompt, tokens = torch.tensor([5, 17, 42, 8, 3, 60]), [7, 11, 13, 19, 23]
    cache = model.new_cache(32)
    model(prompt, cache)
    block = model.forward_batch([Segment(torch.tensor(tokens), cache, len(tokens), parents)])[0].logits
    parents = parents or [-1, 0, 1, 2, 3]
    identical = []
    for row in range(len(tokens)):
        path = [row]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        steps = model.new_cache(32)
        model(prompt, steps)
        for node in reversed(path):
            logits = model(torch.tensor([tokens[node]]), steps).logits
        torch.testing.assert_close(block[row], logits[0], rtol=1e-4, atol=1e-4)
        identical.append(torch.equal(block[row], logits[0]))
    assert all(identical) or model.native_layers is None


@needs_vnni
@pytest.mark.parametrize(("model_type", "head_dim"), [("llama", 16), ("llama", 64), ("qwen3", 48), ("qwen3", 128)])
def test_native_layers_compute_what_the_torch_layers_compute(tmp_path, model_type, head_dim):
    """decoder.c's layers (RMSNorm, Qwen3's head norms, RoPE, the cache writes, attention, SwiGLU, the residuals,
    the taps) against the torch layers on the same int8 products: two sequences' prompts in one batch, then a
    tree verify block beside a chain. Head sizes up to 128: attention.c's value sums take 64 values at a time.

    Where no activation rounds differently they agree to about 1e-5; but their RMSNorm, SiLU and attention may
    differ in the last bit (another summation order), which int8 rounding now and then turns into a whole step
    of one activation, moving everything after it by up to 2.5% of its magnitude (measured on these cases).
    A wrong norm, head offset, position, gate or residual moves it by its whole magnitude."""
    save_tiny_blocks_model(tmp_path, model_type, head_dim=head_dim)
    model = load_with_target_int8(tmp_path, "1")
    native = model.native_layers
    assert native is not None and model.activations == "int8"
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 96, (n,), generator=generator) for n in (9, 14)]
    tree, chain = torch.randint(0, 96, (6,), generator=generator), torch.randint(0, 96, (3,), generator=generator)

    def run(native_layers):
        model.native_layers = native_layers
        cfg = model.config  # both on decoder.c's float16 caches: the torch layers read them back as float32
        caches = [KVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, 32, CACHE_DTYPE) for _ in range(2)]
        prompted = model.forward_batch([Segment(p, c, 1) for p, c in zip(prompts, caches)], tap_layers=(0, 3, 5))
        verified = model.forward_batch([Segment(tree, caches[0], 6, [-1, 0, 0, 1, 2, 2]),
                                        Segment(chain, caches[1], 3)], tap_layers=(2,))
        return [(out.logits, out.taps) for out in prompted + verified], caches

    (outputs, caches), (expected, expected_caches) = run(native), run(None)
    model.native_layers = native
    for out, want in zip(outputs, expected):
        for ours, theirs in zip(out, want):
            torch.testing.assert_close(ours, theirs, rtol=0, atol=0.05 * theirs.abs().max().item())
    for cache, want in zip(caches, expected_caches):
        assert cache.length == want.length
        for ours, theirs in ((cache.k, want.k), (cache.v, want.v)):
            theirs = theirs[:, :, : want.length]
            torch.testing.assert_close(ours[:, :, : cache.length], theirs, rtol=0, atol=0.05 * theirs.abs().max().item())


def attention_rows(q, k, v, rotary, positions, cache_k, cache_v, cached, visible):
    """attention.c's kernel for one sequence (decoder.c calls it for all of a batch's at once): q [T, heads, D],
    k and v [T, kv_heads, D] before RoPE (at positions [T] of rotary's tables) into one layer's float16 cache
    [kv_heads, capacity, D] after `cached` slots; visible [T, T] -> [T, heads * D]."""
    kernel = blockquant.library().attention_rows
    (rows, heads, head_dim), visible = q.shape, visible.to(torch.uint8).contiguous()
    cos, sin = rotary.tables(int(positions.max()) + 1)
    out = torch.empty(rows, heads * head_dim)
    status = kernel(q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), k.stride(0), k.stride(1), v.data_ptr(),
                    v.stride(0), v.stride(1), cos.data_ptr(), sin.data_ptr(), positions.data_ptr(), cache_k.data_ptr(),
                    cache_v.data_ptr(),
                    cache_k.shape[1], heads, cache_k.shape[0], head_dim, cached, rows, visible.data_ptr(), None, out.data_ptr())
    assert status == 0
    return out


@needs_vnni
@pytest.mark.parametrize("head_dim", [16, 48, 64, 128])
@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (10, 2)])
def test_row_exact_attention_is_attention_and_each_row_computes_alone(head_dim, heads, kv_heads):
    """attention.c against RoPE, the cache writes and SDPA with the same mask in torch (a tree after cached keys,
    grouped-query heads: 2 per key head, and 5, more than attend_heads takes at once), and each row's output bit
    for bit what it gives as the only new row after the keys it sees, laid at consecutive slots as plain decoding
    has them."""
    torch.manual_seed(0)
    capacity, cached = 40, 21
    parents = [-1, 0, 0, 1, 2, 2]
    rows = len(parents)
    cache_k = torch.randn(kv_heads, capacity, head_dim).to(CACHE_DTYPE)
    cache_v = torch.randn(kv_heads, capacity, head_dim).to(CACHE_DTYPE)
    q, k, v = torch.randn(rows, heads, head_dim), torch.randn(rows, kv_heads, head_dim), torch.randn(rows, kv_heads, head_dim)
    rotary = RotaryEmbedding(head_dim, 10000.0)
    positions = cached - 1 + torch.tensor(tree_depths(parents))
    cos, sin = rotary(positions)
    written_k, written_v = cache_k.clone(), cache_v.clone()
    out = attention_rows(q, k, v, rotary, positions, written_k, written_v, cached, tree_mask(parents, 0))

    def heads_first(x):
        return x.transpose(0, 1).unsqueeze(0)  # [T, heads, D] -> [1, heads, T, D]

    # The new keys and values are stored rounded to float16, to nearest.
    assert torch.equal(written_k[:, cached : cached + rows], apply_rope(heads_first(k), cos, sin)[0].to(CACHE_DTYPE))
    assert torch.equal(written_v[:, cached : cached + rows], v.transpose(0, 1).to(CACHE_DTYPE))
    assert torch.equal(written_k[:, :cached], cache_k[:, :cached]) and torch.equal(written_k[:, cached + rows :], cache_k[:, cached + rows :])
    mask = tree_mask(parents, cached)
    keys, values = written_k[None, :, : cached + rows].float(), written_v[None, :, : cached + rows].float()
    expected = F.scaled_dot_product_attention(apply_rope(heads_first(q), cos, sin), keys, values, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(out, expected[0].transpose(0, 1).reshape(rows, -1), rtol=1e-5, atol=1e-5)
    for row in range(rows):
        seen = mask[row].nonzero().squeeze(1)[:-1]  # the keys before its own
        alone_k, alone_v = torch.zeros_like(cache_k), torch.zeros_like(cache_v)
        alone_k[:, : len(seen)], alone_v[:, : len(seen)] = written_k[:, seen], written_v[:, seen]
        alone = attention_rows(q[row : row + 1], k[row : row + 1], v[row : row + 1], rotary, positions[row : row + 1],
                               alone_k, alone_v, len(seen), torch.ones(1, 1, dtype=torch.bool))
        assert torch.equal(alone[0], out[row])


@needs_vnni
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("n_keys", [8, 9, 13, 16, 23])
def test_keys_scored_eight_at_a_time_score_as_one_alone(n_keys, seed):
    """attention.c scores keys eight at a time and the last few one by one: every key the same vector, each
    score is the same bits either way, so every weight is exactly 1 and the output is the values' mean,
    summed in list order. A block's halving tree that added other lanes than a lone key's would give the
    eight-key scores other last bits than the tail's."""
    torch.manual_seed(seed)
    heads, kv_heads, head_dim = 9, 3, 64
    key = torch.randn(kv_heads, 1, head_dim) * 4
    cache_k = key.expand(kv_heads, n_keys + 1, head_dim).to(CACHE_DTYPE).contiguous()
    cache_v = torch.randn(kv_heads, n_keys + 1, head_dim).to(CACHE_DTYPE)
    q, k, v = torch.randn(1, heads, head_dim) * 4, torch.randn(1, kv_heads, head_dim), torch.randn(1, kv_heads, head_dim)
    # The new row does not see itself: its keys are the n_keys cached ones alone.
    out = attention_rows(q, k, v, RotaryEmbedding(head_dim, 10000.0), torch.tensor([n_keys]), cache_k, cache_v, n_keys,
                         torch.zeros(1, 1, dtype=torch.bool))
    total = torch.zeros(kv_heads, head_dim)
    for n in range(n_keys):
        total = total + cache_v[:, n].float()
    mean = total * (torch.tensor(1.0) / n_keys)
    expected = mean.repeat_interleave(heads // kv_heads, dim=0).reshape(-1)
    assert torch.equal(out[0], expected)


def test_a_forward_past_the_cache_is_refused_and_leaves_it_as_it_was(tiny_target):
    cache = tiny_target.new_cache(8)
    tiny_target(torch.tensor([5, 17, 42, 8, 3]), cache)
    with pytest.raises(ValueError, match="KV cache overflow: 9 positions needed, capacity 8"):
        tiny_target(torch.tensor([7, 11, 13, 19]), cache)
    assert cache.length == 5
    step = tiny_target(torch.tensor([7]), cache).logits
    fresh = tiny_target.new_cache(8)
    tiny_target(torch.tensor([5, 17, 42, 8, 3]), fresh)
    torch.testing.assert_close(step, tiny_target(torch.tensor([7]), fresh).logits, rtol=0, atol=0)


@needs_vnni
def test_native_layers_refuse_rows_they_cannot_take(tiny_llama_int8):
    cache, native = tiny_llama_int8.new_cache(8), tiny_llama_int8.native_layers
    x, tables, positions = torch.randn(3, 64), torch.ones(3, 16), torch.arange(3)
    causal = torch.ones(3, 3, dtype=torch.bool).tril()
    with pytest.raises(ValueError, match="decoder_layers refused 3 rows in 1 segments: status -1"):
        native.run(x, tables, tables, positions, [(cache, torch.ones(2, 2, dtype=torch.bool).tril(), None)])
    with pytest.raises(ValueError, match="decoder_layers refused 3 rows in 1 segments: status -1"):  # past the tables
        native.run(x, tables, tables, torch.tensor([0, 1, 3]), [(cache, causal, None)])
    with pytest.raises(ValueError, match=r"contiguous float32 rows of 64, not torch.float32 \(3, 64\)"):
        native.run(torch.randn(64, 3).T, tables, tables, positions, [(cache, torch.ones(3, 3, dtype=torch.bool), None)])
    with pytest.raises(ValueError, match=r"positions are contiguous int64 \[3\], not torch.int32 \(3,\)"):
        native.run(x, tables, tables, positions.int(), [(cache, causal, None)])
    with pytest.raises(ValueError, match=r"RoPE tables are contiguous float32 \[positions, 16\], not torch.float32 \(3, 8\)"):
        native.run(x, tables[:, :8], tables, positions, [(cache, causal, None)])
    with pytest.raises(ValueError, match=r"the cos and sin tables differ in shape: \(3, 16\) and \(2, 16\)"):
        native.run(x, tables, tables[:2], positions, [(cache, causal, None)])
    wide = KVCache(cache.k.shape[0], cache.k.shape[1], cache.k.shape[3], 8)  # float32: not what the C layers read
    with pytest.raises(ValueError, match="decoder.c's caches hold torch.float16, not torch.float32"):
        native.run(x, tables, tables, positions, [(wide, causal, None)])
    assert cache.length == 0 and not cache.k.any() and cache.k.dtype == CACHE_DTYPE and not wide.k.any()


@needs_vnni
def test_rows_not_kept_skip_the_last_layer_and_the_kept_keep_their_bits(tiny_llama_int8):
    """decoder.c's `kept`: the rows the caller reads come out of the last layer with the bits of a forward of every
    row, every row's keys and values still go into the cache, the others leave the last layer as they entered it
    (the output of the layer before); a prompt's forward for its last logits (the engine's prefill) uses it. With
    the model's final norm, the kept rows also come out normed, in order, with the same bits however many are kept,
    and as torch's RMSNorm computes them (up to its summation order)."""
    model, native = tiny_llama_int8, tiny_llama_int8.native_layers
    rows = 7
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(3))
    cos, sin, positions = *model.rotary.tables(rows), torch.arange(rows)
    causal = torch.ones(rows, rows, dtype=torch.bool).tril()
    kept = torch.tensor([False, True, False, False, True, True, False])
    runs = {}
    for name, mask, taps in (("all", None, (model.config.num_hidden_layers - 2,)), ("kept", kept, ())):
        cache = model.new_cache(rows)
        out = x.clone()
        tapped, normed = native.run(out, cos, sin, positions, [(cache, causal, None)], taps, kept=mask, norm=model.norm)
        runs[name] = out, cache, tapped, normed
    (every, every_cache, before_last, every_normed), (some, some_cache, _, some_normed) = runs["all"], runs["kept"]
    assert torch.equal(some[kept], every[kept])
    assert some_normed.shape == (3, 64) and torch.equal(some_normed, every_normed[kept])
    torch.testing.assert_close(every_normed, model.norm(every), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(every_normed, every, atol=0.1)  # the norm was applied, not skipped
    assert torch.equal(some[~kept], before_last[~kept])
    assert torch.equal(some_cache.k, every_cache.k) and torch.equal(some_cache.v, every_cache.v)
    none = x.clone()  # a prompt chunk before its last: no logits, only keys and values
    native.run(none, cos, sin, positions, [(model.new_cache(rows), causal, None)], kept=torch.zeros(rows, dtype=torch.bool))
    assert torch.equal(none, before_last)

    prompt = torch.tensor([5, 17, 42, 8, 3, 60])
    last = model(prompt, model.new_cache(8), last_logits_only=True).logits
    assert torch.equal(last[0], model(prompt, model.new_cache(8)).logits[-1])

    last_layer = (model.config.num_hidden_layers - 1,)
    with pytest.raises(ValueError, match="decoder_layers refused 7 rows in 1 segments: status -1"):
        native.run(x.clone(), cos, sin, positions, [(model.new_cache(rows), causal, None)], last_layer, kept=kept)
    with pytest.raises(ValueError, match=r"kept is a bool mask \(7,\), not torch.int64 \(7,\)"):
        native.run(x.clone(), cos, sin, positions, [(model.new_cache(rows), causal, None)], kept=kept.long())
    with pytest.raises(ValueError, match=r"visible is a bool mask \(7, 7\), not torch.uint8 \(7, 7\)"):
        native.run(x.clone(), cos, sin, positions, [(model.new_cache(rows), causal.to(torch.uint8), None)])
    with pytest.raises(ValueError, match=r"visible is a bool mask \(6, 6\), not torch.bool \(6, 7\)"):
        native.run(x.clone(), cos, sin, positions, [(model.new_cache(rows), causal[:6], None)])
    with pytest.raises(ValueError, match=r"cached_visible is a bool mask \(7, 0\), not torch.bool \(7, 3\)"):
        wide = torch.ones(rows, 3, dtype=torch.bool)
        native.run(x.clone(), cos, sin, positions, [(model.new_cache(rows), causal, wide)])
    with pytest.raises(ValueError, match=r"the final norm's weight must be float32 \[64\], not torch.float32 \(32,\)"):
        native.run(x.clone(), cos, sin, positions, [(model.new_cache(rows), causal, None)], norm=RMSNorm(32, 1e-5))


@needs_vnni
def test_the_lm_head_in_the_layers_call_gives_its_own_products_bits(tiny_llama_int8):
    """native.run's `head`: the kept rows, normed, go through the LM head in the same call, with the bits of the head's
    own product on those rows (blockquant.linear); a head needs the norm before it and the model's width."""
    model, native = tiny_llama_int8, tiny_llama_int8.native_layers
    rows = 5
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(4))
    cos, sin, positions = *model.rotary.tables(rows), torch.arange(rows)
    causal = torch.ones(rows, rows, dtype=torch.bool).tril()
    kept = torch.tensor([True, False, False, True, True])
    head = model.lm_head.int8_blocks
    _, normed = native.run(x.clone(), cos, sin, positions, [(model.new_cache(rows), causal, None)], kept=kept,
                           norm=model.norm)
    _, logits = native.run(x.clone(), cos, sin, positions, [(model.new_cache(rows), causal, None)], kept=kept,
                           norm=model.norm, head=head)
    assert logits.shape == (3, model.config.vocab_size) and torch.equal(logits, blockquant.linear(normed, head))
    assert torch.equal(logits, model.lm_head(normed))  # what forward_batch computed before the head joined the call
    with pytest.raises(ValueError, match="an LM head in decoder_layers needs the final norm before it"):
        native.run(x.clone(), cos, sin, positions, [(model.new_cache(rows), causal, None)], head=head)
    narrow = blockquant.int8_layout(blockquant.q8_0_blocks(torch.zeros(64, 32)))
    with pytest.raises(ValueError, match="an LM head in decoder_layers takes 64 values a row, not 32"):
        native.run(x.clone(), cos, sin, positions, [(model.new_cache(rows), causal, None)], norm=model.norm, head=narrow)


@needs_vnni
def test_a_prompt_with_its_last_layer_tapped_gives_the_same_last_logits(tiny_llama_int8):
    """With the last layer tapped, a prompt's rows cannot skip it (no `kept`): every row is normed, and only the last
    goes through the LM head, outside decoder.c's call. Its logits are the same bits as without the tap."""
    model, prompt = tiny_llama_int8, torch.tensor([5, 17, 42, 8, 3, 60])
    last_layer = (model.config.num_hidden_layers - 1,)
    tapped = model(prompt, model.new_cache(8), last_layer, last_logits_only=True)
    assert tapped.logits.shape == (1, model.config.vocab_size) and tapped.taps.shape == (6, model.config.hidden_size)
    assert torch.equal(tapped.logits, model(prompt, model.new_cache(8), last_logits_only=True).logits)


def test_a_bad_target_int8_switch_is_refused_by_name(tiny_llama_blocks_dir, monkeypatch):
    monkeypatch.setenv("SPECSERVE_TARGET_INT8", "yes")
    with pytest.raises(ModelError, match="SPECSERVE_TARGET_INT8 is 1 \\(int8 products\\) or 0 \\(float32 products\\), not 'yes'"):
        load_target(tiny_llama_blocks_dir)
