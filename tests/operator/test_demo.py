"""`specserve demo`: the report and charts from a rollout's analyses, the autoscaler on live windows,
input checks (fast), and the whole demo against two real runtimes (slow)."""

import datetime
import json
import subprocess
from dataclasses import asdict
from pathlib import Path

import pytest

from specserve_operator.local import canary, demo
from specserve_operator.measure import Window
from specserve.cli import main

from .test_canary_command import prompts_file, specserve_command  # noqa: F401

T0 = datetime.datetime(2026, 11, 23, 10, 0, 0, tzinfo=datetime.timezone.utc)
PNG = b"\x89PNG\r\n\x1a\n"


def plan_for(prompts_file, *extra) -> canary.Plan:  # noqa: F811
    import argparse

    parser = argparse.ArgumentParser()
    demo.add_rollout_flags(parser, {**demo.DEFAULTS, "prompts_file": str(prompts_file)})
    return canary.make_plan(parser.parse_args(list(extra)))


def window(revision, acceptance, itl, per_position, tokens=600.0) -> Window:
    return Window(revision, 20, 1, tokens_per_second=tokens / 20, generated_tokens=tokens,
                  p99_inter_token_latency_ms=itl, p99_time_to_first_token_ms=80.0, acceptance_length=acceptance,
                  accepted_per_position=per_position, finished_requests=12, error_rate=0.0,
                  in_flight_per_replica=1.0, hourly_cost_usd=1.0, tokens_per_dollar=tokens / 20 * 3600)


def outcome_with(plan) -> canary.Outcome:
    outcome = canary.Outcome(decision="Aborted", reason="analysis failed 2 times in a row")
    for index, (weight, verdict, candidate_itl) in enumerate([(50, "Pass", 40.0), (50, "Fail", 90.0), (50, "Fail", 95.0)]):
        at = T0 + datetime.timedelta(seconds=20 * index)
        outcome.analyses.append({
            "at": at.strftime("%Y-%m-%dT%H:%M:%SZ"), "step": 0, "weight": weight, "verdict": verdict,
            "reasons": [f"p99LatencyRatio: {verdict}"],
            "stable": asdict(window(plan.stable.revision, 1.8, 40.0, (0.5, 0.3))),
            "candidate": asdict(window(plan.candidate.revision, 1.4 + 0.1 * index, candidate_itl, (0.3, 0.1))),
        })
    return outcome


def test_the_report_takes_medians_per_revision_and_the_last_verdict(prompts_file):  # noqa: F811
    plan = plan_for(prompts_file)
    result = demo.report(plan, outcome_with(plan), demo.Autoscaler(plan), ["a.png"])
    stable, candidate = result["revisions"]["stable"], result["revisions"]["candidate"]
    assert stable["revision"] == plan.stable.revision and candidate["speculator"] == "dflash (bundled drafter)"
    assert candidate["acceptanceLength"] == pytest.approx(1.5) and candidate["p99InterTokenLatencyMs"] == 90.0
    assert candidate["acceptedPerPosition"] == pytest.approx([0.3, 0.1]) and stable["analyses"] == 3
    assert stable["tokensPerDollar"] == pytest.approx(30 * 3600)
    assert result["decision"] == "Aborted" and result["lastAnalysis"]["verdict"] == "Fail"
    text = demo.text_report(result)
    assert "Verdict: Aborted: analysis failed 2 times in a row" in text and "p99LatencyRatio: Fail" in text
    assert "tokens/$ at $1 per replica-hour" in text


def test_the_charts_are_written(prompts_file, tmp_path):  # noqa: F811
    plan = plan_for(prompts_file)
    written = demo.write_charts(plan, outcome_with(plan), tmp_path / "charts")
    assert [p.rsplit("/", 1)[1] for p in written] == [
        "acceptance-by-position.png", "latency-over-time.png", "step-weight-over-time.png"]
    for path in written:
        assert Path(path).read_bytes()[:8] == PNG


def test_the_autoscaler_decides_on_the_live_windows_with_the_operators_code(prompts_file, capsys):  # noqa: F811
    plan = plan_for(prompts_file)
    autoscaler = demo.Autoscaler(plan)
    windows = [window(plan.stable.revision, 1.8, 40.0, ()), window(plan.candidate.revision, 1.4, 45.0, ())]
    autoscaler(T0, windows)
    (decision,) = autoscaler.decisions
    assert "demand 1.20 req/s x 50 tokens" in decision["reason"]  # 2 x 12 requests in 20 s, 600 tokens each 12
    assert 2 <= decision["replicas"] <= demo.MAX_REPLICAS  # a canary keeps one replica of each revision at least
    assert "autoscaler:" in capsys.readouterr().err
    assert autoscaler.status.observations  # the capacity model learns from every window


def test_bad_input_exits_2_naming_it_and_starts_nothing(prompts_file, tmp_path, monkeypatch, capsys):  # noqa: F811
    monkeypatch.setattr(canary, "spawn", lambda *a, **k: pytest.fail("a process was started for bad input"))
    assert main(["demo", "--prompts-file", str(prompts_file), "--steps", "50,40"]) == 2
    assert "--steps" in capsys.readouterr().err
    (blocker := tmp_path / "file").write_text("")
    assert main(["demo", "--prompts-file", str(prompts_file), "--out", str(blocker)]) == 2
    assert "--out" in capsys.readouterr().err
    assert main(["demo", "--prompts-file", str(tmp_path / "absent.jsonl")]) == 2
    assert "absent.jsonl" in capsys.readouterr().err


@pytest.mark.slow
def test_the_demo_end_to_end(prompts_file, tmp_path):  # noqa: F811
    """Two real runtimes, a real Prometheus (when installed), the analysis, the autoscaler, the report and
    charts. An untrained candidate with one draft per step keeps it short: aborted on acceptance length."""
    out = tmp_path / "demo"
    command = [*specserve_command(), "demo", "--prompts-file", str(prompts_file), "--out", str(out), "--json",
               "--candidate", "method=dflash,draftModel=random,numSpeculativeTokens=1",
               "--min-acceptance-length", "1.2", "--steps", "50,100", "--timeout-seconds", "240",
               "--interval-seconds", "30",  # 100 tokens per window from each runtime even on a busy machine
               "--slo-p99-itl-ms", "5000"]  # the acceptance gate decides, not a latency SLO on a shared CPU
    process = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert process.returncode == 0, process.stderr[-3000:]
    result = json.loads(process.stdout.strip().splitlines()[-1])
    assert result == json.loads((out / "report.json").read_text())
    assert result["decision"] == "Aborted" and "acceptanceLength" in result["reason"]
    assert result["revisions"]["stable"]["acceptanceLength"] > 1.2 > result["revisions"]["candidate"]["acceptanceLength"]
    assert result["revisions"]["candidate"]["tokensPerDollar"] > 0
    assert result["autoscaler"]["replicas"] >= 2 and "demand" in result["autoscaler"]["reason"]
    assert "autoscaler:" in process.stderr
    assert len(result["charts"]) == 3 and all(Path(p).read_bytes()[:8] == PNG for p in result["charts"])
