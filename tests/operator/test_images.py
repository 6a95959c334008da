"""The Dockerfile: hadolint-clean, and in agreement with what the operator and the chart expect of
its images (names, tags, user, drafter folder, command). No Docker engine runs here, so the images
are checked by reading the Dockerfile, not by building it."""

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import yaml
from specserve_operator import api
from specserve_operator.render import RUNTIME_UID, render_all
from specserve_operator.validate import parse_profile, parse_serving
from specserve_runtime.config import BUNDLED_DRAFTERS, BUNDLED_DRAFTERS_DIR, local_reference
from specserve_runtime.drafters import DEFAULT_DRAFTERS

HADOLINT = Path(sys.executable).parent / "hadolint"
WEIGHTS = "runtime/specserve_runtime/drafters/weights/"


def stages() -> dict[str, list[str]]:
    """Stage name -> its instructions (continuation lines joined), from the Dockerfile."""
    text = re.sub(r"\\\n\s*", " ", Path("Dockerfile").read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    found, current = {"": []}, ""
    for line in lines:
        if line.startswith("FROM "):
            current = line.split(" AS ")[1]
            found[current] = []
        found[current].append(line)
    return found


def instructions(stage: list[str], keyword: str) -> list[str]:
    return [line.removeprefix(keyword + " ") for line in stage if line.startswith(keyword + " ")]


def version() -> str:
    return tomllib.loads(Path("pyproject.toml").read_text())["project"]["version"]


def test_hadolint_finds_nothing():
    # .hadolint.yaml (read from the working directory) fails on every level, style included.
    result = subprocess.run([str(HADOLINT), "Dockerfile"], check=False, capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout == "", result.stdout + result.stderr


def test_bases_are_pinned_to_exact_tags():
    bases = [line.split()[1] for stage in stages().values() for line in stage if line.startswith("FROM ")]
    assert len(bases) == 5
    for image in bases:
        assert re.fullmatch(r"[\w./-]+:v?\d+\.\d+\.\d+[\w.-]*|[\w./-]+@sha256:[0-9a-f]{64}", image), image


def test_final_stages_run_as_the_non_root_user_the_pods_run_as():
    chart = Path("charts/specserve/templates/operator.yaml").read_text()
    assert f"runAsUser: {RUNTIME_UID}" in chart
    for target in ("runtime", "runtime-cpu", "operator"):
        stage = stages()[target]
        assert instructions(stage, "USER")[-1] == str(RUNTIME_UID), target
        assert instructions(stage, "ENTRYPOINT") == ['["specserve"]'], target
        # Nothing compiles in a final stage: the wheel comes from the build stage.
        assert not any(tool in line for line in instructions(stage, "RUN") for tool in ("apt-get", "gcc", "pip wheel"))


def test_the_cpu_image_ships_the_kernels_blockquant_would_build_and_looks_for_them_where_they_are():
    from specserve_runtime import blockquant

    kernels, runtime_cpu = stages()["kernels"], stages()["runtime-cpu"]
    files = [f"runtime/specserve_runtime/{name}" for name in ("kernels.h", "blockquant.c", "attention.c", "decoder.c")]
    assert instructions(kernels, "COPY") == [f"{' '.join(files)} /src/"]
    assert [path.resolve() for path in (blockquant.HEADER, *blockquant.SOURCES)] == [Path(f).resolve() for f in files]
    hashed, built = "/src/kernels.h /src/blockquant.c /src/attention.c /src/decoder.c", "/src/blockquant.c /src/attention.c /src/decoder.c"
    name = f'"/kernels/blockquant-$(cat {hashed} | sha256sum | cut -c1-16).so"'  # blockquant.library_name()
    assert instructions(kernels, "RUN") == [f"mkdir /kernels && gcc {' '.join(blockquant.CFLAGS)} -o {name} {built}"]
    digest = subprocess.run(["sha256sum"], input=b"".join(Path(f).read_bytes() for f in files),
                            capture_output=True, check=True).stdout.decode()[:16]
    assert blockquant.library_name() == f"blockquant-{digest}.so"
    assert "--from=kernels /kernels/ /opt/specserve/kernels/" in instructions(runtime_cpu, "COPY")
    assert "SPECSERVE_KERNELS=/opt/specserve/kernels" in instructions(runtime_cpu, "ENV")[-1].split()


def test_image_names_and_tags_agree_with_the_operator_and_the_chart():
    makefile = Path("Makefile").read_text()
    registry = re.search(r"^REGISTRY \?= (\S+)$", makefile, re.MULTILINE).group(1)
    built = re.search(r"for target in ([\w -]+); do", makefile).group(1).split()
    assert set(built) == {"runtime", "runtime-cpu", "operator"} <= set(stages())
    assert api.RELEASE == version() == yaml.safe_load(Path("charts/specserve/Chart.yaml").read_text())["appVersion"]
    for target in built:
        assert f"SPECSERVE_VERSION={version()}" in instructions(stages()[target], "ARG")
    assert api.RUNTIME_IMAGES == {"vllm": f"{registry}/runtime:{version()}", "embedded": f"{registry}/runtime-cpu:{version()}"}
    assert yaml.safe_load(Path("charts/specserve/values.yaml").read_text())["image"] == f"{registry}/operator:{version()}"
    # The operator image installs the `operator` extra: no torch in it.
    extras = tomllib.loads(Path("pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert "specserve[operator]" in " ".join(instructions(stages()["operator"], "RUN"))
    assert not any("torch" in requirement for requirement in extras["operator"])


def test_the_runtime_finds_the_bundled_drafters_where_the_rendered_config_points(example_documents):
    """The operator renders `draftModel: bundled://NAME` as written; the runtime resolves it to the wheel's package
    data, which both runtime images install (no copy of their own to keep in step)."""
    assert sorted(path.name for path in BUNDLED_DRAFTERS_DIR.iterdir() if path.is_dir()) == sorted(BUNDLED_DRAFTERS)
    assert {path.name for path in DEFAULT_DRAFTERS.values()} <= set(BUNDLED_DRAFTERS)
    package_data = tomllib.loads(Path("pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "drafters/weights/*/*" in package_data["specserve_runtime"]
    for target in ("runtime", "runtime-cpu"):
        assert any("/wheels/specserve-" in line for line in instructions(stages()[target], "RUN")), target
        assert not any(WEIGHTS in line for line in instructions(stages()[target], "COPY")), target

    by_kind = {d["kind"]: d for d in example_documents}
    for name in BUNDLED_DRAFTERS:
        method = name.rsplit("-", 1)[1]
        for engine in ("vllm", "embedded"):
            doc = {**by_kind["SpeculativeServing"]}
            doc["spec"] = {**doc["spec"], "speculator": {"method": method, "draftModel": f"bundled://{name}"},
                           "runtime": {"engine": engine}, "rollout": None}
            serving, problems = parse_serving(doc)
            profile, _ = parse_profile(by_kind["ServingProfile"])
            assert problems == []
            objects = render_all(serving, profile)
            config = yaml.safe_load(next(o for o in objects if o["kind"] == "ConfigMap")["data"]["runtime.yaml"])
            container = next(o for o in objects if o["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][0]
            assert config["drafter"] == f"bundled://{name}"
            assert Path(local_reference(config["drafter"]), "config.json").is_file()
            assert Path(local_reference(config["drafter"])).resolve() == Path(WEIGHTS, name).resolve()
            target = {"vllm": "runtime", "embedded": "runtime-cpu"}[engine]
            assert container["image"] == api.RUNTIME_IMAGES[engine]
            # The image's own command is the one the operator renders: the image runs the same way alone.
            assert instructions(stages()[target], "CMD") == [json.dumps(container["args"])]


def test_the_build_context_keeps_what_the_dockerfile_copies_and_leaves_out_the_rest():
    # .dockerignore entries are plain paths here (no patterns that need Docker's matcher to read).
    ignored = [line for line in Path(".dockerignore").read_text().splitlines() if line and not line.startswith("#")]
    sources = [source.rstrip("/") for stage in stages().values() for line in instructions(stage, "COPY")
               if not line.startswith("--from=")  # another stage's files, not the context's
               for source in line.split()[:-1]]  # the last word is the destination
    assert "runtime" in sources and "operator" in sources
    for source in sources:
        assert not any(source == entry or source.startswith(entry + "/") for entry in ignored), source
        assert Path(source).exists(), source
    # Environments, history and outputs never reach the daemon.
    assert {".git", ".venv", "specserve-demo"} <= set(ignored)


def test_the_runtime_images_command_needs_neither_the_kubernetes_client_nor_kopf_nor_torch_for_vllm(tmp_path):
    """The vLLM image installs the wheel alone (vLLM's own environment: pydantic, yaml, prometheus_client), the CPU
    image `specserve[runtime]`: `specserve launch` of a vLLM revision must not import what neither has."""
    config = tmp_path / "runtime.yaml"
    config.write_text("model: m\nservedName: m\nengine: vllm\nmethod: dflash\ndrafter: bundled://smollm2-135m-instruct-dflash\n")
    code = ("import sys\n"
            "for name in ('kubernetes', 'kopf', 'torch', 'transformers', 'aiohttp'): sys.modules[name] = None\n"
            "from specserve.cli import main\n"
            f"sys.exit(main(['launch', '--config', {str(config)!r}, '--dry-run']))\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", "SPECSERVE_VLLM": ""})
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("vllm serve --model m ")
