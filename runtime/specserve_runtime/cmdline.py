"""What the command lines of both packages share, torch-free (the operator's local tools import it): usage errors
and the parser that raises them, prompt files, and child processes on loopback (the local canary and demo, the
load bench and the vLLM baseline start runtimes, vLLM or Prometheus this way): started in their own process group
and ended with their parent, polled until ready, stopped in order.
"""

import argparse
import contextlib
import json
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

# ---- usage errors and prompt files ---------------------------------------------------------------


class UsageError(Exception):
    """Bad input from the user: reported as one line, `PROG: error: message`, exit status 2."""

    def __init__(self, message: str, prog: str = "specserve"):
        super().__init__(message)
        self.prog = prog


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line naming the problem, not the whole usage text
        raise UsageError(message, prog=self.prog)


def read_prompts(prompt: str | None, prompts_file: str | None) -> list[str]:
    return [prompt] if prompt is not None else [record["prompt"] for record in read_prompt_records(prompts_file)]


def read_prompt_records(prompts_file: str) -> list[dict]:
    """A JSONL prompt file's objects, each with a string "prompt" (and whatever else it carries)."""
    path = Path(prompts_file)
    if not path.is_file():
        raise UsageError(f"--prompts-file {path}: no such file")
    records = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UsageError(f"{path}:{number}: invalid JSON ({exc.msg})") from exc
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            raise UsageError(f'{path}:{number}: expected an object with a string "prompt" field')
        if "context" in record:  # these commands send one user turn: the conversation before it would be dropped
            raise UsageError(f'{path}:{number}: a multi-turn prompt (a "context" field, set v2-turns) is for '
                             "`specserve distill`; this command sends single-turn prompts (such as set v2's)")
        records.append(record)
    if not records:
        raise UsageError(f"{path}: no prompts")
    return records


# ---- child processes on loopback ----------------------------------------------------------------

STOP_GRACE_SECONDS = 10  # SIGTERM, then SIGKILL after this
# A runtime not ready by then is a failure: the embedded engine loads in seconds; vLLM loads and profiles longer,
# and two starting at once on 2 cores take minutes.
READY_SECONDS = {"embedded": 180, "vllm": 600}

LOOPBACK = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never through an HTTP proxy


class ChildFailed(Exception):
    """A child exited, or was not ready in time; the message ends with the last lines of its log."""


class TimedOut(Exception):
    """The caller's overall bound passed (the local canary's --timeout-seconds: an Inconclusive decision)."""


def http_get(url: str, timeout: float = 2.0) -> bytes:
    with LOOPBACK.open(url, timeout=timeout) as response:
        return response.read()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Child:
    name: str
    process: subprocess.Popen
    log: Path

    def tail(self, lines: int = 5) -> str:
        try:
            return " | ".join(self.log.read_text(errors="replace").strip().splitlines()[-lines:])
        except OSError:
            return ""


def _end_with_parent() -> None:
    """Linux: the kernel sends the child SIGTERM if this command dies without cleaning up (SIGKILL)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def spawn(name: str, command: list[str], log: Path, env: dict | None = None) -> Child:
    """A child in its own process group: a terminal's Ctrl-C reaches this command, which stops it in order."""
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
                                   process_group=0, preexec_fn=_end_with_parent if sys.platform == "linux" else None)
    return Child(name, process, log)


def stop_children(children: list[Child], grace: float = STOP_GRACE_SECONDS) -> None:
    for child in children:
        if child.process.poll() is None:
            child.process.terminate()
    deadline = time.monotonic() + grace
    for child in children:
        try:
            child.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.process.kill()
            child.process.wait(timeout=10)


def wait_ready(url: str, child: Child, seconds: float, overall: float = float("inf"),
               started: float | None = None) -> None:
    """Poll url until it answers 200. ChildFailed if the child exits or `seconds` pass since it `started` (the
    monotonic clock's reading; default now); TimedOut if the monotonic clock reaches `overall` first."""
    deadline = (time.monotonic() if started is None else started) + seconds
    while True:
        if child.process.poll() is not None:
            raise ChildFailed(f"{child.name} exited with code {child.process.returncode}: {child.tail()}")
        try:
            http_get(url)
            return
        except (OSError, ValueError):
            pass
        now = time.monotonic()
        if now >= overall:
            raise TimedOut(f"--timeout-seconds reached while waiting for {child.name}")
        if now >= deadline:
            raise ChildFailed(f"{child.name} not ready after {seconds:g} s: {child.tail()}")
        time.sleep(0.3)


@contextlib.contextmanager
def running(name: str, command: list[str], ready_url: str, seconds: float, env: dict | None = None) -> Iterator[Child]:
    """A server child for the `with` block: started, ready (ready_url answers 200 within `seconds`), then stopped,
    its log in a temporary folder (its last lines in the ChildFailed message if it fails)."""
    with tempfile.TemporaryDirectory(prefix="specserve-") as work:
        child = spawn(name, command, Path(work) / "server.log", env)
        try:
            wait_ready(ready_url, child, seconds)
            yield child
        finally:
            stop_children([child])
