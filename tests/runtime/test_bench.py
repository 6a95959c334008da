"""The benchmark's arithmetic and its JSON contract (the run itself is a command, not a test)."""

import torch

from specserve_runtime.bench import MethodStats, summarize, table
from specserve_runtime.drafters import ProposerOptions


def stats(**kwargs):
    s = MethodStats()
    for key, value in kwargs.items():
        setattr(s, key, value)
    return s


def test_summary_contract_speedups_and_acceptance():
    summary = summarize({
        "ar": stats(tokens=100, target_forwards=99, decode_tps=[10.0, 12.0, 11.0], e2e_tps=[9.0, 10.0, 11.0]),
        "dflash": stats(tokens=100, target_forwards=40, accepted=60, drafts=40, per_position=[30, 20, 10],
                        decode_tps=[22.0, 24.0, 26.0], e2e_tps=[20.0, 21.0, 22.0], by_category={"math": [2.5, 2.5]}),
        "hf-greedy": stats(tokens=100, e2e_tps=[8.0, 9.0, 10.0], lossless=False),
    })
    methods = summary["methods"]
    assert set(methods["dflash"]) >= {"acceptance_length", "tokens_per_second", "speedup_vs_ar", "lossless"}
    assert methods["dflash"]["acceptance_length"] == 2.5  # 1 + 60 accepted / 40 verify forwards
    assert methods["dflash"]["speedup_vs_ar"] == round(24.0 / 11.0, 3)  # medians of decode tokens/s
    assert methods["dflash"]["acceptance_per_position"] == [0.75, 0.5, 0.25]
    assert methods["hf-greedy"]["speedup_vs_ar"] == 0.9 and methods["hf-greedy"]["acceptance_length"] is None
    rendered = table(summary)
    assert "| dflash" in rendered and "2.18x" in rendered and "NO" in rendered  # hf-greedy differed from ar


def test_sampled_runs_do_not_claim_losslessness():
    summary = summarize({"ar": stats(decode_tps=[1.0], e2e_tps=[1.0], lossless=None)})
    assert summary["methods"]["ar"]["lossless"] is None and "n/a (T>0)" in table(summary)


def test_separate_projections_compute_the_same_and_restore_the_fusion(tiny_llama):
    from specserve_runtime.layers import separate_projections

    tokens = torch.tensor([5, 17, 42, 8])
    fused = tiny_llama(tokens, tiny_llama.new_cache(8)).logits
    with separate_projections(tiny_llama):
        assert all(layer.self_attn.qkv_weight is None and layer.mlp.gate_up_weight is None for layer in tiny_llama.layers)
        separate = tiny_llama(tokens, tiny_llama.new_cache(8)).logits
    assert all(layer.self_attn.qkv_weight is not None for layer in tiny_llama.layers)
    torch.testing.assert_close(fused, separate, rtol=1e-5, atol=1e-5)


def test_method_spec_sets_the_speculative_tokens():
    import pytest

    from specserve_runtime.bench import method_spec

    assert method_spec("dflash") == ("dflash", ProposerOptions())
    assert method_spec("dflash:3") == ("dflash", ProposerOptions(num_speculative_tokens=3))
    for bad in ("dflash:0", "dflash:x"):
        with pytest.raises(ValueError, match="speculative tokens per step"):
            method_spec(bad)
