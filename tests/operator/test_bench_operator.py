"""`specserve bench-operator`: the real kopf operator against KMock reconciles every serving it is given, and
the report counts the API calls that took. Run as a command: its operator registers kopf handlers of its own,
which must not outlive it in this process."""

import re
import subprocess

from ..runtime.test_cli import error_of
from .test_canary_command import specserve_command


def test_every_serving_is_reconciled_and_its_calls_counted():
    result = subprocess.run([*specserve_command(), "bench-operator", "--servings", "2"], capture_output=True,
                            text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    head = re.match(r"reconciled 2 SpeculativeServings in [\d.]+ s \([\d.]+/s\); (\d+) API requests, ([\d.]+) per "
                    r"serving", result.stdout)
    assert head, result.stdout
    rows = dict(re.findall(r"^\| (\w+ \w+) \| (\d+) \|", result.stdout, re.MULTILINE))
    # Each serving got its one Deployment, and had its status written; the table adds up to the total.
    assert rows["POST deployments"] == "2" and int(rows["PATCH speculativeservings"]) >= 2
    assert sum(int(n) for n in rows.values()) == int(head.group(1))


def test_a_count_below_one_is_refused_in_one_line(capsys):
    # Refused before its operator starts, so in this process.
    assert error_of(capsys, "bench-operator", "--servings", "0") == "specserve: error: --servings 0: must be at least 1"
