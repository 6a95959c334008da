"""The OpenAI-compatible server: the real `openai` client against a live `specserve serve`, bad requests,
bounded concurrency, disconnects, and the vLLM launcher's command lines."""

import asyncio
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from specserve_runtime import cli
from specserve_runtime.commands import serving
from specserve_runtime.config import RuntimeConfig
from specserve_runtime.engine import Request
from specserve_runtime.drafters import DEFAULT_DRAFTERS
from specserve_runtime.launch import speculative_config, vllm_command
from specserve_runtime.loader import build_engine

MODEL = "SmolLM2-135M-Instruct"
QUESTION = "What is the capital of France?"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(base: str, process: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}: {process.stderr.read()}")
        try:
            with urllib.request.urlopen(base + "/ready", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    raise TimeoutError("server not ready")


def specserve_bin() -> str:
    return shutil.which("specserve") or str(Path(sys.executable).parent / "specserve")


@pytest.fixture(scope="module")
def server():
    """`specserve serve` in a subprocess on loopback: DFlash with a random drafter."""
    port = free_port()
    process = subprocess.Popen(
        [specserve_bin(), "serve", "--method", "dflash", "--drafter", "random", "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, process)
        yield base
    finally:
        process.terminate()
        process.wait(timeout=60)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=120)


pytestmark = pytest.mark.slow


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_chat_completion_matches_generate_and_streaming(client, smollm2):
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                           temperature=0, max_tokens=24)
    expected = build_engine(smollm2, "ar").generate(Request(smollm2.encode(QUESTION), 24))
    assert reply.choices[0].message.content == expected.text
    assert reply.choices[0].finish_reason == expected.finish_reason
    assert reply.usage.completion_tokens == len(expected.token_ids)
    assert reply.usage.prompt_tokens == len(smollm2.encode(QUESTION))
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                            temperature=0, max_tokens=24, stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    assert chunks[-1].choices[0].finish_reason == expected.finish_reason


def test_completion_with_stop_string_streams_the_same_text(client):
    kwargs = dict(model=MODEL, prompt="The first five prime numbers are", temperature=0, max_tokens=40, stop=[","])
    whole = client.completions.create(**kwargs)
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs))
    assert whole.choices[0].finish_reason == "stop" and "," not in whole.choices[0].text
    assert streamed == whole.choices[0].text


def test_sampling_with_a_seed_is_reproducible(client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me a story."}], temperature=0.9,
                  top_p=0.9, max_tokens=16, seed=5)
    first = client.chat.completions.create(**kwargs).choices[0].message.content
    assert client.chat.completions.create(**kwargs).choices[0].message.content == first


@pytest.mark.parametrize(
    "payload, status, fragment",
    [
        ({"model": "gpt-4", "prompt": "hi"}, 404, "model 'gpt-4' does not exist"),
        ({"model": MODEL, "prompt": "hi", "max_tokens": -5}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": "hi", "max_tokens": 10**9}, 400, "exceed the context length"),
        ({"model": MODEL, "prompt": "hi", "temperature": "hot"}, 400, "temperature"),
        ({"model": MODEL, "prompt": ""}, 400, "prompt is empty"),
        ({"model": MODEL}, 400, "prompt"),
        ([1, 2, 3], 400, "JSON object"),
        ({"model": MODEL, "prompt": "a\ud800b"}, 400, "prompt: is not valid Unicode text"),
        ({"model": MODEL, "prompt": "hi " * 9000, "max_tokens": None}, 400, "prompt tokens leave no room to generate"),
        ({"model": MODEL, "prompt": "hi", "echo": True}, 400, "echo: the embedded engine does not support it"),
        ({"model": MODEL, "prompt": "hi", "presence_penalty": 0.5}, 400, "presence_penalty: the embedded engine"),
        ({"model": MODEL, "prompt": [1, 2]}, 400, "prompt.0: Input should be a valid string"),
        ({"model": MODEL, "prompt": "hi", "max_tokens": True}, 400, "max_tokens: Input should be a valid integer"),
        ({"model": MODEL, "prompt": "hi", "stream": "yes"}, 400, "stream: Input should be a valid boolean"),
    ],
)
def test_bad_requests_get_openai_errors(server, payload, status, fragment):
    request = urllib.request.Request(server + "/v1/completions", data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=30)
    assert caught.value.code == status
    error = json.loads(caught.value.read())["error"]
    assert fragment in error["message"] and error["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "messages, param",
    [
        ([{"role": "user", "content": "a\udc00"}], "messages.0.content"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "messages.0.content.0.type"),
        ([{"role": "user", "content": "hi " * 9000}], "messages"),
    ],
)
def test_bad_chat_requests_name_the_field(server, messages, param):
    payload = {"model": MODEL, "messages": messages}
    request = urllib.request.Request(server + "/v1/chat/completions", data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=30)
    assert caught.value.code == 400 and json.loads(caught.value.read())["error"]["param"] == param


@pytest.mark.parametrize("body", [b'{"model": ', b'{"model": "x", "prompt": "hi", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"])
def test_malformed_json_is_a_400(server, body):
    request = urllib.request.Request(server + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=30)
    assert caught.value.code == 400 and "malformed JSON" in json.loads(caught.value.read())["error"]["message"]


def test_sixteen_concurrent_streams_all_complete_uncorrupted(client):
    prompts = [f"Count from {i} to {i + 5}." for i in range(4)]
    expected = {p: client.completions.create(model=MODEL, prompt=p, temperature=0, max_tokens=12).choices[0].text
                for p in prompts}

    def stream(prompt):
        chunks = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=12, stream=True)
        return prompt, "".join(c.choices[0].text for c in chunks)

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(stream, [prompts[i % 4] for i in range(16)]))
    assert len(results) == 16
    for prompt, text in results:
        assert text == expected[prompt]


def test_health_ready_and_metrics(server, client):
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], temperature=0, max_tokens=8)
    for path in ("/health", "/ready"):
        with urllib.request.urlopen(server + path, timeout=5) as response:
            assert response.status == 200
    text = urllib.request.urlopen(server + "/metrics", timeout=5).read().decode()
    for name in ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                 "vllm:spec_decode_num_accepted_tokens_total", "vllm:generation_tokens_total",
                 "vllm:prompt_tokens_total", "vllm:request_success_total", "vllm:num_requests_running",
                 "vllm:num_requests_waiting", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:inter_token_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_bucket",
                 "vllm:request_queue_time_seconds_bucket", "specserve_runtime_info"):
        assert name in text, name
    assert 'engine="embedded"' in text and f'model_name="{MODEL}"' in text
    assert 'le="2560.0"' in text  # vLLM's last TTFT bucket boundary


class WrappedEngine:
    """A test double around a real engine: it delegates everything a subclass does not override."""

    def __init__(self, engine):
        self.engine = engine

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def add(self, request, stats=None):
        return self.engine.add(request, stats)

    def step(self, batch):
        return self.engine.step(batch)


class HeldEngine(WrappedEngine):
    """Wraps an engine: once a step has emitted tokens, the next step blocks until `release` is set, so
    the request provably holds its slot for as long as a test needs."""

    def __init__(self, engine):
        super().__init__(engine)
        self.emitted = False
        self.holding = threading.Event()  # the first tokens are out and the engine is blocked
        self.release = threading.Event()

    def step(self, batch):
        if self.emitted and not self.release.is_set():
            self.holding.set()
            assert self.release.wait(timeout=120), "the test never released the engine"
        steps = self.engine.step(batch)
        self.emitted = self.emitted or any(step and step.token_ids for step in steps)
        return steps


class FailingEngine(WrappedEngine):
    """Wraps an engine: its first step after the prefill raises. Later steps run freely."""

    def __init__(self, engine):
        super().__init__(engine)
        self.steps = 0

    def step(self, batch):
        self.steps += 1
        if self.steps == 2:
            raise RuntimeError("the accelerator fell off the bus")
        return self.engine.step(batch)


async def wait_for(condition, what: str, timeout: float = 30) -> None:
    """Bounded polling of a condition set by another thread or task."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def served(server):
    """The server in process on a free port: its /v1/completions URL and a client session; its worker
    stopped afterwards, whatever the test did."""
    import aiohttp
    from aiohttp.test_utils import TestServer

    try:
        async with TestServer(server.app()) as test_server, aiohttp.ClientSession() as session:
            yield str(test_server.make_url("/v1/completions")), session
    finally:
        server.worker.stop()


async def test_full_queue_answers_429_and_disconnect_stops_generation(smollm2):
    """In process, with room for one request: a second concurrent one is refused, and a client that
    goes away mid-stream ends its generation (finished_reason abort) instead of running to max_tokens.
    The engine is held after its first step, so the slot is taken for certain while the second request
    arrives, and the request cannot finish on its own before the disconnect is seen."""

    from specserve_runtime.server.app import Server

    engine = HeldEngine(build_engine(smollm2, "ar"))
    server = Server(lambda: (smollm2, engine), MODEL, "ar", None, max_concurrency=1)
    async with served(server) as (url, session):
        try:
            long_request = {"model": MODEL, "prompt": "Write a long essay about the sea.", "max_tokens": 2000,
                            "temperature": 0, "stream": True}
            response = await session.post(url, json=long_request)
            assert response.status == 200
            assert await asyncio.to_thread(engine.holding.wait, 60), "the first step never came"
            (job,) = server.worker.active  # the only slot, held by the long request
            refused = await session.post(url, json={"model": MODEL, "prompt": "hi", "max_tokens": 4})
            assert refused.status == 429 and refused.headers["Retry-After"] == "1"
            assert (await refused.json())["error"]["type"] == "rate_limit_error"
            response.close()  # the client disconnects
            await wait_for(job.cancelled.is_set, "the server to see the disconnect")
            engine.release.set()  # the engine may go on: the worker must stop at its next step
            assert await asyncio.to_thread(server.worker.idle.wait, 60), "generation kept running after the client left"
            aborted = server.metrics.of(server.metrics.success, finished_reason="abort")._value.get()
            generated = server.metrics.of(server.metrics.generation_tokens)._value.get()
            assert aborted == 1 and generated < 2000
            ok = await session.post(url, json={"model": MODEL, "prompt": "hi", "max_tokens": 4})
            assert ok.status == 200
        finally:
            engine.release.set()


class RecordingEngine(WrappedEngine):
    """Wraps an engine: remembers the draft length each step chose and the threads the steps ran in."""

    def __init__(self, engine):
        super().__init__(engine)
        self.lengths, self.threads = [], set()

    def step(self, batch):
        self.threads.add(threading.get_ident())
        steps = self.engine.step(batch)
        self.lengths.append(self.engine.draft_length)
        return steps


async def test_the_adaptive_draft_lengths_of_every_step_are_counted(smollm2):
    """specserve_spec_decode_draft_length_steps_total counts each step that decoded, by the length
    the adaptive rule chose; a prefill-only step chose nothing and is not counted."""

    from specserve_runtime.drafters import ProposerOptions
    from specserve_runtime.server.app import Server

    engine = RecordingEngine(build_engine(smollm2, "ngram", ProposerOptions(num_speculative_tokens=3), adaptive=True))
    server = Server(lambda: (smollm2, engine), MODEL, "ngram", None, max_concurrency=1)
    metrics = server.metrics
    async with served(server) as (url, session):
        request = {"model": MODEL, "prompt": "Count: one two three, one two three, one two", "max_tokens": 24,
                   "temperature": 0}
        assert (await session.post(url, json=request)).status == 200
        await wait_for(server.worker.idle.is_set, "the request to finish")
    assert engine.lengths[0] is None  # the prompt's step
    chosen = [length for length in engine.lengths if length is not None]
    assert len(chosen) >= 2 and set(chosen) <= {0, 1, 2, 3}
    counted = {length: metrics.of(metrics.draft_length_steps, draft_length=str(length))._value.get() for length in range(4)}
    assert counted == {length: chosen.count(length) for length in range(4)}
    assert metrics.of(metrics.draft_length)._value.get() == chosen[-1]


async def test_engine_failure_is_a_500_counted_as_finished_reason_error(smollm2):
    """An engine that raises mid-request: the client gets an OpenAI-style server error, the failure is
    counted in request_success_total{finished_reason="error"} with its latency, and the worker lives on."""

    from specserve_runtime.server.app import Server

    engine = FailingEngine(build_engine(smollm2, "ar"))
    server = Server(lambda: (smollm2, engine), MODEL, "ar", None, max_concurrency=1)
    metrics = server.metrics
    async with served(server) as (url, session):
        failed = await session.post(url, json={"model": MODEL, "prompt": "hi", "max_tokens": 8, "temperature": 0})
        assert failed.status == 500
        error = (await failed.json())["error"]
        assert error["type"] == "server_error" and "fell off the bus" in error["message"]
        assert metrics.of(metrics.success, finished_reason="error")._value.get() == 1
        assert metrics.registry.get_sample_value("vllm:e2e_request_latency_seconds_count", metrics.labels) == 1
        assert metrics.of(metrics.running)._value.get() == 0
        ok = await session.post(url, json={"model": MODEL, "prompt": "hi", "max_tokens": 4, "temperature": 0})
        assert ok.status == 200
        assert metrics.of(metrics.success, finished_reason="error")._value.get() == 1
        assert metrics.registry.get_sample_value("vllm:e2e_request_latency_seconds_count", metrics.labels) == 2


async def test_a_stream_that_fails_ends_with_an_error_event(smollm2):
    """Once a stream's status line is out, a failure can only be an event: the error, then [DONE]."""

    from specserve_runtime.server.app import Server

    server = Server(lambda: (smollm2, FailingEngine(build_engine(smollm2, "ar"))), MODEL, "ar", None, max_concurrency=1)
    async with served(server) as (url, session):
        response = await session.post(url, json={
            "model": MODEL, "prompt": "hi", "max_tokens": 8, "temperature": 0, "stream": True})
        assert response.status == 200
        events = [line.removeprefix("data: ") for line in (await response.text()).splitlines() if line]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["type"] == "server_error" and "fell off the bus" in error["message"]


async def test_a_fault_outside_the_engine_is_a_counted_500(smollm2):
    """A bug in the server itself (here: the tokenizer raising) answers in OpenAI's shape, is counted as
    finished_reason="error" for the canary's error gate, and leaves the server serving."""

    from specserve_runtime.server.app import Server

    class BrokenTokenizer:
        def __init__(self, model):
            self.model = model

        def __getattr__(self, name):
            return getattr(self.model, name)

        def encode(self, text, raw=False):
            if text == "boom":
                raise KeyError("a tokenizer bug")
            return self.model.encode(text, raw=raw)

    server = Server(lambda: (BrokenTokenizer(smollm2), build_engine(smollm2, "ar")), MODEL, "ar", None)
    metrics = server.metrics
    async with served(server) as (url, session):
        failed = await session.post(url, json={"model": MODEL, "prompt": "boom", "max_tokens": 2})
        assert failed.status == 500
        assert (await failed.json())["error"] == {"message": "internal error: KeyError", "type": "server_error",
                                                  "param": None, "code": None}
        assert metrics.of(metrics.success, finished_reason="error")._value.get() == 1
        ok = await session.post(url, json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
        assert ok.status == 200


async def test_a_request_frees_its_slot_before_its_answer_goes_out(smollm2, monkeypatch):
    """A client may send its next request the moment it has its answer; with max_concurrency 1 that
    request must find the slot free. (Freed after the answer, a fresh CI run saw its 429.)"""

    from specserve_runtime.server.app import _DONE, Server, Worker

    order = []
    release, emit = Worker._release, Worker._emit

    def spy_release(self, job):
        order.append(("release", job))
        release(self, job)

    def spy_emit(self, job, item):
        if item is _DONE or isinstance(item, Exception):  # the end of the answer
            order.append(("answer", job))
        emit(self, job, item)

    monkeypatch.setattr(Worker, "_release", spy_release)
    monkeypatch.setattr(Worker, "_emit", spy_emit)
    engine = FailingEngine(build_engine(smollm2, "ar"))
    server = Server(lambda: (smollm2, engine), MODEL, "ar", None, max_concurrency=1)
    async with served(server) as (url, session):
        statuses = []
        for _ in range(3):  # the engine fails the first, then serves
            response = await session.post(url, json={"model": MODEL, "prompt": "hi", "max_tokens": 4})
            statuses.append(response.status)
        assert statuses == [500, 200, 200]
    jobs = list(dict.fromkeys(job for _, job in order))
    assert len(jobs) == 3
    for job in jobs:
        kinds = [kind for kind, j in order if j is job]
        assert kinds.index("release") < kinds.index("answer")


class RefusingEngine(WrappedEngine):
    """Wraps an engine: a request whose prompt is longer than `limit` tokens cannot start."""

    def __init__(self, engine, limit):
        super().__init__(engine)
        self.limit = limit

    def add(self, request, stats=None):
        if len(request.prompt_ids) > self.limit:
            raise MemoryError("no room for its KV cache")
        return self.engine.add(request, stats)


async def test_a_request_that_cannot_start_fails_alone(smollm2):
    """While one request streams, another that cannot get its KV cache gets a 500; the first finishes."""

    from specserve_runtime.server.app import Server

    engine = RefusingEngine(build_engine(smollm2, "ar"), limit=8)
    server = Server(lambda: (smollm2, engine), MODEL, "ar", None)
    metrics = server.metrics
    async with served(server) as (url, session):
        streaming = await session.post(url, json={"model": MODEL, "prompt": "The sea", "max_tokens": 24,
                                                  "temperature": 0, "stream": True})
        assert streaming.status == 200
        long_prompt = {"model": MODEL, "prompt": "one two three four five six seven eight nine ten",
                       "max_tokens": 4, "temperature": 0}
        failed = await session.post(url, json=long_prompt)
        assert failed.status == 500 and "no room for its KV cache" in (await failed.json())["error"]["message"]
        body = (await streaming.read()).decode()
        assert body.endswith("data: [DONE]\n\n")
    finished = {reason: metrics.of(metrics.success, finished_reason=reason)._value.get()
                for reason in ("stop", "length", "abort", "error")}
    assert finished["error"] == 1 and finished["stop"] + finished["length"] == 1 and finished["abort"] == 0
    assert metrics.of(metrics.running)._value.get() == 0


class GatedEngine(WrappedEngine):
    """Wraps an engine: every step waits for `open`, and the batch sizes it ran are recorded."""

    def __init__(self, engine):
        super().__init__(engine)
        self.sizes, self.open = [], threading.Event()

    def step(self, batch):
        self.sizes.append(len(batch))
        assert self.open.wait(timeout=120), "the test never opened the engine"
        return self.engine.step(batch)


async def test_concurrent_requests_are_decoded_in_one_batch_and_answer_as_if_alone(smollm2):
    """Six requests at once with room for four in the batch: the first step holds until all six are
    admitted, so the next step batches four of them and the last two join as the first ones finish.
    Every answer is the text that request gets alone."""

    from specserve_runtime.server.app import Server

    prompts = ["The sea is", "My favourite fruit", "def add(a, b):", "In 1905, Einstein", "Paris is the", "Dogs"]
    limits = [12, 6, 16, 9, 12, 4]
    engine = GatedEngine(build_engine(smollm2, "ngram"))
    server = Server(lambda: (smollm2, engine), MODEL, "ngram", None, max_concurrency=6, max_num_seqs=4)
    metrics = server.metrics
    async with served(server) as (url, session):
        try:

            async def complete(prompt, limit):
                body = {"model": MODEL, "prompt": prompt, "max_tokens": limit, "temperature": 0}
                async with session.post(url, json=body) as response:
                    assert response.status == 200
                    return (await response.json())["choices"][0]["text"]

            answers = asyncio.gather(*(complete(prompt, limit) for prompt, limit in zip(prompts, limits)))
            await wait_for(lambda: server.worker.admitted == 6 and engine.sizes, "six requests and a held step")
            assert metrics.of(metrics.waiting)._value.get() == 6 - engine.sizes[0]  # the rest wait their turn
            engine.open.set()
            texts = await answers
        finally:
            engine.open.set()
    assert max(engine.sizes) == 4  # batched, never past max_num_seqs
    assert texts == [ar_text(smollm2, prompt, limit) for prompt, limit in zip(prompts, limits)]
    assert metrics.of(metrics.running)._value.get() == 0 and metrics.of(metrics.waiting)._value.get() == 0
    assert metrics.of(metrics.success, finished_reason="length")._value.get() == 6


async def test_the_model_loads_and_every_step_runs_in_the_engine_thread(smollm2):
    """One thread does all of the server's torch work: a second OpenMP team, from loading the model in
    another thread, made every served step half as slow again (server/app.py, Worker)."""

    from specserve_runtime.server.app import Server

    engine, loaded_in = RecordingEngine(build_engine(smollm2, "ar")), []

    def load():
        loaded_in.append(threading.get_ident())
        return smollm2, engine

    server = Server(load, MODEL, "ar", None)
    async with served(server) as (url, session):
        response = await session.post(url, json={"model": MODEL, "prompt": "hi", "max_tokens": 4})
        assert response.status == 200
    engine_thread = server.worker.thread.ident
    assert engine_thread != threading.get_ident()
    assert loaded_in == [engine_thread] and engine.threads == {engine_thread}


def test_a_model_that_fails_to_load_fails_the_server_with_its_error():
    from specserve_runtime.errors import ModelError
    from specserve_runtime.server.app import Server

    def load():
        raise ModelError("/models/absent is not a Hugging Face model folder (no config.json)")

    with pytest.raises(ModelError, match="/models/absent is not a Hugging Face model folder"):
        Server(load, MODEL, "ar", None)


def test_sigterm_finishes_in_flight_requests_then_exits(smollm2):
    """Kubernetes stops a pod with SIGTERM: readiness fails, the running stream still completes."""
    import signal

    port = free_port()
    process = subprocess.Popen([specserve_bin(), "serve", "--method", "ar", "--port", str(port)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    wait_ready(base, process)
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
    chunks = []

    def stream():
        for chunk in client.completions.create(model=MODEL, prompt="Once upon a time", temperature=0,
                                               max_tokens=48, stream=True):
            chunks.append(chunk)

    reader = threading.Thread(target=stream)
    reader.start()
    while not chunks:
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    reader.join(timeout=120)
    assert process.wait(timeout=60) == 0
    assert chunks[-1].choices[0].finish_reason == "length"  # finished, not cut off
    assert "".join(c.choices[0].text for c in chunks) == ar_text(smollm2, "Once upon a time", 48)


def ar_text(model, prompt: str, max_tokens: int) -> str:
    result = build_engine(model, "ar").generate(Request(model.encode(prompt, raw=True), max_tokens))
    return result.text


@pytest.mark.parametrize(
    "method, drafter, tokens, expected",
    [
        ("none", None, None, None),
        ("ngram", None, 5, {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 2}),
        ("eagle3", "hf://RedHatAI/Qwen3-8B-speculator.eagle3", 7,
         {"method": "eagle3", "model": "RedHatAI/Qwen3-8B-speculator.eagle3", "num_speculative_tokens": 7}),
        ("dflash", "hf://z-lab/Qwen3-8B-DFlash-b16", 15,
         {"method": "dflash", "model": "z-lab/Qwen3-8B-DFlash-b16", "num_speculative_tokens": 15}),
    ],
)
def test_vllm_command_lines(method, drafter, tokens, expected):
    config = RuntimeConfig(model="Qwen/Qwen3-8B", served_name="qwen3-8b", method=method, drafter=drafter,
                           num_speculative_tokens=tokens, engine="vllm", engine_args=["--max-num-batched-tokens", "32768"])
    command = vllm_command(config, ["vllm", "serve"])
    assert command[:5] == ["vllm", "serve", "--model", "Qwen/Qwen3-8B", "--served-model-name"]
    assert command[-2:] == ["--max-num-batched-tokens", "32768"]
    if expected is None:
        assert "--speculative-config" not in command
    else:
        assert json.loads(command[command.index("--speculative-config") + 1]) == expected


def test_vllm_drafts_what_a_local_drafter_folder_proposes_by_default(tmp_path):
    """The bundled DFlash drafter has blocks of 8, not z-lab's 16: 7 drafts a step; the bundled EAGLE-3 drafter
    proposes 3. A z-lab DFlash folder says its block size."""
    bundled = RuntimeConfig(model="m", served_name="m", method="dflash", drafter="bundled://smollm2-135m-instruct-dflash",
                            engine="vllm")
    assert speculative_config(bundled)["num_speculative_tokens"] == 7
    assert speculative_config(bundled)["model"] == str(DEFAULT_DRAFTERS["dflash"])
    assert speculative_config(bundled.model_copy(update={"num_speculative_tokens": 3}))["num_speculative_tokens"] == 3
    eagle = bundled.model_copy(update={"method": "eagle3", "drafter": "bundled://smollm2-135m-instruct-eagle3"})
    assert speculative_config(eagle)["num_speculative_tokens"] == 3
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["DFlashDraftModel"], "block_size": 16}))
    assert speculative_config(bundled.model_copy(update={"drafter": str(tmp_path)}))["num_speculative_tokens"] == 15
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=f"{tmp_path}/config.json: no DFlash block_size"):
        speculative_config(bundled.model_copy(update={"drafter": str(tmp_path)}))


def test_vllm_refuses_a_draft_tree_and_a_prompt_lookup_branch():
    config = RuntimeConfig(model="m", served_name="m", method="dflash", drafter="hf://z-lab/Qwen3-8B-DFlash-b16",
                           draft_tree=True, engine="vllm")
    with pytest.raises(ValueError, match="draftTree: on vLLM specserve drafts chains"):
        vllm_command(config)
    branch = config.model_copy(update={"draft_tree": None, "prompt_lookup": 4})
    with pytest.raises(ValueError, match="promptLookup: on vLLM a drafter drafts alone"):
        vllm_command(branch)
    assert "--speculative-config" in vllm_command(branch.model_copy(update={"prompt_lookup": 0}))


def test_serve_config_passes_every_engine_option(tmp_path, monkeypatch):
    """`specserve serve --config`, the embedded image's command, reads what the operator renders."""
    config = RuntimeConfig(model="SmolLM2-135M-Instruct", served_name="smol", method="dflash", drafter="/opt/d",
                           num_speculative_tokens=6, draft_tree=True, prompt_lookup=4, port=8123)
    (tmp_path / "runtime.yaml").write_text(config.to_yaml())
    served = {}
    monkeypatch.setattr(serving, "run_embedded_server", lambda args: served.update(vars(args)))
    assert cli.main(["serve", "--config", str(tmp_path / "runtime.yaml")]) == 0
    assert {key: served[key] for key in ("model", "method", "drafter", "num_speculative_tokens", "draft_tree",
                                         "prompt_lookup", "served_model_name", "host", "port")} == {
        "model": "SmolLM2-135M-Instruct", "method": "dflash", "drafter": "/opt/d", "num_speculative_tokens": 6,
        "draft_tree": True, "prompt_lookup": 4, "served_model_name": "smol", "host": "0.0.0.0", "port": 8123}


def test_launch_dry_run_prints_the_exact_command(tmp_path):
    config = tmp_path / "runtime.yaml"
    config.write_text(RuntimeConfig(model="Qwen/Qwen3-8B", served_name="qwen3-8b", method="dflash",
                                    drafter="hf://z-lab/Qwen3-8B-DFlash-b16", num_speculative_tokens=15, engine="vllm",
                                    engine_args=["--attention-backend", "flash_attn; rm -rf /"]).to_yaml())
    image = {name: value for name, value in os.environ.items() if name != "SPECSERVE_VLLM"}  # as in the image
    out = subprocess.run([specserve_bin(), "launch", "--config", str(config), "--dry-run"], capture_output=True,
                         text=True, check=True, env=image).stdout.strip()
    assert out.startswith("vllm serve --model Qwen/Qwen3-8B --served-model-name qwen3-8b --host 0.0.0.0 --port 8000 "
                          "--speculative-config ")
    assert out.endswith("--attention-backend 'flash_attn; rm -rf /'")  # an argument, quoted, never shell code


def test_launch_rejects_a_bad_config(tmp_path):
    config = tmp_path / "runtime.yaml"
    config.write_text("model: m\nservedName: m\nmethod: medusa\n")
    run = subprocess.run([specserve_bin(), "launch", "--config", str(config)], capture_output=True, text=True)
    assert run.returncode == 2 and "method: Input should be" in run.stderr


def test_serve_on_a_port_in_use_says_so():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = subprocess.run([specserve_bin(), "serve", "--method", "none", "--port", str(port)],
                             capture_output=True, text=True, timeout=300)
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip().splitlines()[-1] == (
        f"specserve: error: --host 127.0.0.1 --port {port}: cannot listen there (Address already in use)")
