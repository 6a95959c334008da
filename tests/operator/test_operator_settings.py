"""The operator's settings come from its environment (the chart sets them): a bad one stops it at start,
naming the variable, before kopf runs."""

import pytest

from specserve_operator.main import settings_from_env
from specserve_operator.validate import InputProblems


@pytest.mark.parametrize("value", ["2m", "0", "-5", "nan", "inf", ""])
def test_a_duration_that_is_not_a_positive_number_of_seconds_is_refused(monkeypatch, value):
    monkeypatch.setenv("SPECSERVE_REPLICA_STARTUP_SECONDS", value)
    with pytest.raises(InputProblems, match=f"SPECSERVE_REPLICA_STARTUP_SECONDS='{value}': expected a positive "
                                            f"number of seconds \\(default 120\\)"):
        settings_from_env()


def test_durations_are_read_and_default_when_unset(monkeypatch):
    monkeypatch.setenv("SPECSERVE_REPLICA_STARTUP_SECONDS", "300")
    monkeypatch.delenv("SPECSERVE_AUTOSCALE_INTERVAL_SECONDS", raising=False)
    settings = settings_from_env()
    assert settings.replica_startup_seconds == 300 and settings.autoscale_interval_seconds == 30


def test_the_operator_command_exits_2_naming_a_bad_setting_before_starting(monkeypatch, capsys):
    import kopf

    from specserve.cli import main

    monkeypatch.setattr(kopf, "run", lambda **kwargs: pytest.fail("kopf started with a bad setting"))
    monkeypatch.setenv("SPECSERVE_AUTOSCALE_INTERVAL_SECONDS", "often")
    assert main(["operator", "--namespace", "team-a", "--metrics-port", "0"]) == 2
    assert "SPECSERVE_AUTOSCALE_INTERVAL_SECONDS='often'" in capsys.readouterr().err
