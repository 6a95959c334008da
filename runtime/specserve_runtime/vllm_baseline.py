"""vLLM as a `specserve bench` baseline: the target's float32 folder served by vLLM, fed the engine's own prompt
token ids, greedily, one request at a time, on the bench's threads.

vLLM is started as a pod starts it: a runtime configuration run by `specserve launch` (vLLM itself from
SPECSERVE_VLLM, else the `vllm` command), plain or with a bundled drafter (a chain of its drafts: vLLM drafts
no trees). Tokens are timed as the client sees them stream, so its times include the HTTP hop the engine's
in-process runs do not pay (well under a millisecond a token on loopback).
"""

import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from .cmdline import LOOPBACK, READY_SECONDS, free_port, running
from .config import DEFAULT_DRAFTER_NAMES, RuntimeConfig
from .launch import vllm_program

SERVED_NAME = "bench"
KV_CACHE_BYTES = 512 << 20  # one sequence of a few thousand tokens, with room to spare


def vllm_missing() -> str | None:
    """Why the vLLM baselines cannot run here, or None."""
    program = vllm_program()[0]
    if shutil.which(program) is None and not Path(program).is_file():
        return (f"the vLLM baselines start vLLM with {program!r}, which is not here: install vLLM, or name its "
                "command in SPECSERVE_VLLM (docs/images.md)")
    return None


def bound_cores(threads: int) -> str:
    """The first `threads` cores this process may run on, as VLLM_CPU_OMP_THREADS_BIND lists them."""
    return ",".join(map(str, sorted(os.sched_getaffinity(0))[:threads]))


@contextlib.contextmanager
def serve(method: str, model_folder: Path, threads: int, context: int) -> Iterator[str]:
    """vLLM serving the folder with `method` (none, or eagle3 / dflash with the bundled drafter), for the `with`
    block: its base URL once ready."""
    port = free_port()
    drafter = f"bundled://{DEFAULT_DRAFTER_NAMES[method]}" if method in DEFAULT_DRAFTER_NAMES else None
    config = RuntimeConfig(model=str(model_folder), served_name=SERVED_NAME, method=method, drafter=drafter,
                           engine="vllm", host="127.0.0.1", port=port,
                           engine_args=["--dtype", "float32", "--enforce-eager", "--max-model-len", str(context),
                                        "--max-num-seqs", "1", "--kv-cache-memory-bytes", str(KV_CACHE_BYTES)])
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": bound_cores(threads), "TOKENIZERS_PARALLELISM": "false"}
    with tempfile.TemporaryDirectory(prefix="specserve-vllm-") as work:
        config_file = Path(work) / "runtime.yaml"
        config_file.write_text(config.to_yaml())
        command = [sys.executable, "-m", "specserve_runtime.cli", "launch", "--config", str(config_file)]
        url = f"http://127.0.0.1:{port}"
        with running(f"vLLM ({method})", command, url + "/health", READY_SECONDS["vllm"], env):
            yield url


def generate(url: str, ids: list[int], max_new_tokens: int, eos_ids: set[int]) -> tuple[list[int], float, float]:
    """Greedy tokens for the prompt's token ids (the end token left out), seconds in all, seconds to the first."""
    body = {"model": SERVED_NAME, "prompt": ids, "max_tokens": max_new_tokens, "temperature": 0, "stream": True,
            "return_token_ids": True}
    request = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    tokens, first_token = [], None
    started = time.perf_counter()
    with LOOPBACK.open(request, timeout=600) as response:
        for line in response:
            payload = line.decode().strip().removeprefix("data: ")
            if not payload or payload == "[DONE]":
                continue
            for choice in json.loads(payload)["choices"]:
                if choice.get("token_ids"):
                    first_token = first_token or time.perf_counter() - started
                    tokens += choice["token_ids"]
    seconds = time.perf_counter() - started
    while tokens and tokens[-1] in eos_ids:
        tokens.pop()
    return tokens, seconds, first_token or seconds
