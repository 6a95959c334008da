"""Fixtures: example resources, and the operator running in the test's loop against KMock."""

import asyncio
import collections
import contextlib
import os
import copy
import logging
import threading

# Resync often in tests: the timers are what notice Deployments becoming ready and analyses falling due.
os.environ.setdefault("SPECSERVE_RESYNC_SECONDS", "0.3")
os.environ.setdefault("SPECSERVE_DECISION_TICK_SECONDS", "0.2")

import kmock  # noqa: E402
import kopf  # noqa: E402
import pytest
import yaml
from kubernetes import client as k8s

EXAMPLE = "docs/examples/team-a.yaml"

NAMESPACE = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "team-a", "labels": {"specserve.io/tenant": "team-a"}}}
PROFILE = {
    "apiVersion": "specserve.io/v1alpha1",
    "kind": "ServingProfile",
    "metadata": {"name": "team-a-h100"},
    "spec": {
        "tenant": "team-a",
        "namespaceSelector": {"matchLabels": {"specserve.io/tenant": "team-a"}},
        "accelerator": {"resourceName": "nvidia.com/gpu", "count": 1, "pricePerHourUSD": 2.5},
        "limits": {"maxReplicas": 4, "allowedMethods": ["none", "ngram", "eagle3", "dflash"]},
    },
}
SERVING = {
    "apiVersion": "specserve.io/v1alpha1",
    "kind": "SpeculativeServing",
    "metadata": {"name": "qwen3-8b", "namespace": "team-a"},
    "spec": {
        "profile": "team-a-h100",
        "model": {"name": "Qwen/Qwen3-8B", "uri": "hf://Qwen/Qwen3-8B", "servedName": "qwen3-8b"},
        "speculator": {"method": "eagle3", "draftModel": "hf://RedHatAI/Qwen3-8B-speculator.eagle3", "numSpeculativeTokens": 7},
        "replicas": {"min": 2, "max": 4},
    },
}


@pytest.fixture
def example_documents():
    with open(EXAMPLE) as f:
        return [d for d in yaml.safe_load_all(f) if d]


@pytest.fixture
def serving():
    return copy.deepcopy(SERVING)


@pytest.fixture
def profile():
    return copy.deepcopy(PROFILE)


SERVINGS_RESOURCE = "specserve.io/v1alpha1/speculativeservings"
PROFILES_RESOURCE = "specserve.io/v1alpha1/servingprofiles"


@pytest.fixture
def emulator(kmock, tmp_path, monkeypatch):
    """KMock with the built-in kinds, our CRDs, the Gateway API route, and a kubeconfig pointing at it."""
    kmock.resources.load_bundled()
    verbs = {"list", "watch", "get", "patch", "create", "delete"}
    kmock.resources[SERVINGS_RESOURCE] = kmock_info("SpeculativeServing", True, verbs, {"status"})
    kmock.resources[PROFILES_RESOURCE] = kmock_info("ServingProfile", False, verbs, {"status"})
    kmock.resources["gateway.networking.k8s.io/v1/httproutes"] = kmock_info("HTTPRoute", True, verbs, set())
    # KMock 0.8 parses /api/v1/namespaces/<name> as a namespace prefix, not as a Namespace: serve it directly.
    kmock["get /api/v1/namespaces/team-a"] << NAMESPACE
    # ... and fails on the Namespace list itself (/api/v1/namespaces, which kopf lists and watches when it serves
    # named namespaces): read it as the list, of the Namespace the emulator holds.
    from kmock._internal import parsing

    parse_path = parsing.parse_path
    monkeypatch.setattr(parsing, "parse_path", lambda path: parsing.ParsedPath("", "v1", "namespaces")
                        if path.strip("/") == "api/v1/namespaces" else parse_path(path))
    kmock.objects["v1/namespaces", None, "team-a"] = NAMESPACE
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "kmock", "cluster": {"server": str(kmock.url).rstrip("/")}}],
                "users": [{"name": "test", "user": {"token": "test-token"}}],
                "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "test"}}],
                "current-context": "kmock",
            }
        )
    )
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    return kmock


def kmock_info(kind, namespaced, verbs, subresources):
    return kmock.ResourceInfo(kind=kind, namespaced=namespaced, verbs=verbs, subresources=subresources)


def cluster_client(emulator):
    """Our own API client (apply.py's), configured from the test kubeconfig."""
    from kubernetes import config as k8s_config

    from specserve_operator.apply import Cluster

    configuration = k8s.Configuration()
    configuration.retries = 0  # fail fast once a test's emulator is gone
    k8s_config.load_kube_config(config_file=os.environ["KUBECONFIG"], client_configuration=configuration)
    configuration.retries = 0
    return Cluster(k8s.ApiClient(configuration))


_CURRENT_SERVER: dict[str, str] = {}


@kopf.on.login()
def login_to_kmock(**_):
    """kopf's built-in login reads the kubeconfig path fixed at import time; point it at this test's KMock."""
    return kopf.ConnectionInfo(server=_CURRENT_SERVER["url"], token="test-token", insecure=True)


@contextlib.asynccontextmanager
async def running_operator(emulator, namespaces: list[str] | None = None, **memo):
    """The real kopf operator (our handlers) in the test's event loop, stopped on exit: watching every namespace, or
    only `namespaces` (the chart's allNamespaces: false). `memo` entries replace the operator's own (`source` of
    measurements, `clock`)."""
    import specserve_operator.main  # noqa: F401  (registers the handlers)

    _CURRENT_SERVER["url"] = str(emulator.url).rstrip("/")
    stop, ready = asyncio.Event(), asyncio.Event()
    settings = kopf.OperatorSettings()
    settings.networking.request_timeout = 5
    logging.getLogger("kopf").setLevel(logging.WARNING)
    task = asyncio.create_task(
        kopf.operator(
            standalone=True, clusterwide=namespaces is None, namespaces=namespaces or [], stop_flag=stop, ready_flag=ready,
            memo=kopf.Memo(cluster=cluster_client(emulator), **memo), settings=settings,
        )
    )
    await asyncio.wait_for(ready.wait(), 10)
    try:
        yield emulator
    finally:
        stop.set()
        with contextlib.suppress(asyncio.CancelledError):  # kopf ends its root task by cancelling it
            await asyncio.wait_for(task, 20)


@pytest.fixture
async def operator(emulator):
    async with running_operator(emulator):
        yield emulator


async def eventually(check, timeout=10.0, interval=0.05):
    """Wait until check() returns a truthy value (the operator works asynchronously)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        try:
            result = check()
            if result:
                return result
        except (KeyError, AssertionError, TypeError):
            pass
        if asyncio.get_running_loop().time() > deadline:
            return check()
        await asyncio.sleep(interval)


class Reconciles:
    """Counts the operator's reconcile passes per serving, so that a check that something did not happen waits
    for passes that could have done it, not for a guessed time."""

    def __init__(self, monkeypatch):
        import specserve_operator.main as main

        self.started, self.finished = collections.Counter(), collections.Counter()
        lock, blocking = threading.Lock(), main._reconcile_blocking

        def counted(namespace, name, *args, **kwargs):
            with lock:
                self.started[name] += 1
            try:
                return blocking(namespace, name, *args, **kwargs)
            finally:
                with lock:
                    self.finished[name] += 1

        monkeypatch.setattr(main, "_reconcile_blocking", counted)  # the handlers look it up at each call

    async def more(self, count: int = 3, name: str = "qwen3-8b") -> None:
        """Until `count` passes over `name` that start from now on have finished (those already started are at
        most `started`, so finishes beyond it are of later passes)."""
        target = self.started[name] + count
        assert await eventually(lambda: self.finished[name] >= target, timeout=30), f"{self.finished[name]} of {target}"

    async def running(self, name: str = "qwen3-8b") -> None:
        """Until a pass over `name` is in flight."""
        assert await eventually(lambda: self.started[name] > self.finished[name], timeout=30), "no pass started"

    async def idle(self, name: str = "qwen3-8b") -> None:
        """Until every pass over `name` that started has finished."""
        assert await eventually(lambda: self.finished[name] == self.started[name], timeout=30), "a pass never ended"


@pytest.fixture
def reconciles(monkeypatch):
    return Reconciles(monkeypatch)
