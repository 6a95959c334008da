"""The operator's settings come from its environment (the chart sets them): a bad one stops it at start,
naming the variable, before kopf runs."""

from pathlib import Path

import pytest

from specserve_operator.main import _decides, settings_from_env
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



def test_the_capacity_priors_file_gives_the_autoscaler_s_priors_and_the_draft_lengths_to_propose_from(monkeypatch, tmp_path):
    import yaml

    scenario = Path(__file__).resolve().parents[2] / "docs" / "scenarios" / "draft-schedule.yaml"
    priors = tmp_path / "capacity-priors.yaml"
    priors.write_text(yaml.safe_dump(yaml.safe_load(scenario.read_text())["performance"]))
    monkeypatch.setenv("SPECSERVE_CAPACITY_PRIORS", str(priors))
    settings = settings_from_env()
    assert set(settings.capacity_priors) == {"none", "dflash"}
    assert set(settings.draft_lengths) == {"dflash"}  # plain decoding is length 0, not a method with lengths
    assert sorted(settings.draft_lengths["dflash"].curves) == [0, 3, 7]
    assert settings.draft_lengths["dflash"].acceptance == {0: 1.0, 3: 2.9, 7: 4.4}
    monkeypatch.delenv("SPECSERVE_CAPACITY_PRIORS")
    assert settings_from_env().draft_lengths == {}


def test_every_serving_with_a_rollout_or_autoscaling_gets_the_decision_tick():
    """Including the rollouts the operator starts itself: a fallback, an applied draft-length schedule."""
    assert not _decides(spec={}, status={})
    assert not _decides(spec={}, status={"draftSchedule": {"proposed": []}})  # proposed only: nothing rolls
    assert _decides(spec={"rollout": {"candidate": {}}}, status={})
    assert _decides(spec={"autoscaling": {"enabled": True}}, status={})
    assert _decides(spec={}, status={"fallback": {"generation": 1}})
    assert _decides(spec={}, status={"draftSchedule": {"applied": {"generation": 1}}})
