"""`specserve launch` on vLLM: where references resolve, how vLLM is started, and the drafter folders refused
before it starts (the real vLLM runs in tests/vllm)."""

import json
import shutil
import struct

import pytest
import yaml

from specserve_runtime import cli
from specserve_runtime.commands import serving
from specserve_runtime.config import (BUNDLED_DRAFTERS_DIR, PVC_MOUNT, BatchSizeRange, RuntimeConfig, local_reference,
                                      parse_schedule, schedule_problems, scheduled_tokens)
from specserve_runtime.drafters import DEFAULT_DRAFTERS
from specserve_runtime.launch import (DrafterLayoutError, check_vllm_drafter, speculative_config, vllm_command,
                                      vllm_program)


def test_references_resolve_where_each_one_is():
    assert local_reference("hf://Qwen/Qwen3-8B") == "Qwen/Qwen3-8B"
    assert local_reference("pvc://models/qwen3/8b") == f"{PVC_MOUNT}/models/qwen3/8b"
    assert local_reference("pvc://models") == f"{PVC_MOUNT}/models"
    assert local_reference("bundled://smollm2-135m-instruct-dflash") == str(DEFAULT_DRAFTERS["dflash"])
    assert local_reference("/data/model") == "/data/model"
    with pytest.raises(ValueError, match="not s3://"):
        local_reference("s3://bucket/model")
    with pytest.raises(ValueError, match="drafter"):
        RuntimeConfig(model="m", served_name="m", method="dflash", drafter="s3://bucket/d")
    config = RuntimeConfig(model="Qwen/Qwen3-8B", model_uri="pvc://models/qwen3", served_name="q")
    assert config.model_source == f"{PVC_MOUNT}/models/qwen3"
    assert RuntimeConfig(model="Qwen/Qwen3-8B", served_name="q").model_source == "Qwen/Qwen3-8B"


def test_the_launcher_starts_vllm_as_the_image_has_it_or_as_specserve_vllm_says():
    assert vllm_program({}) == ["vllm", "serve"]
    program = vllm_program({"SPECSERVE_VLLM": "/opt/vllm/bin/python -m vllm.entrypoints.openai.api_server"})
    assert program == ["/opt/vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    config = RuntimeConfig(model="m", model_uri="hf://org/m", served_name="s", engine="vllm", port=8123)
    assert vllm_command(config, program) == [*program, "--model", "org/m", "--served-model-name", "s", "--host",
                                             "0.0.0.0", "--port", "8123"]


def test_a_schedule_becomes_vllms_batch_size_schedule():
    schedule = parse_schedule("1-4:7, 5-16:3,17-:0")
    assert schedule == [BatchSizeRange(min_batch_size=1, max_batch_size=4, num_speculative_tokens=7),
                        BatchSizeRange(min_batch_size=5, max_batch_size=16, num_speculative_tokens=3),
                        BatchSizeRange(min_batch_size=17, num_speculative_tokens=0)]
    assert [scheduled_tokens(schedule, size) for size in (1, 4, 5, 16, 17, 500)] == [7, 7, 3, 3, 0, 0]
    config = RuntimeConfig(model="m", served_name="m", method="dflash", drafter="bundled://smollm2-135m-instruct-dflash",
                           engine="vllm", num_speculative_tokens_per_batch_size=schedule)
    speculative = speculative_config(config)
    assert speculative["num_speculative_tokens"] == 7  # the bundled drafter's block - 1
    assert speculative["num_speculative_tokens_per_batch_size"] == [[1, 4, 7], [5, 16, 3], [17, 1 << 20, 0]]
    eagle = config.model_copy(update={"method": "eagle3", "drafter": "bundled://smollm2-135m-instruct-eagle3"})
    with pytest.raises(ValueError, match="7 drafts exceed the 3 a step this drafter takes"):
        speculative_config(eagle)


@pytest.mark.parametrize("text, problem", [
    ("1-4:3,6-:1", "[1].minBatchSize: 6, expected 5"),
    ("2-:3", "[0].minBatchSize: 2, expected 1"),
    ("1-:3,2-8:1", "[0].maxBatchSize: only the last range may be open-ended"),
    ("1-4:3,5-3:1", "[1].maxBatchSize: 3 is below minBatchSize 5"),
    ("1-4:9,5-:1", "[0].numSpeculativeTokens: 9 exceeds the 7 drafts a step"),
])
def test_a_schedule_with_a_gap_an_overlap_or_too_many_drafts_is_refused_naming_the_range(text, problem):
    problems = schedule_problems(parse_schedule(text), "dflash", 7, "schedule")
    assert len(problems) == 1 and problems[0].startswith("schedule" + problem), problems
    assert schedule_problems(parse_schedule(text), "none", 7, "schedule") == ["schedule: method none drafts nothing"]


def test_a_schedule_on_the_command_line_is_checked(capsys):
    for flags, message in [(["--num-speculative-tokens-per-batch-size", "1-4"], "a range is MIN-MAX:TOKENS"),
                           (["--num-speculative-tokens", "3", "--num-speculative-tokens-per-batch-size", "1-:4"],
                            "[0].numSpeculativeTokens: 4 exceeds the 3 drafts")]:
        assert cli.main(["serve", "--method", "ngram", *flags]) == 2
        assert message in capsys.readouterr().err


def write_drafter(folder, config: dict, tensors: dict[str, list[int]]):
    """config.json and a model.safetensors whose header names `tensors` (name -> shape), zero-filled."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    header, offset = {}, 0
    for name, shape in tensors.items():
        size = 2 * (shape[0] * (shape[1] if len(shape) > 1 else 1))
        header[name] = {"dtype": "F16", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(offset))
    return folder


@pytest.mark.parametrize("method", ["dflash", "eagle3"])
def test_a_drafter_folder_vllm_cannot_use_is_refused_naming_the_file_and_the_field(tmp_path, method):
    bundled = json.loads((DEFAULT_DRAFTERS[method] / "config.json").read_text())
    assert check_vllm_drafter(DEFAULT_DRAFTERS[method], method) == bundled
    with pytest.raises(DrafterLayoutError, match=f"{tmp_path}/absent/config.json: no such file"):
        check_vllm_drafter(tmp_path / "absent", method)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{")
    with pytest.raises(DrafterLayoutError, match=f"{tmp_path}/bad/config.json: invalid JSON"):
        check_vllm_drafter(tmp_path / "bad", method)
    other = "eagle3" if method == "dflash" else "dflash"
    with pytest.raises(DrafterLayoutError, match=f"config.json: speculators_model_type is '{method}', the method '{other}'"):
        check_vllm_drafter(DEFAULT_DRAFTERS[method], other)
    own_layout = {"architectures": ["Eagle3DraftModel"], "vocab_size": 49152, "draft_vocab_size": 8192}
    write_drafter(tmp_path / "own", own_layout, {"d2t": [8192]})
    with pytest.raises(DrafterLayoutError, match=f"{tmp_path}/own/config.json: no speculators_model_type"):
        check_vllm_drafter(tmp_path / "own", method)
    key = "eagle_aux_hidden_state_layer_ids" if method == "eagle3" else "aux_hidden_state_layer_ids"
    write_drafter(tmp_path / "no-taps", {k: v for k, v in bundled.items() if k != key}, {"lm_head.weight": [8192, 576]})
    with pytest.raises(DrafterLayoutError, match=f"{tmp_path}/no-taps/config.json: no {key} "):
        check_vllm_drafter(tmp_path / "no-taps", method)
    layers = {k: v for k, v in bundled["transformer_layer_config"].items() if k != "num_hidden_layers"}
    write_drafter(tmp_path / "no-layers", {**bundled, "transformer_layer_config": layers}, {})
    with pytest.raises(DrafterLayoutError, match="config.json: no transformer_layer_config.num_hidden_layers"):
        check_vllm_drafter(tmp_path / "no-layers", method)
    write_drafter(tmp_path / "no-head", bundled, {"d2t": [8192], "fc.weight": [576, 1728]})
    with pytest.raises(DrafterLayoutError, match=f"{tmp_path}/no-head/model.safetensors: no lm_head.weight for the "
                                                 "8192-token draft vocabulary"):
        check_vllm_drafter(tmp_path / "no-head", method)


def test_launch_refuses_such_a_folder_before_vllm_starts(tmp_path, monkeypatch, capsys):
    shutil.copytree(BUNDLED_DRAFTERS_DIR / "smollm2-135m-instruct-eagle3", tmp_path / "drafter")
    config = json.loads((tmp_path / "drafter" / "config.json").read_text())
    del config["eagle_aux_hidden_state_layer_ids"]
    (tmp_path / "drafter" / "config.json").write_text(json.dumps(config))
    runtime = RuntimeConfig(model="m", served_name="m", method="eagle3", drafter=str(tmp_path / "drafter"),
                            engine="vllm")
    (tmp_path / "runtime.yaml").write_text(runtime.to_yaml())
    started = []
    monkeypatch.setattr(serving.os, "execvp", lambda *command: started.append(command))
    assert cli.main(["launch", "--config", str(tmp_path / "runtime.yaml")]) == 2
    assert started == []
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == f"specserve: error: {tmp_path}/drafter/config.json: no eagle_aux_hidden_state_layer_ids (vLLM needs it " \
                   "to load a eagle3 drafter)"
    # The bundled folder itself starts.
    runtime = runtime.model_copy(update={"drafter": "bundled://smollm2-135m-instruct-eagle3"})
    (tmp_path / "runtime.yaml").write_text(yaml.safe_dump(runtime.model_dump(by_alias=True, exclude_none=True)))
    assert cli.main(["launch", "--config", str(tmp_path / "runtime.yaml")]) == 0
    (command,) = started
    assert command[1][command[1].index("--speculative-config") + 1].startswith('{"method":"eagle3"')


def test_a_runtime_config_cannot_set_its_own_flags_again_through_engine_args():
    """The launcher appends engine_args last, where vLLM takes the last value given: the configuration's model,
    address and speculation (which the operator checked against the tenant's profile) stay as set."""
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=r"\[1\] '--speculative-config': --speculative-config is set from"):
        RuntimeConfig(model="m", served_name="m", engine="vllm", engine_args=["--dtype=half", "--speculative-config", "{}"])
    assert RuntimeConfig(model="m", served_name="m", engine_args=["--dtype", "half"]).engine_args == ["--dtype", "half"]
