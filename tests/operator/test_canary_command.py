"""`specserve canary`: input checks (fast), and end to end against two real runtimes and a real Prometheus (slow)."""

import datetime
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specserve_operator.local import canary, canary_plan
from specserve.cli import main

# Varied (math, code, advice), and each one the bundled EAGLE-3 drafter drafts well for (acceptance length
# 1.4 to 2.5 at 48 tokens), so that every 15 s window of its canary clears the 1.2 gate.
PROMPTS = [
    "Natalia sold 48 clips in April and half as many in May. How many clips did she sell altogether?",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Give three tips for staying focused while studying.",
    "Write a Python function that checks whether a string is a palindrome.",
    "Tom has 3 boxes with 12 apples each. He gives away 10 apples. How many apples are left?",
    "A train travels 60 km in 45 minutes. What is its average speed in km/h?",
]


@pytest.fixture
def prompts_file(tmp_path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return path


@pytest.fixture
def nothing_starts(monkeypatch):
    """Bad input must be refused before any process starts."""

    def refuse(*args, **kwargs):
        raise AssertionError("a process was started for bad input")

    monkeypatch.setattr(canary, "spawn", refuse)


def run_cli(capsys, prompts_file, *extra, stable="method=none", candidate="method=dflash,draftModel=random"):
    code = main(["canary", "--stable", stable, "--candidate", candidate, "--prompts-file", str(prompts_file), *extra])
    return code, capsys.readouterr()


# ---- fast: input ---------------------------------------------------------------------------


@pytest.mark.parametrize("candidate, field", [
    ("method=dflash,blockSize=4", "blockSize"),
    ("method=medusa", "method"),
    ("draftModel=random", "method"),
    ("method=dflash,numSpeculativeTokens=two", "numSpeculativeTokens"),
    ("method=dflash,numSpeculativeTokens=0", "numSpeculativeTokens"),
    ("method=dflash,numSpeculativeTokens=2.5", "numSpeculativeTokens"),
    ("method=dflash,numSpeculativeTokens=65", "numSpeculativeTokens"),  # the API's own bound
    ("method=none,numSpeculativeTokens=2", "numSpeculativeTokens"),
    ("method=eagle3,draftModel=/no/such/drafter", "draftModel"),
    ("method=eagle3,draftModel=", "draftModel"),
    ("method=ngram,draftModel=random", "draftModel"),
    ("method=dflash,draftTree=yes", "draftTree"),
    ("method=ngram,draftTree=true", "draftTree"),  # the API's own rule: a tree needs a drafter model
    ("method=dflash,promptLookup=some", "promptLookup"),
    ("method=dflash,promptLookup=17", "promptLookup"),  # the API's own bound
    ("method=ngram,promptLookup=4", "promptLookup"),  # ... and rule: the branch joins a drafter model's drafts
    ("dflash", "--candidate"),
])
def test_bad_inline_spec_names_the_field(capsys, prompts_file, nothing_starts, candidate, field):
    code, out = run_cli(capsys, prompts_file, candidate=candidate)
    assert code == 2
    assert field in out.err and "--candidate" in out.err
    assert len(out.err.strip().splitlines()) == 1 and out.out == ""


@pytest.mark.parametrize("text, field", [
    ("method: dflash\nnumSpeculativeTokens: true\n", "numSpeculativeTokens"),
    ("method: dflash\ndraftTree: 1\n", "draftTree"),
    ('{"method": "eagle3", "draftModels": "random"}', "draftModels"),
    ("method: [eagle3]\n", "method"),
    ("- method: eagle3\n", "--stable"),
    ("method: eagle3\n  bad: [\n", "--stable"),
])
def test_bad_spec_file_names_the_field(capsys, tmp_path, prompts_file, nothing_starts, text, field):
    spec = tmp_path / "spec.yaml"
    spec.write_text(text)
    code, out = run_cli(capsys, prompts_file, stable=str(spec), candidate="method=eagle3")
    assert code == 2 and field in out.err and "--stable" in out.err


def test_spec_file_and_inline_give_the_same_speculator_and_revision(tmp_path):
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    spec = tmp_path / "candidate.yaml"
    spec.write_text(f"method: dflash\ndraftModel: {drafter}\nnumSpeculativeTokens: 3\n")
    from_file = canary_plan.parse_speculator(str(spec), "--candidate")
    inline = canary_plan.parse_speculator(f"method=dflash,draftModel={drafter},numSpeculativeTokens=3", "--candidate")
    assert from_file == inline == canary.LocalSpeculator("dflash", str(drafter.resolve()), 3)
    config = from_file.runtime_config("SmolLM2-135M-Instruct", 8123, ["--dtype", "float32"])
    assert (config.method, config.drafter, config.num_speculative_tokens, config.engine, config.engine_args,
            config.host, config.port) == ("dflash", str(drafter.resolve()), 3, "embedded", [], "127.0.0.1", 8123)
    assert len(from_file.revision) == 8 and from_file.revision != canary_plan.parse_speculator("method=dflash", "-").revision
    plain = canary_plan.parse_speculator("method=none", "--stable").runtime_config("m", 1, [])
    assert (plain.method, plain.drafter) == ("none", None)
    bundled = canary_plan.parse_speculator("method=eagle3", "--c")
    assert bundled.api_speculator().draft_model == "pvc://local/bundled"
    assert bundled.runtime_config("m", 1, []).drafter == "bundled://smollm2-135m-instruct-eagle3"
    tree = canary_plan.parse_speculator("method=dflash,numSpeculativeTokens=6,draftTree=true", "--candidate")
    assert (tree.runtime_config("m", 1, []).num_speculative_tokens, tree.runtime_config("m", 1, []).draft_tree) == (6, True)
    assert tree.api_speculator().draft_tree is True and tree.revision != canary_plan.parse_speculator(
        "method=dflash,numSpeculativeTokens=6", "-").revision
    assert canary_plan.parse_speculator("method=dflash,draftTree=False", "-").runtime_config("m", 1, []).draft_tree is False
    copies = canary_plan.parse_speculator("method=dflash,promptLookup=4", "--candidate")
    assert copies.runtime_config("m", 1, []).prompt_lookup == 4 and copies.api_speculator().prompt_lookup == 4
    assert copies.revision != canary_plan.parse_speculator("method=dflash", "-").revision
    assert "copies of up to 4" in copies.describe()


def test_a_spec_may_run_on_vllm_as_the_crs_runtime_engine_says(tmp_path):
    on_vllm = canary_plan.parse_speculator("engine=vllm,method=dflash", "--candidate")
    assert on_vllm.engine == "vllm" and "on vllm" in on_vllm.describe()
    assert on_vllm.revision != canary_plan.parse_speculator("method=dflash", "-").revision
    assert canary_plan.parse_speculator("engine=embedded,method=dflash", "-") == canary_plan.parse_speculator("method=dflash", "-")
    config = on_vllm.runtime_config("/models/smol", 8123, ["--dtype", "float32"])
    assert (config.engine, config.engine_args, config.drafter) == ("vllm", ["--dtype", "float32"],
                                                                   "bundled://smollm2-135m-instruct-dflash")
    from specserve_runtime.launch import vllm_command

    command = vllm_command(config, ["vllm", "serve"])  # the bundled folder passes the checks vLLM needs
    assert command[:4] == ["vllm", "serve", "--model", "/models/smol"] and "--speculative-config" in command
    for spec, message in [("engine=vllm,method=dflash,draftTree=true", "draftTree: a draftTree needs runtime.engine"),
                          ("engine=vllm,method=eagle3,promptLookup=4", "promptLookup: a promptLookup branch needs"),
                          ("engine=vllm,method=dflash,draftModel=random", "draftModel: random is an untrained drafter"),
                          ("engine=gpu,method=none", "engine: 'gpu' is neither embedded nor vllm")]:
        with pytest.raises(canary.CanaryError, match=message):
            canary_plan.parse_speculator(spec, "--candidate")


def test_same_speculator_on_both_sides_is_refused(capsys, prompts_file, nothing_starts):
    code, out = run_cli(capsys, prompts_file, stable="method=eagle3", candidate="method=eagle3")
    assert code == 2 and "--candidate" in out.err and "nothing to compare" in out.err


def test_steps_parse_into_the_rollout(capsys, prompts_file):
    args = canary_args(prompts_file, "--steps", "10,50,100", "--interval-seconds", "15", "--step-seconds", "40",
                       "--min-acceptance-length", "1.3", "--max-p99-latency-ratio", "1.1", "--failure-limit", "3",
                       "--slo-p99-itl-ms", "200")
    plan = canary.make_plan(args)
    assert [(s.weight, s.analysis_seconds) for s in plan.rollout.steps] == [(10, 40), (50, 40), (100, 40)]
    analysis = plan.rollout.analysis
    assert (analysis.interval_seconds, analysis.min_acceptance_length, analysis.max_p99_latency_ratio,
            analysis.failure_limit, analysis.max_error_rate) == (15, 1.3, 1.1, 3, 0.01)
    assert plan.slo.p99_inter_token_latency_ms == 200 and plan.rollout.auto_promote
    assert plan.rollout.candidate.speculator.method == "dflash"
    default = canary.make_plan(canary_args(prompts_file))
    assert [(s.weight, s.analysis_seconds) for s in default.rollout.steps] == [(25, 30), (50, 30), (100, 30)]
    assert default.timeout_seconds == canary_plan.default_timeout(default.rollout)


def canary_args(prompts_file, *extra):
    from specserve.cli import build_parser

    return build_parser().parse_args(["canary", "--stable", "method=none",
                                      "--candidate", "method=dflash,draftModel=random",
                                      "--prompts-file", str(prompts_file), *extra])


@pytest.mark.parametrize("flags, field", [
    (["--steps", "50,50"], "--steps"),
    (["--steps", "50,25,100"], "--steps"),
    (["--steps", "0,50"], "--steps"),
    (["--steps", "50,101"], "--steps"),
    (["--steps", "25,half"], "--steps"),
    (["--steps", ""], "--steps"),
    (["--interval-seconds", "5"], "--interval-seconds"),
    (["--interval-seconds", "ten"], "--interval-seconds"),
    (["--min-acceptance-length", "0.5"], "--min-acceptance-length"),
    (["--max-p99-latency-ratio", "0"], "--max-p99-latency-ratio"),
    (["--max-error-rate", "1.5"], "--max-error-rate"),
    (["--failure-limit", "0"], "--failure-limit"),
    (["--step-seconds", "-1"], "--step-seconds"),
    (["--slo-p99-itl-ms", "0"], "--slo-p99-itl-ms"),
    (["--concurrency", "0"], "--concurrency"),
    (["--concurrency", "1000"], "--concurrency"),
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--price-per-hour", "0"], "--price-per-hour"),
    (["--timeout-seconds", "0"], "--timeout-seconds"),
])
def test_bad_flags_name_the_flag(capsys, prompts_file, nothing_starts, flags, field):
    code, out = run_cli(capsys, prompts_file, *flags)
    assert code == 2 and field in out.err, out.err
    assert len(out.err.strip().splitlines()) == 1


def test_bad_prompts_file_is_refused(capsys, tmp_path, nothing_starts):
    code, out = run_cli(capsys, tmp_path / "missing.jsonl")
    assert code == 2 and "--prompts-file" in out.err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt field"}\n')
    code, out = run_cli(capsys, bad)
    assert code == 2 and "prompt" in out.err


def test_prometheus_scrapes_each_revision_with_the_labels_the_operator_selects_on():
    config = canary.prometheus_config({"aaaa1111": 8001, "bbbb2222": 8002})
    assert config["global"]["scrape_interval"] == "1s"
    assert config["scrape_configs"][0]["static_configs"] == [
        {"targets": ["127.0.0.1:8001"], "labels": {"serving": "canary", "revision": "aaaa1111"}},
        {"targets": ["127.0.0.1:8002"], "labels": {"serving": "canary", "revision": "bbbb2222"}},
    ]


def test_the_command_does_not_import_torch(tmp_path, prompts_file):
    """The operator's image has no torch: parsing, validation and the help must not need it."""
    code = (
        "import sys\n"
        "from specserve.cli import main\n"
        "rc = main(['canary', '--stable', 'method=none', '--candidate', 'method=bogus',\n"
        f"           '--prompts-file', {str(prompts_file)!r}])\n"
        "assert rc == 2, rc\n"
        "assert 'torch' not in sys.modules\n"
        "import specserve_operator.local.canary, specserve_operator.measure, specserve_operator.analysis\n"
        "import specserve_operator.rollout\n"
        "assert 'torch' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, timeout=60)


# ---- fast: the loop, with the operator's decision code and a clock that jumps -------------


class JumpingClock:
    def __init__(self):
        self.t = 0.0

    def monotonic(self):
        return self.t

    def now(self):
        return datetime.datetime(2026, 11, 23, 10, 0, tzinfo=datetime.timezone.utc) + datetime.timedelta(seconds=self.t)

    def sleep(self, seconds):
        self.t += max(seconds, 0.001)


class FixedSource:
    """Every window of a revision the same numbers; or MeasurementError when `fail`."""

    def __init__(self, acceptance: float, fail: bool = False):
        self.acceptance, self.fail, self.calls = acceptance, fail, []

    def measure(self, target, seconds):
        from specserve_operator.measure import MeasurementError, Window

        self.calls.append((target.revision, seconds))
        if self.fail:
            raise MeasurementError("cannot reach Prometheus at http://127.0.0.1:1/api/v1/query: refused")
        candidate = target.revision == "cand"
        return Window(target.revision, seconds, 1, tokens_per_second=20.0, generated_tokens=20.0 * seconds,
                      p99_inter_token_latency_ms=100.0, acceptance_length=self.acceptance if candidate else None,
                      finished_requests=3, error_rate=0.0, in_flight_per_replica=1.0)


def loop(prompts_file, source, *flags, seconds_left=600):
    from specserve_operator.measure import Target

    plan = canary.make_plan(canary_args(prompts_file, "--interval-seconds", "10", "--steps", "50,100",
                                        "--min-acceptance-length", "1.2", *flags))
    targets = [Target(None, "canary", "stab", 1), Target(None, "canary", "cand", 1)]
    analyses = []
    clock = JumpingClock()
    try:
        stage, why = canary.rollout_loop(plan, source, targets, seconds_left, analyses, clock)
    except canary.TimedOut as exc:
        stage, why = "Inconclusive", str(exc)
    return stage, why, analyses, clock.t


def test_the_loop_promotes_through_every_step(prompts_file, capsys):
    source = FixedSource(acceptance=1.6)
    stage, why, analyses, seconds = loop(prompts_file, source)
    assert stage == "Promoted" and "all 2 steps passed" in why
    assert [(a["step"], a["weight"], a["verdict"]) for a in analyses] == [(0, 50, "Pass"), (1, 100, "Pass")]
    assert 20 <= seconds <= 23  # one 10 s interval per step
    assert source.calls == [("stab", 10), ("cand", 10)] * 2
    assert analyses[0]["candidate"]["tokens_per_dollar"] == 20.0 * 3600  # priced at --price-per-hour 1.0
    err = capsys.readouterr().err
    assert "RolloutStarted" in err and "StepAdvanced" in err and err.count("all gates pass") == 2


def test_the_loop_aborts_after_failure_limit_fails(prompts_file):
    stage, why, analyses, _ = loop(prompts_file, FixedSource(acceptance=1.0), "--failure-limit", "3")
    assert stage == "Aborted" and "failed 3 times" in why
    assert [a["verdict"] for a in analyses] == ["Fail"] * 3
    assert all("acceptanceLength: Fail (1 < 1.2)" in a["reasons"] for a in analyses)


def test_a_measurement_error_is_an_interval_with_no_data(prompts_file, capsys):
    stage, why, analyses, seconds = loop(prompts_file, FixedSource(1.6, fail=True), seconds_left=45)
    assert stage == "Inconclusive" and "--timeout-seconds" in why and 45 <= seconds < 47
    assert [a["verdict"] for a in analyses] == ["Inconclusive"] * 4
    assert "measurement failed" in analyses[0]["candidate"]["missing"]
    assert "measurement failed, this interval has no data" in capsys.readouterr().err


# ---- slow: end to end ----------------------------------------------------------------------


def specserve_command() -> list[str]:
    binary = Path(sys.executable).parent / "specserve"
    return [str(binary)] if binary.exists() else [sys.executable, "-m", "specserve.cli"]


def refuses_connections(url: str) -> bool:
    host, port = url.removeprefix("http://").split(":")
    try:
        with socket.create_connection((host, int(port)), timeout=2):
            return False
    except OSError:
        return True


def processes_mentioning(text: str) -> list[str]:
    """Command lines of live processes containing `text` (the runtimes' and Prometheus' ports)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and entry.name != str(os.getpid()):
            try:
                command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in command:
                found.append(command)
    return found


def assert_all_stopped(result: dict) -> None:
    assert result["urls"]["stable"] and result["urls"]["candidate"]
    for url in result["urls"].values():
        assert refuses_connections(url), f"{url} still accepts connections"
        port = url.rsplit(":", 1)[1]
        assert not processes_mentioning(f"--port {port}") and not processes_mentioning(f"127.0.0.1:{port}")


def run_canary(prompts_file, *flags) -> tuple[dict, str, float]:
    """The real CLI in a subprocess; --timeout-seconds bounds it, and SIGTERM (which it cleans up after) backs that."""
    command = [*specserve_command(), "canary", "--prompts-file", str(prompts_file), "--max-new-tokens", "48", "--json",
               "--timeout-seconds", "200", *flags]
    started = time.monotonic()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = process.communicate(timeout=260)
    except subprocess.TimeoutExpired:
        process.terminate()
        stdout, stderr = process.communicate(timeout=60)
    seconds = time.monotonic() - started
    assert process.returncode == 0, stderr[-3000:]
    lines = stdout.strip().splitlines()
    assert len(lines) == 1, stdout  # with --json, the JSON object is the only line
    return json.loads(lines[-1]), stderr, seconds


# Debian's prometheus package (`make test` installs it); without it the command scrapes /metrics directly.
HAVE_PROMETHEUS = shutil.which("prometheus") is not None


@pytest.mark.slow
def test_an_untrained_drafter_is_aborted_with_no_gate_named(prompts_file):
    """No gate flags: the CRD's defaults (for a speculating candidate an acceptance floor of 1.2) decide."""
    failure_limit = 2
    # One draft per step and 40 s windows: on a shared 2-core CPU the untrained drafter's verify cost (seven
    # drafts by default) leaves fewer than analysis.MIN_GENERATED_TOKENS per 10 s window, every analysis
    # Inconclusive; on the slower (AVX2) CPU it makes ~5 tokens/s even with one draft, so 20 s windows held
    # 91-98 tokens, just under the minimum. One random draft is (almost) never accepted: acceptance ~1.0.
    result, stderr, seconds = run_canary(
        prompts_file, "--stable", "method=none",
        "--candidate", "method=dflash,draftModel=random,numSpeculativeTokens=1",
        "--failure-limit", str(failure_limit), "--interval-seconds", "40", "--steps", "50,100")
    print(stderr, f"\n{seconds:.0f} s")
    assert result["decision"] == "Aborted", stderr[-3000:]
    assert result["prometheus"] is HAVE_PROMETHEUS
    verdicts = [a["verdict"] for a in result["analyses"]]
    assert verdicts.count("Fail") == failure_limit and verdicts[-1] == "Fail"
    # Inconclusive intervals (too few tokens while the machine is busy) hold; they neither pass nor fail.
    assert verdicts.count("Pass") == 0 and verdicts.count("Inconclusive") <= 4, verdicts
    for analysis in result["analyses"]:
        assert analysis["step"] == 0 and analysis["weight"] == 50  # it never left the first step
        if analysis["verdict"] == "Fail":
            assert analysis["candidate"]["acceptance_length"] < 1.2
            assert any(r.startswith("acceptanceLength: Fail") for r in analysis["reasons"])
            assert analysis["stable"]["acceptance_length"] is None  # plain decoding drafts nothing
    assert "analysis failed 2 times" in result["reason"]
    assert result["steps"] == [{"weight": 50, "analysisSeconds": 40}, {"weight": 100, "analysisSeconds": 40}]
    assert_all_stopped(result)


@pytest.mark.slow
def test_the_trained_eagle3_drafter_is_promoted(prompts_file):
    result, stderr, seconds = run_canary(
        prompts_file, "--stable", "method=none", "--candidate", "method=eagle3",
        # 30 s windows: a window needs analysis.MIN_GENERATED_TOKENS (100) from each runtime, which a 2-core
        # machine busy with other work (~4 tokens/s per runtime measured) does not reach in 15 s.
        "--steps", "50,100", "--interval-seconds", "30")
    print(stderr, f"\n{seconds:.0f} s")
    assert result["decision"] == "Promoted", stderr[-3000:]
    passed = [a for a in result["analyses"] if a["verdict"] == "Pass"]
    assert [(a["step"], a["weight"]) for a in passed] == [(0, 50), (1, 100)]  # each step passed once, in order
    for analysis in result["analyses"]:
        candidate, stable = analysis["candidate"], analysis["stable"]
        assert analysis["verdict"] != "Fail"
        assert candidate["missing"] or candidate["acceptance_length"] > 1.2
        if analysis["verdict"] == "Pass":
            assert candidate["generated_tokens"] >= 100 and stable["generated_tokens"] >= 100
            assert candidate["tokens_per_dollar"] > 0 and candidate["hourly_cost_usd"] == 1.0
            assert candidate["accepted_per_position"] and stable["acceptance_length"] is None
    assert_all_stopped(result)


@pytest.mark.slow
def test_ctrl_c_stops_every_process(prompts_file, tmp_path):
    log = tmp_path / "stderr.txt"
    with open(log, "w") as err:
        process = subprocess.Popen(
            [*specserve_command(), "canary", "--prompts-file", str(prompts_file), "--json", "--stable", "method=none",
             "--candidate", "method=eagle3", "--interval-seconds", "60", "--max-new-tokens", "48"],
            stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        deadline = time.monotonic() + 120
        while "RolloutStarted" not in log.read_text() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert "RolloutStarted" in log.read_text(), log.read_text()
        process.send_signal(signal.SIGINT)
        stdout, _ = process.communicate(timeout=60)
    finally:
        if process.poll() is None:  # SIGTERM: the command stops what it started (a SIGKILL would orphan it)
            process.terminate()
            process.communicate(timeout=60)
    assert process.returncode == 130, log.read_text()
    result = json.loads(stdout.strip().splitlines()[-1])
    assert result["decision"] == "Inconclusive" and "interrupted" in result["reason"]
    assert set(result["urls"]) == {"stable", "candidate"} | ({"prometheus"} if HAVE_PROMETHEUS else set())
    assert_all_stopped(result)
