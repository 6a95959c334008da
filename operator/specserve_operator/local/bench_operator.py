"""`specserve bench-operator`: reconcile many SpeculativeServings against KMock; report wall time and
API requests per resource. A benchmark, not a test: it prints numbers and asserts nothing.

Needs the test extras (kmock): `make test` installs them.
"""

import asyncio
import collections
import copy
import logging
import os
import time
import uuid

from specserve_runtime.cmdline import UsageError

NAMESPACE = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "bench", "labels": {"tenant": "bench"}}}
PROFILE = {
    "apiVersion": "specserve.io/v1alpha1", "kind": "ServingProfile", "metadata": {"name": "bench", "resourceVersion": "1"},
    "spec": {"tenant": "bench", "namespaceSelector": {"matchLabels": {"tenant": "bench"}},
             "accelerator": {"count": 1, "pricePerHourUSD": 2.0}, "limits": {"maxReplicas": 8}},
}
SERVING = {
    "apiVersion": "specserve.io/v1alpha1", "kind": "SpeculativeServing",
    "metadata": {"namespace": "bench", "resourceVersion": "1"},
    "spec": {"profile": "bench", "model": {"name": "Qwen/Qwen3-8B", "uri": "hf://Qwen/Qwen3-8B", "servedName": "qwen3-8b"},
             "speculator": {"method": "ngram", "numSpeculativeTokens": 4}, "replicas": {"min": 1, "max": 2}},
}


async def _run(count: int) -> dict:
    import kmock
    import kopf
    from kmock._internal.apps import Server
    from kubernetes import client as k8s

    from .. import main  # noqa: F401  (registers the handlers)
    from ..apply import Cluster

    async with kmock.KubernetesEmulator() as emulator, Server(emulator):
        emulator.resources.load_bundled()
        verbs = {"list", "watch", "get", "patch", "create", "delete"}
        for plural, kind, namespaced in (("speculativeservings", "SpeculativeServing", True),
                                         ("servingprofiles", "ServingProfile", False)):
            emulator.resources[f"specserve.io/v1alpha1/{plural}"] = kmock.ResourceInfo(
                kind=kind, namespaced=namespaced, verbs=verbs, subresources={"status"})
        emulator["get /api/v1/namespaces/bench"] << NAMESPACE
        url = str(emulator.url).rstrip("/")

        @kopf.on.login()
        def login(**_):
            return kopf.ConnectionInfo(server=url, token="bench", insecure=True)

        configuration = k8s.Configuration(host=url)
        configuration.api_key = {"BearerToken": "bench"}
        cluster = Cluster(k8s.ApiClient(configuration))
        stop, ready = asyncio.Event(), asyncio.Event()
        logging.getLogger("kopf").setLevel(logging.ERROR)
        operator = asyncio.create_task(kopf.operator(standalone=True, clusterwide=True, stop_flag=stop, ready_flag=ready,
                                                     memo=kopf.Memo(cluster=cluster)))
        await ready.wait()
        await asyncio.to_thread(cluster._call, "POST", "/apis/specserve.io/v1alpha1/servingprofiles", PROFILE)
        before = len(list(emulator))
        started = time.perf_counter()
        for index in range(count):
            serving = copy.deepcopy(SERVING)
            serving["metadata"].update(name=f"serving-{index:04d}", uid=str(uuid.uuid4()))
            await asyncio.to_thread(cluster._call, "POST", "/apis/specserve.io/v1alpha1/namespaces/bench/speculativeservings", serving)
        while True:
            done = sum(1 for k, obj in emulator.objects.items()
                       if k[0].plural == "speculativeservings" and (obj.get("status") or {}).get("phase"))
            if done >= count:
                break
            await asyncio.sleep(0.2)
        seconds = time.perf_counter() - started
        by_kind = collections.Counter(
            f"{r.method.name} {r.resource.plural}" for r in list(emulator)[before:] if r.resource and r.resource.plural
        )
        stop.set()
        try:
            await asyncio.wait_for(operator, 30)
        except (asyncio.CancelledError, asyncio.TimeoutError):
            pass
        total = sum(by_kind.values())
        return {"servings": count, "seconds": round(seconds, 2), "api_requests": total,
                "requests_per_serving": round(total / count, 2), "by_call": dict(by_kind.most_common())}


def run(count: int) -> dict:
    os.environ.setdefault("SPECSERVE_RESYNC_SECONDS", "3600")  # measure reconciliation, not periodic resyncs
    return asyncio.run(_run(count))


def report(result: dict) -> str:
    lines = [f"reconciled {result['servings']} SpeculativeServings in {result['seconds']} s "
             f"({result['servings'] / result['seconds']:.1f}/s); {result['api_requests']} API requests, "
             f"{result['requests_per_serving']} per serving", "", "| call | requests | per serving |", "|---|---|---|"]
    for call, n in result["by_call"].items():
        lines.append(f"| {call} | {n} | {n / result['servings']:.2f} |")
    return "\n".join(lines)


def cmd_bench_operator(args) -> int:
    if args.servings < 1:
        raise UsageError(f"--servings {args.servings}: must be at least 1")
    print(report(run(args.servings)))
    return 0


def add_commands(commands) -> None:
    bench = commands.add_parser("bench-operator", help="reconcile N SpeculativeServings against KMock; time and API calls")
    bench.add_argument("--servings", type=int, default=500)
    bench.set_defaults(run=cmd_bench_operator)
