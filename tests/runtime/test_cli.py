"""`specserve generate` rejects bad input with one line that names the problem, and exit status 2."""

import pytest

from specserve.cli import build_parser
from specserve_runtime.commands import training
from specserve.cli import main
from specserve_runtime.drafters.dflash import save_dflash

from .test_dflash import tiny_drafter


def error_of(capsys, *argv) -> str:
    assert main(list(argv)) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_unknown_method(capsys):
    assert "invalid choice: 'medusa'" in error_of(capsys, "generate", "--method", "medusa", "--prompt", "hi")


def test_parser_errors_name_the_command_once(capsys):
    """As argparse prints them: the command, then `error:`, then the problem (not the program name twice)."""
    assert error_of(capsys, "eval-drafter", "--drafter", "random") == \
        "specserve eval-drafter: error: the following arguments are required: --method"
    assert error_of(capsys, "pull", "--no-such-flag") == "specserve: error: unrecognized arguments: --no-such-flag"


def test_block_size_below_two(capsys):
    message = error_of(capsys, "generate", "--method", "dflash", "--block-size", "1", "--prompt", "hi")
    assert "--block-size must be >= 2, got 1" in message


def test_block_size_for_another_method(capsys):
    message = error_of(capsys, "generate", "--method", "eagle3", "--block-size", "4", "--prompt", "hi")
    assert "--block-size applies to --method dflash only" in message


def test_missing_prompts_file(capsys, tmp_path):
    missing = tmp_path / "nope.jsonl"
    message = error_of(capsys, "generate", "--method", "ar", "--prompts-file", str(missing))
    assert f"--prompts-file {missing}: no such file" in message


def test_prompts_file_line_without_prompt(capsys, tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "ok"}\n{"question": "where is the prompt"}\n')
    assert f'{path}:2: expected an object with a string "prompt" field' in error_of(
        capsys, "generate", "--method", "ar", "--prompts-file", str(path)
    )


def test_prompt_and_file_are_exclusive(capsys, tmp_path):
    message = error_of(capsys, "generate", "--method", "ar", "--prompt", "a", "--prompts-file", "x")
    assert "not allowed with argument" in message


def test_model_that_is_not_a_folder(capsys, tmp_path):
    message = error_of(capsys, "generate", "--method", "ar", "--model", str(tmp_path / "absent"), "--prompt", "hi")
    assert "is neither a folder nor a known name" in message


def test_serve_port_out_of_range(capsys):
    assert "--port must be 1..65535, got 99999" in error_of(capsys, "serve", "--method", "none", "--port", "99999")


def test_serve_names_a_model_that_is_not_there(capsys, tmp_path):
    message = error_of(capsys, "serve", "--method", "ar", "--model", str(tmp_path / "absent"))
    assert "is neither a folder nor a known name" in message


def test_missing_default_model_cache_says_how_to_fix(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path))
    message = error_of(capsys, "generate", "--method", "ar", "--prompt", "hi")
    assert "not cached" in message and "specserve pull" in message


def test_corrupt_default_model_cache_says_how_to_fix(capsys, tmp_path, monkeypatch):
    folder = tmp_path / "models" / "SmolLM2-135M-Instruct"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"truncated")
    (folder / "specserve-cache.json").write_text('{"files": {"model.safetensors": 538090408}}')
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path))
    message = error_of(capsys, "generate", "--method", "ar", "--prompt", "hi")
    assert "corrupt" in message and "specserve pull --force" in message


@pytest.mark.slow
def test_drafter_for_another_target(capsys, tmp_path, tiny_llama):
    save_dflash(tiny_drafter(tiny_llama), tmp_path)
    message = error_of(capsys, "generate", "--method", "dflash", "--drafter", str(tmp_path), "--prompt", "hi")
    assert "dflash drafter does not match the target model: hidden_size 64 != target's 576" in message


def test_eval_drafter_names_a_missing_held_out_folder(capsys, tmp_path):
    message = error_of(capsys, "eval-drafter", "--method", "dflash", "--eval-data", str(tmp_path / "absent"))
    assert f"--eval-data {tmp_path / 'absent'}: no such folder (run `specserve distill` first)" in message


def test_training_data_defaults_to_set_v2_in_the_cache(capsys, tmp_path, monkeypatch):
    # Built (as the manifest's commands build it), the defaults are there: the command gets past them to its next check.
    from specserve_runtime.store import default_model_dir

    (tmp_path / "models").mkdir()
    (tmp_path / "models" / default_model_dir().name).symlink_to(default_model_dir())
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path))
    (tmp_path / "data" / training.DEFAULT_EVAL_DATA).mkdir(parents=True)
    message = error_of(capsys, "eval-drafter", "--method", "dflash", "--drafts", "8")
    assert "--drafts 8: a DFlash block of 8" in message


def test_missing_default_training_data_says_how_to_build_it(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path))
    message = error_of(capsys, "eval-drafter", "--method", "dflash")
    assert f"--eval-data not given, and its default {tmp_path / 'data' / 'distill-v2-eval'} is not built: " \
           "specserve build-prompts && SPECSERVE_TARGET_INT8=0 specserve distill" in message
    assert "pass --eval-data with a folder written by `specserve distill`" in message
    message = error_of(capsys, "train-drafter", "--method", "dflash", "--out", str(tmp_path / "run"))
    assert f"--data not given, and its default {tmp_path / 'data' / 'distill-v2'} is not built" in message


def test_the_data_manifest_lists_every_file_and_commands_the_cli_takes():
    """training/data/distilled.json: what the bundled drafters were trained on, and how to build it again."""
    import json
    import shlex

    manifest = json.loads(training.DISTILLED_MANIFEST.read_text())
    assert {training.DEFAULT_TRAIN_DATA, training.DEFAULT_EVAL_DATA} <= set(manifest["datasets"])
    for name, dataset in manifest["datasets"].items():
        assert dataset["records"] == sum(f["records"] for f in dataset["files"].values()) > 0
        assert all(len(f["sha256"]) == 64 and f["bytes"] > 0 for f in dataset["files"].values())
        assert any(f"--out ~/.cache/specserve/data/{name} " in command for command in dataset["commands"])
        for command in dataset["commands"]:
            words = [word for word in shlex.split(command) if "=" not in word or word.startswith("-")]
            assert words[0] == "specserve"
            expanded = [word.replace("~", "/home/user") for word in words[1:]]
            build_parser().parse_args(expanded)  # every flag is one the command takes


def test_eval_drafter_refuses_more_drafts_than_the_block_holds(capsys, tmp_path):
    message = error_of(capsys, "eval-drafter", "--method", "dflash", "--eval-data", str(tmp_path), "--drafts", "8")
    assert "--drafts 8: a DFlash block of 8 drafts 1 to 7" in message
    message = error_of(capsys, "eval-drafter", "--method", "eagle3", "--eval-data", str(tmp_path), "--drafts", "0")
    assert "--drafts must be >= 1, got 0" in message
