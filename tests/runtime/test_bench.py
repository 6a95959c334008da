"""The benchmark's arithmetic and its JSON contract (the run itself is a command, not a test)."""

import json

import pytest
import torch
import yaml

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
        assert all(layer.self_attn.qkv is None and layer.mlp.gate_up is None for layer in tiny_llama.layers)
        separate = tiny_llama(tokens, tiny_llama.new_cache(8)).logits
    assert all(layer.self_attn.qkv is not None for layer in tiny_llama.layers)
    torch.testing.assert_close(fused, separate, rtol=1e-5, atol=1e-5)


def test_method_spec_sets_the_speculative_tokens():
    from specserve_runtime.bench import method_spec

    assert method_spec("dflash") == ("dflash", ProposerOptions())
    assert method_spec("dflash:3") == ("dflash", ProposerOptions(num_speculative_tokens=3))
    assert method_spec("dflash:tree5") == ("dflash", ProposerOptions(num_speculative_tokens=5, draft_tree=True))
    assert method_spec("dflash:tree") == ("dflash", ProposerOptions(draft_tree=True))
    for bad in ("dflash:0", "dflash:x", "dflash:0@/runs/a/drafter", "dflash:tree0", "dflash:treex"):
        with pytest.raises(ValueError, match="speculative tokens per step"):
            method_spec(bad)


def test_method_spec_names_a_drafter_folder_after_the_at_sign():
    from specserve_runtime.bench import method_spec

    assert method_spec("dflash@/runs/a/drafter") == ("dflash", ProposerOptions(drafter="/runs/a/drafter"))
    assert method_spec("eagle3:2@runs/b") == ("eagle3", ProposerOptions(drafter="runs/b", num_speculative_tokens=2))
    with pytest.raises(ValueError, match="a drafter folder follows '@'"):
        method_spec("dflash:3@")


def test_bench_refuses_a_drafter_folder_without_a_drafter_before_loading_anything(capsys, tmp_path):
    from specserve.cli import main

    assert main(["bench", "--methods", f"ar,dflash:3@{tmp_path}", "--limit", "1"]) == 2
    assert f"no drafter (config.json) in the folder of: dflash:3@{tmp_path}" in capsys.readouterr().err
    assert main(["bench", "--methods", f"ar,ngram@{tmp_path}", "--limit", "1"]) == 2
    assert f"only eagle3 and dflash read a drafter folder: ngram@{tmp_path}" in capsys.readouterr().err
    assert main(["bench", "--methods", "ar,dflash:x", "--limit", "1"]) == 2
    assert "the speculative tokens per step" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_runs_the_drafter_of_the_folder_it_is_given(capsys):
    from specserve.cli import main
    from specserve_runtime.drafters import DEFAULT_DRAFTERS

    # The bundled drafter named by its folder is the bundled drafter; a random one is another drafter.
    bundled = DEFAULT_DRAFTERS["eagle3"]
    methods = f"ar,eagle3:2,eagle3:2@{bundled},eagle3:2@random"
    assert main(["bench", "--methods", methods, "--limit", "2", "--max-new-tokens", "24", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["methods"]
    assert all(rows[m]["lossless"] for m in methods.split(","))
    assert rows[f"eagle3:2@{bundled}"]["acceptance_length"] == rows["eagle3:2"]["acceptance_length"] > 1.1
    assert rows["eagle3:2@random"]["acceptance_length"] < rows["eagle3:2"]["acceptance_length"]


def test_the_performance_block_is_what_simulate_and_the_operator_read(tmp_path):
    from specserve_operator.priors import capacity_priors, load_performance
    from specserve_runtime.bench import performance_block
    from specserve_runtime.commands.bench import write_performance

    summary = summarize({
        "ar": stats(tokens=100, target_forwards=100, decode_tps=[10.0, 12.0, 11.0], e2e_tps=[9.0], ttft_ms=[40.0, 60.0, 50.0]),
        "dflash:3": stats(tokens=100, target_forwards=40, accepted=60, drafts=40, decode_tps=[20.0, 24.0, 22.0],
                          e2e_tps=[20.0], ttft_ms=[55.0, 45.0, 65.0]),
        "hf-greedy": stats(tokens=100, e2e_tps=[8.0]),
    })
    block = performance_block(summary)
    assert list(block) == ["none", "dflash"]  # ar is method none in a SpeculativeServing; baselines are not methods
    assert block["dflash"] == {"acceptanceLength": 2.5, "errorRate": 0.0, "maxConcurrency": 1,
                               "curve": [{"concurrency": 1, "tokensPerSecondPerRequest": 22.0, "ttftMs": 55.0}]}
    write_performance(block, path := tmp_path / "performance.yaml")
    priors = capacity_priors(load_performance(path))  # the operator's SPECSERVE_CAPACITY_PRIORS reads it as is
    # the row at concurrency 1: a request that finds none other in flight
    assert priors["dflash"].points[0].in_flight_per_replica == 0 and priors["none"].points[0].p99_time_to_first_token_ms == 50.0
    assert priors["dflash"].batch == 1  # one sequence at a time: the autoscaler knows more would wait


def test_emit_performance_refuses_two_variants_of_one_method_before_loading_anything(capsys, tmp_path):
    from specserve.cli import main

    assert main(["bench", "--methods", "ar,eagle3,eagle3:4", "--emit-performance", str(tmp_path / "p.yaml")]) == 2
    assert "--emit-performance writes one row per method" in capsys.readouterr().err
    assert not (tmp_path / "p.yaml").exists()
    assert main(["bench", "--methods", "ar", "--emit-performance", str(tmp_path / "absent" / "p.yaml")]) == 2
    assert f"{tmp_path / 'absent' / 'p.yaml'}: no such directory" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_emits_a_performance_block_that_a_scenario_runs_on(tmp_path, capsys):
    from specserve.cli import main

    performance = tmp_path / "performance.yaml"
    assert main(["bench", "--methods", "ar,eagle3", "--per-category", "1", "--limit", "2", "--max-new-tokens", "16",
                 "--emit-performance", str(performance)]) == 0
    block = yaml.safe_load(performance.read_text())
    assert set(block) == {"none", "eagle3"} and block["eagle3"]["acceptanceLength"] > 1
    scenario = {
        "durationSeconds": 300, "seed": 1, "tickSeconds": 15, "startupSeconds": 30,
        "profile": {"tenant": "cpu", "accelerator": {"resourceName": "cpu", "count": 0, "pricePerHourUSD": 0.1}},
        "serving": {"profile": "cpu", "model": {"name": "SmolLM2-135M-Instruct", "uri": "hf://HuggingFaceTB/SmolLM2-135M-Instruct",
                                                "servedName": "smollm2"},
                    "speculator": {"method": "eagle3", "draftModel": "bundled://smollm2-135m-instruct-eagle3"},
                    "replicas": {"min": 1, "max": 4}, "autoscaling": {"enabled": True}},
        "load": {"requestsPerSecond": [{"atSeconds": 0, "requestsPerSecond": 0.2}], "promptTokens": 40, "outputTokens": 16},
        "performance": block,
    }
    (path := tmp_path / "scenario.yaml").write_text(yaml.safe_dump(scenario))
    capsys.readouterr()
    assert main(["simulate", "--scenario", str(path), "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["generatedTokens"] > 0 and 0 <= result["sloAttainment"] <= 1


def test_a_load_level_summarises_throughput_latency_and_errors():
    from specserve_runtime.load_bench import Level, RequestTiming

    level = Level(2, wall_seconds=4.0, errors=1, requests=[
        RequestTiming(ttft=0.2, seconds=2.2, tokens=21, gaps=[0.1] * 20),  # 20 tokens in 2 s after the first
        RequestTiming(ttft=0.6, seconds=3.6, tokens=31, gaps=[0.05] * 29 + [0.5]),
    ])
    summary = level.summary()
    assert summary["output_tokens_per_second"] == 13.0  # 52 tokens in 4 s of wall time
    assert summary["tokens_per_second_per_request"] == 10.0  # median of 10 and 10
    assert summary["itl_p50_ms"] == 50.0 and summary["itl_p99_ms"] == 500.0  # 29 gaps of 50 ms, 20 of 100, one of 500
    assert summary["ttft_p50_ms"] == 600.0 and summary["errors"] == 1 and summary["requests"] == 2


def test_rounds_pool_their_requests_and_keep_each_rounds_throughput():
    from specserve_runtime.load_bench import Level, RequestTiming, summarise_rounds

    request = RequestTiming(ttft=0.1, seconds=1.1, tokens=11, gaps=[0.1] * 10)
    summary = summarise_rounds([Level(1, wall_seconds=1.0, requests=[request]),
                                Level(1, wall_seconds=2.0, requests=[request], errors=1)])
    assert summary["rounds"] == [11.0, 5.5]  # each round's own tokens / wall seconds
    assert summary["output_tokens_per_second"] == round(22 / 3, 2) and summary["requests"] == 2
    assert summary["errors"] == 1 and summary["concurrency"] == 1


def test_the_ratio_to_plain_decoding_is_the_median_of_ratios_measured_in_the_same_rounds():
    from specserve_runtime.load_bench import ratio_to_plain

    plain = {"output_tokens_per_second": 13.33, "rounds": [10.0, 20.0, 10.0]}  # a fast minute in round 2
    method = {"output_tokens_per_second": 14.0, "rounds": [11.0, 19.0, 12.0]}
    assert ratio_to_plain(method, plain) == 1.1  # median of 1.1, 0.95, 1.2; the totals would say 1.05
    assert ratio_to_plain({"output_tokens_per_second": 14.0}, plain) == 14.0 / 13.33  # not measured in rounds


def test_served_methods_take_turns_at_each_concurrency_each_round_starting_with_the_next(monkeypatch):
    from specserve_runtime import load_bench

    calls = []

    async def fake_level(url, model, prompts, concurrency, requests_per_client, max_tokens):
        if requests_per_client == 1:  # a level's uncounted round: slow, first batches
            calls.append((url, concurrency, "warm-up"))
            return load_bench.Level(concurrency, wall_seconds=1.0, requests=[])
        calls.append((url, concurrency))
        rate = {"u-ar": 10.0, "u-ngram": 12.0, "u-eagle3": 9.0}[url]
        request = load_bench.RequestTiming(ttft=0.1, seconds=1.0, tokens=int(rate) * concurrency, gaps=[0.1])
        return load_bench.Level(concurrency, wall_seconds=1.0, requests=[request])

    monkeypatch.setattr(load_bench, "run_level", fake_level)
    monkeypatch.setattr(load_bench, "served_model", lambda url: "m")
    monkeypatch.setattr(load_bench, "served_acceptance_length", lambda url: 1.5)
    urls = {"ar": "u-ar", "ngram": "u-ngram", "eagle3": "u-eagle3"}
    results = load_bench.measure_servers(urls, ["p"], [1, 4], repeats=3, requests_per_client=2, max_tokens=8,
                                         log=lambda message: None)
    assert calls == [("u-ar", 1, "warm-up"), ("u-ngram", 1, "warm-up"), ("u-eagle3", 1, "warm-up")] + [
                        ("u-ar", 1), ("u-ngram", 1), ("u-eagle3", 1), ("u-ngram", 1), ("u-eagle3", 1), ("u-ar", 1),
                        ("u-eagle3", 1), ("u-ar", 1), ("u-ngram", 1)] + [
                        ("u-ar", 4, "warm-up"), ("u-ngram", 4, "warm-up"), ("u-eagle3", 4, "warm-up"),
                        ("u-ar", 4), ("u-ngram", 4), ("u-eagle3", 4), ("u-ngram", 4), ("u-eagle3", 4), ("u-ar", 4),
                        ("u-eagle3", 4), ("u-ar", 4), ("u-ngram", 4)]
    assert [level["rounds"] for level in results["ngram"]["levels"]] == [[12.0] * 3, [48.0] * 3]
    assert results["eagle3"]["acceptance_length"] == 1.5 and "0.90x" in load_bench.table(results)


def test_acceptance_length_is_read_from_a_metrics_page():
    from specserve_runtime.load_bench import acceptance_length

    page = ('vllm:spec_decode_num_drafts_total{engine="embedded",model_name="m"} 40.0\n'
            'vllm:spec_decode_num_accepted_tokens_total{engine="embedded",model_name="m"} 60.0\n'
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="embedded",position="0"} 30.0\n')
    assert acceptance_length(page) == 2.5
    assert acceptance_length("vllm:generation_tokens_total 9.0\n") == 1.0


def test_load_curves_become_a_performance_block_with_a_row_per_concurrency(tmp_path):
    from specserve_operator.priors import capacity_priors, load_performance
    from specserve_runtime.commands.bench import write_performance
    from specserve_runtime.load_bench import performance_block, table

    def level(concurrency, total, per_request, ttft, errors=0):
        return {"concurrency": concurrency, "requests": 4, "errors": errors, "output_tokens_per_second": total,
                "tokens_per_second_per_request": per_request, "itl_p50_ms": 50.0, "itl_p99_ms": 90.0,
                "ttft_p50_ms": ttft, "ttft_p99_ms": 2 * ttft}

    results = {"ar": {"acceptance_length": 1.0, "levels": [level(1, 10.0, 10.0, 80.0), level(4, 30.0, 7.5, 120.0)]},
               "dflash:3": {"acceptance_length": 2.2, "levels": [level(1, 15.0, 15.0, 90.0), level(4, 33.0, 8.2, 150.0, 2)]}}
    block = performance_block(results, max_num_seqs=4)
    assert block["dflash"] == {"acceptanceLength": 2.2, "errorRate": 0.2, "maxConcurrency": 4, "curve": [
        {"concurrency": 1, "tokensPerSecondPerRequest": 15.0, "ttftMs": 90.0},
        {"concurrency": 4, "tokensPerSecondPerRequest": 8.2, "ttftMs": 150.0}]}
    write_performance(block, path := tmp_path / "performance.yaml")
    assert [point.in_flight_per_replica for point in capacity_priors(load_performance(path))["none"].points] == [0, 3]  # rows 1 and 4
    rendered = table(results)
    assert "| dflash:3 | 4 " in rendered and "1.10x" in rendered and "1.50x" in rendered  # against ar, level by level


@pytest.mark.parametrize("arguments, message", [
    (["--url", "http://127.0.0.1:1"], "--url benches a running server under load: it needs --concurrency"),
    (["--concurrency", "4,2"], "--concurrency takes increasing integers >= 1"),
    (["--concurrency", "0,2"], "--concurrency takes increasing integers >= 1"),
    (["--concurrency", "1,x"], "--concurrency takes comma-separated integers"),
    (["--concurrency", "1", "--url", "http://127.0.0.1:1"], "--url benches the one method that server runs"),
    (["--concurrency", "1", "--kernels"], "--concurrency measures greedy serving"),
    (["--concurrency", "1", "--requests-per-client", "0"], "--requests-per-client must be >= 1"),
    (["--concurrency", "1", "--methods", "ar,dflash", "--propose-schedule", "2,1"], "increasing draft lengths >= 1"),
    (["--concurrency", "1", "--methods", "ar,dflash", "--propose-schedule", "0"], "increasing draft lengths >= 1"),
    (["--concurrency", "1", "--methods", "ar,eagle3,dflash", "--propose-schedule", "1"], "--methods ar,METHOD without :K"),
    (["--concurrency", "1", "--methods", "dflash", "--propose-schedule", "1"], "--methods ar,METHOD without :K"),
    (["--concurrency", "1", "--methods", "ar,dflash:3", "--propose-schedule", "1"], "--methods ar,METHOD without :K"),
    (["--closed-loop", "0"], "--closed-loop 0: the batch size must be >= 1"),
    (["--closed-loop", "8", "--round-steps", "0"], "--round-steps 0: a round must take at least one step"),
    (["--closed-loop", "8", "--kernels"], "--closed-loop measures greedy decoding under load in process"),
])
def test_load_bench_refuses_bad_flags_before_starting_anything(capsys, arguments, message):
    from specserve.cli import main

    assert main(["bench", "--limit", "1", *arguments]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_load_bench_measures_a_live_server_at_each_concurrency(tmp_path, capsys):
    from specserve_runtime.performance import Performance
    from specserve.cli import main

    performance = tmp_path / "performance.yaml"
    assert main(["bench", "--methods", "ar,eagle3", "--concurrency", "1,3", "--limit", "3", "--max-new-tokens", "12",
                 "--repeats", "2", "--emit-performance", str(performance), "--json"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    results = json.loads(out[-1])["concurrency"]
    for name in ("ar", "eagle3"):
        levels = results[name]["levels"]
        assert [level["concurrency"] for level in levels] == [1, 3]
        # 2 rounds of 2 requests per client, each round's own throughput kept
        assert all(level["errors"] == 0 and level["requests"] == 4 * level["concurrency"] for level in levels)
        assert all(len(level["rounds"]) == 2 and min(level["rounds"]) > 0 for level in levels)
        assert all(level["output_tokens_per_second"] > 0 and level["ttft_p99_ms"] > 0 for level in levels)
    assert results["ar"]["acceptance_length"] == 1 and results["eagle3"]["acceptance_length"] > 1  # its counters
    block = Performance.model_validate(yaml.safe_load(performance.read_text()))
    assert block.none.max_concurrency == 3 and [row.concurrency for row in block.eagle3.curve] == [1, 3]
    assert "| eagle3" in "\n".join(out)


def test_a_schedule_bench_writes_every_fixed_length_as_draft_lengths_and_compares_the_schedule_with_the_best():
    from specserve_runtime.commands.bench import schedule_performance_block
    from specserve_runtime.load_bench import schedule_table
    from specserve_runtime.performance import Performance, draft_length_curves

    def result(acceptance, *levels):
        return {"acceptance_length": acceptance, "levels": [
            {"concurrency": c, "requests": 4, "errors": 0, "output_tokens_per_second": total, "rounds": [total],
             "tokens_per_second_per_request": total / c, "ttft_p50_ms": 20.0} for c, total in levels]}

    results = {"ar": result(1.0, (1, 100), (4, 300)), "dflash:1": result(1.6, (1, 130), (4, 280)),
               "dflash:2": result(2.0, (1, 150), (4, 240)), "dflash schedule": result(1.8, (1, 147), (4, 303))}
    block = Performance.model_validate(schedule_performance_block(results, "dflash", [1, 2], 4))
    assert block.dflash.acceptance_length == 2.0  # the method's own row: its longest fixed length
    assert [(r.num_speculative_tokens, r.acceptance_length) for r in block.dflash.draft_lengths] == [(1, 1.6), (2, 2.0)]
    assert sorted(draft_length_curves(block, "dflash")) == [0, 1, 2]
    rendered = schedule_table(results, "dflash", [1, 2], "dflash schedule")
    assert "| 1           | 100.0    | 2: 150.0, 1.50x   | 147.0          | 1.47x          | 0.98x" in rendered
    assert "| 4           | 300.0    | 1: 280.0, 0.93x   | 303.0          | 1.01x          | 1.01x" in rendered  # ar was best


@pytest.mark.slow
def test_a_schedule_bench_proposes_from_fixed_lengths_then_serves_the_schedule_beside_them(tmp_path, capsys):
    from specserve_runtime.config import parse_schedule, schedule_problems
    from specserve_runtime.performance import Performance
    from specserve.cli import main

    performance = tmp_path / "performance.yaml"
    assert main(["bench", "--methods", "ar,dflash", "--concurrency", "1,2", "--propose-schedule", "1,2", "--limit", "2",
                 "--max-new-tokens", "8", "--emit-performance", str(performance), "--json"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(out[-1])
    schedule = parse_schedule(summary["schedule"])
    assert schedule_problems(schedule, "dflash", 2, "schedule") == []
    assert set(summary["concurrency"]) == {"ar", "dflash:1", "dflash:2", "dflash schedule"}
    assert all(level["errors"] == 0 and level["output_tokens_per_second"] > 0
               for result in summary["concurrency"].values() for level in result["levels"])
    block = Performance.model_validate(yaml.safe_load(performance.read_text()))
    assert [row.num_speculative_tokens for row in block.dflash.draft_lengths] == [1, 2]
    assert any("schedule vs best of fixed and ar" in line for line in out)


def test_a_bench_variant_becomes_serve_flags():
    from specserve_runtime.load_bench import serve_arguments

    assert serve_arguments("dflash:3") == ["--method", "dflash", "--num-speculative-tokens", "3"]
    assert serve_arguments("ar") == ["--method", "ar"]
    assert serve_arguments("eagle3@runs/b/drafter") == ["--method", "eagle3", "--drafter", "runs/b/drafter"]
    assert serve_arguments("dflash:tree5+lookup0") == ["--method", "dflash", "--num-speculative-tokens", "5", "--draft-tree",
                                                       "--prompt-lookup", "0"]


@pytest.mark.slow
def test_load_bench_names_why_its_server_did_not_start(tmp_path, capsys):
    from specserve.cli import main

    absent = tmp_path / "no-such-model"
    assert main(["bench", "--methods", "ar", "--concurrency", "1", "--limit", "1", "--model", str(absent)]) == 2
    error = capsys.readouterr().err
    assert "bench --concurrency: specserve serve --method ar exited with code 2" in error and str(absent) in error


def test_the_closed_loop_interleaves_plain_fixed_and_adaptive_and_replaces_finished_sequences(tiny_llama, tiny_llama_dir):
    from specserve_runtime.bench_load import closed_loop, closed_loop_table
    from specserve_runtime.loader import LoadedModel

    from .conftest import ByteTokenizer

    model = LoadedModel(tiny_llama_dir, tiny_llama, ByteTokenizer(), {2})
    prompts = [[5, 6, 7, 5, 6, 7], [9, 10, 11, 12], [20, 21, 20, 21, 20]]
    results = closed_loop(model, ["ngram:2"], prompts, batch_size=3, rounds=2, round_steps=6, max_new_tokens=5)
    assert list(results) == ["ar", "ngram:2 fixed", "ngram:2 adaptive"]
    for result in results.values():
        assert len(result["rounds"]) == 2 and result["tokens_per_second"] > 0
    assert results["ar"]["lengths"] == {} and results["ngram:2 fixed"]["lengths"] == {}
    assert set(results["ngram:2 adaptive"]["lengths"]) <= {0, 1, 2} and sum(results["ngram:2 adaptive"]["lengths"].values()) > 0
    # decode-only steps timed by the drafts offered: plain 0, fixed its 2, adaptive what it chose
    assert list(results["ar"]["decode_step_ms"]) == [0] and list(results["ngram:2 fixed"]["decode_step_ms"]) == [2]
    assert set(results["ngram:2 adaptive"]["decode_step_ms"]) <= set(results["ngram:2 adaptive"]["lengths"])
    assert all(ms > 0 for result in results.values() for ms in result["decode_step_ms"].values())
    table = closed_loop_table(results)
    assert "| ngram:2 adaptive" in table and "1.00x" in table  # ar against itself
    assert "decode step ms by drafts" in table


def test_a_prompt_set_is_sampled_from_its_held_out_split_a_few_of_each_category():
    from specserve_runtime.bench import held_out_sample

    records = [{"prompt": f"p{i}", "category": ["chat", "code", "math"][i % 3], "split": "eval" if i % 2 else "train"}
               for i in range(20)]
    sample = held_out_sample(records, per_category=2)
    assert [r["prompt"] for r in sample] == ["p1", "p7", "p3", "p9", "p5", "p11"]  # code, chat, math: file order
    assert all(r["split"] == "eval" for r in sample)
    plain = [{"prompt": "a"}, {"prompt": "b"}, {"prompt": "c"}]
    assert held_out_sample(plain, per_category=1) == plain  # a plain prompt file is used whole


def test_bench_reads_a_v2_style_prompt_set_per_category(tmp_path, capsys):
    from specserve.cli import main

    path = tmp_path / "set.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Say the word {w}.", "category": c, "split": s}) + "\n"
                            for w, c, s in [("red", "chat", "eval"), ("blue", "math", "train"), ("green", "math", "eval"),
                                            ("gray", "math", "eval")]))
    assert main(["bench", "--methods", "ar", "--prompts-file", str(path), "--per-category", "1", "--max-new-tokens", "2",
                 "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["methods"]["ar"]["acceptance_length_by_category"].keys() == {"chat", "math"}
    assert summary["methods"]["ar"]["tokens"] <= 4  # two prompts: red and green


def test_the_kernel_timings_cover_every_shape_they_print(tiny_llama, tiny_llama_dir):
    """`bench --kernels` on a tiny model: every timing is there and positive, and the repeated
    steps leave the caches where they began (a step that forgot to crop would overflow)."""
    from specserve_runtime.bench_load import decode_floor
    from specserve_runtime.loader import LoadedModel

    from .conftest import ByteTokenizer

    timings = decode_floor(LoadedModel(tiny_llama_dir, tiny_llama, ByteTokenizer(), {2}), prefix=40, runs=3)
    assert set(timings["decode_8_with_prompt_chunk_ms_by_tokens"]) == {0, 16, 32, 64, 128}
    for layout in ("blocks", "onednn", "plain"):
        assert set(timings[f"verify_ms_by_tokens_{layout}"]) == set(range(1, 9))
        assert set(timings[f"batch_ms_by_sequences_{layout}"]) == {1, 2, 4, 8}
    numbers = [timings[name] for name in ("decode_step_ms", "decode_step_separate_ms", "matmul_floor_ms")]
    numbers += [ms for value in timings.values() if isinstance(value, dict) for ms in value.values()]
    assert all(ms > 0 for ms in numbers)
