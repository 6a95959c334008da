"""The wheel: what the commands read at run time travels in it as package data, so that an installed `specserve`
(or an image) runs from any directory."""

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_wheel_carries_the_data_the_commands_read(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "--wheel-dir", str(tmp_path), str(ROOT)],
                   check=True, capture_output=True)
    (wheel,) = tmp_path.glob("specserve-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for needed in ["specserve/cli.py",
                   "specserve_operator/local/canary-prompts.jsonl",  # the canary's and the demo's default prompts
                   "specserve_runtime/training/data/distilled.json",  # how to rebuild the training data
                   "specserve_runtime/training/data/prompts-v1.jsonl",
                   "specserve_runtime/drafters/weights/smollm2-135m-instruct-dflash/model.safetensors",
                   "specserve_runtime/drafters/weights/smollm2-135m-instruct-eagle3/config.json"]:
        assert needed in names, needed
    assert not any(name.startswith(("tests/", "docs/")) for name in names)


def test_the_canary_and_the_demo_run_from_any_directory(tmp_path, monkeypatch):
    from specserve.cli import build_parser
    from specserve_operator.local import canary_plan

    monkeypatch.chdir(tmp_path)
    for command in (["canary", "--stable", "method=none", "--candidate", "method=dflash"], ["demo"]):
        plan = canary_plan.make_plan(build_parser().parse_args(command))
        assert len(plan.prompts) == 6, command
