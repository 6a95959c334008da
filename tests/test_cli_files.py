"""Every command that reads a YAML file says what is wrong with it the same way: one line naming the file, and
where the YAML breaks, exit status 2 (specserve_runtime.config.read_yaml)."""

import pytest

from .runtime.test_cli import error_of

COMMANDS = [
    ["serve", "--config"],
    ["launch", "--dry-run", "--config"],
    ["render", "-f"],
    ["simulate", "--scenario"],
    ["canary", "--candidate", "method=dflash", "--stable"],
]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda command: command[0])
def test_broken_yaml_is_one_line_naming_the_file_and_where(capsys, tmp_path, command):
    broken = tmp_path / "broken.yaml"
    broken.write_text("a: 1\nb: [\n  c\n")
    message = error_of(capsys, *command, str(broken))
    assert f"{broken}: invalid YAML (line 4, column 1: while parsing a flow sequence" in message


@pytest.mark.parametrize("command", [c for c in COMMANDS if c[0] != "canary"], ids=lambda command: command[0])
def test_an_unreadable_file_is_named(capsys, tmp_path, command):
    absent = tmp_path / "absent.yaml"
    assert f"{absent}: cannot read (No such file or directory)" in error_of(capsys, *command, str(absent))
