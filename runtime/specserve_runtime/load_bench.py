"""`specserve bench --concurrency 1,2,4`: closed-loop load against an OpenAI-compatible server.

At each concurrency C, C clients each stream completions one after another (a client sends its
next request when the previous one has ended), so exactly C requests are in flight at all times.
Time to first token is measured per request; the inter-token latency is the gap between streamed
chunks, as vLLM's benchmark_serving measures it (a speculative step sends several tokens in one
chunk). Token counts come from the server's usage report.

Without --url, bench starts one `specserve serve` per method, each with a batch as large as the
highest concurrency, all at once (an idle server waits on its queue and costs no CPU). At each
concurrency the methods take turns, `repeats` rounds, each round starting with the next method, so
a drift of the machine's speed over minutes falls on every method alike; a method's ratio to plain
decoding is the median of its rounds' ratios to the ar level measured beside it. Each level begins
with one uncounted round per method (one request per client): a server pays for its first batches
of a new size once in its life (kernel selection at new shapes; adaptive speculation pairing each
draft length at a new batch-size bucket, about twelve drafting steps at twice a plain step's cost),
and a level measures what it serves after that, as the in-process `--closed-loop` does.
"""

import asyncio
import contextlib
import json
import statistics
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field

from .bench import markdown_table, method_spec, scenario_method
from .cmdline import READY_SECONDS, free_port, running
from .metric_names import ACCEPTED, DRAFTS, parse_metrics


@dataclass
class RequestTiming:
    ttft: float  # seconds from sending to the first streamed token
    seconds: float  # sending to the end of the stream
    tokens: int
    gaps: list[float]  # seconds between streamed chunks after the first

    @property
    def decode_tokens_per_second(self) -> float:
        return (self.tokens - 1) / (self.seconds - self.ttft) if self.tokens > 1 and self.seconds > self.ttft else 0.0


@dataclass
class Level:
    """The measurements at one concurrency."""

    concurrency: int
    wall_seconds: float = 0.0
    requests: list[RequestTiming] = field(default_factory=list)
    errors: int = 0

    def summary(self) -> dict:
        gaps = [gap for r in self.requests for gap in r.gaps]
        ttfts = [r.ttft for r in self.requests]
        tokens = sum(r.tokens for r in self.requests)
        return {
            "concurrency": self.concurrency,
            "requests": len(self.requests),
            "errors": self.errors,
            "output_tokens_per_second": round(tokens / self.wall_seconds, 2) if self.wall_seconds else 0.0,
            "tokens_per_second_per_request": round(statistics.median(r.decode_tokens_per_second for r in self.requests), 2)
            if self.requests else 0.0,
            "itl_p50_ms": _percentile_ms(gaps, 50),
            "itl_p99_ms": _percentile_ms(gaps, 99),
            "ttft_p50_ms": _percentile_ms(ttfts, 50),
            "ttft_p99_ms": _percentile_ms(ttfts, 99),
        }


def _percentile_ms(values: list[float], percent: int) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(len(ordered) * percent / 100))] * 1000, 1)


async def stream_completion(session, url: str, model: str, prompt: str, max_tokens: int) -> RequestTiming:
    """One chat completion (the prompt as the user's message, as in-process bench encodes it), streamed."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    first, last, gaps, tokens = None, None, [], 0
    async with session.post(url + "/v1/chat/completions", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {(await response.text())[:200]}")
        async for line in response.content:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                now = time.perf_counter()
                if first is None:
                    first = now
                else:
                    gaps.append(now - last)
                last = now
    ended = time.perf_counter()
    return RequestTiming((first or ended) - started, ended - started, tokens, gaps)


async def run_level(url: str, model: str, prompts: list[str], concurrency: int, requests_per_client: int,
                    max_tokens: int) -> Level:
    import aiohttp

    level = Level(concurrency)

    async def client(index: int, session) -> None:
        for round_number in range(requests_per_client):
            prompt = prompts[(index + round_number * concurrency) % len(prompts)]
            try:
                level.requests.append(await stream_completion(session, url, model, prompt, max_tokens))
            except (aiohttp.ClientError, RuntimeError):
                level.errors += 1

    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        started = time.perf_counter()
        await asyncio.gather(*(client(index, session) for index in range(concurrency)))
        level.wall_seconds = time.perf_counter() - started
    return level


def acceptance_length(metrics_text: str) -> float:
    """1 + accepted / drafts from a /metrics page (vLLM's names, parsed as the operator parses them)."""
    values = parse_metrics(metrics_text)
    drafts = values.get((DRAFTS, ""), 0.0)
    return 1 + values.get((ACCEPTED, ""), 0.0) / drafts if drafts else 1.0


def served_acceptance_length(url: str) -> float:
    """The server's acceptance length so far, from its own counters."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        return round(acceptance_length(response.read().decode()), 3)


def served_model(url: str) -> str:
    with urllib.request.urlopen(url + "/v1/models", timeout=10) as response:
        return json.load(response)["data"][0]["id"]


def summarise_rounds(rounds: list[Level]) -> dict:
    """One concurrency measured in several rounds: latencies over all their requests, throughput
    over their summed wall time, and each round's own throughput (`rounds`, for ratios against a
    method measured in the same round)."""
    pooled = Level(rounds[0].concurrency, wall_seconds=sum(level.wall_seconds for level in rounds),
                   requests=[request for level in rounds for request in level.requests],
                   errors=sum(level.errors for level in rounds))
    return pooled.summary() | {"rounds": [level.summary()["output_tokens_per_second"] for level in rounds]}


def measure_servers(urls: dict[str, str], prompts: list[str], concurrencies: list[int], repeats: int,
                    requests_per_client: int, max_tokens: int, log=print) -> dict[str, dict]:
    """Every concurrency level, lowest first, against each method's running server (`urls`: method
    -> base URL), the methods taking turns `repeats` times per level, after one uncounted round each
    (which is also each server's first request: its warm-up)."""
    methods = list(urls)
    models = {method: served_model(url) for method, url in urls.items()}
    results = {method: {"levels": []} for method in methods}
    for concurrency in concurrencies:
        rounds = {method: [] for method in methods}
        for method in methods:  # uncounted: the server's first batches of this size
            asyncio.run(run_level(urls[method], models[method], prompts, concurrency, 1, max_tokens))
        for number in range(repeats):
            start = number % len(methods)  # no method always runs first, in the fastest minute of a level
            for method in methods[start:] + methods[:start]:
                rounds[method].append(asyncio.run(run_level(urls[method], models[method], prompts, concurrency,
                                                            requests_per_client, max_tokens)))
        for method in methods:
            level = summarise_rounds(rounds[method])
            results[method]["levels"].append(level)
            log(f"  {method}, concurrency {concurrency}: {level['output_tokens_per_second']} tok/s in total "
                f"(rounds {level['rounds']}), {level['tokens_per_second_per_request']} per request, "
                f"p99 ITL {level['itl_p99_ms']} ms, p99 TTFT {level['ttft_p99_ms']} ms, {level['errors']} errors")
    for method, url in urls.items():
        results[method]["acceptance_length"] = served_acceptance_length(url)
    return results


@contextlib.contextmanager
def local_server(method: str, model: str, max_num_seqs: int, extra: list[str]) -> Iterator[str]:
    """`specserve serve` for one method on a free loopback port, for the `with` block: its base URL once ready,
    then stopped (cmdline.running: its log's last lines name why if it fails)."""
    port = free_port()
    command = [sys.executable, "-m", "specserve_runtime.cli", "serve", "--model", model, "--host", "127.0.0.1",
               "--port", str(port), "--max-num-seqs", str(max_num_seqs), "--max-concurrency", str(2 * max_num_seqs),
               *extra]
    url = f"http://127.0.0.1:{port}"
    with running(f"specserve serve --method {method}", command, url + "/ready", READY_SECONDS["embedded"]):
        yield url


def serve_arguments(name: str) -> list[str]:
    """A bench method ('dflash', 'dflash:3', 'dflash:tree3+lookup4@FOLDER') as `specserve serve` flags."""
    method, options = method_spec(name)
    tokens = options.num_speculative_tokens
    return (["--method", method] + (["--num-speculative-tokens", str(tokens)] if tokens else [])
            + (["--draft-tree"] if options.draft_tree else [])
            + (["--prompt-lookup", str(options.prompt_lookup)] if options.prompt_lookup is not None else [])
            + (["--drafter", options.drafter] if options.drafter else []))


def performance_block(results: dict[str, dict], max_num_seqs: int) -> dict:
    """The measured curves as a `performance` block (docs/simulator.md): per method one row per
    concurrency with the median per-request decode rate and the median time to first token;
    maxConcurrency is the batch the servers ran with."""
    return {scenario_method(name): performance_row(result, max_num_seqs) for name, result in results.items()}


def performance_row(result: dict, max_num_seqs: int) -> dict:
    levels = result["levels"]
    requests = sum(level["requests"] + level["errors"] for level in levels)
    return {
        "acceptanceLength": result["acceptance_length"],
        "errorRate": round(sum(level["errors"] for level in levels) / requests, 4) if requests else 0.0,
        "maxConcurrency": max_num_seqs,
        "curve": [{"concurrency": level["concurrency"], "tokensPerSecondPerRequest": level["tokens_per_second_per_request"],
                   "ttftMs": level["ttft_p50_ms"]} for level in levels],
    }


def ratio_to_plain(level: dict, plain: dict) -> float:
    """Total tokens/s against plain decoding's at the same concurrency: the median of the rounds'
    ratios when both were measured in the same rounds (each pair shares the machine's speed of its
    minute), else the ratio of the totals."""
    rounds, plain_rounds = level.get("rounds", []), plain.get("rounds", [])
    if rounds and len(rounds) == len(plain_rounds) and all(base > 0 for base in plain_rounds):
        return statistics.median(tokens / base for tokens, base in zip(rounds, plain_rounds))
    return level["output_tokens_per_second"] / plain["output_tokens_per_second"]


def table(results: dict[str, dict]) -> str:
    """One row per method and concurrency; the ratio column compares with plain decoding at that concurrency."""
    plain = {level["concurrency"]: level for level in results.get("ar", {}).get("levels", [])}
    header = ("method", "concurrency", "total tok/s", "vs ar", "tok/s per request", "ITL p50/p99 ms",
              "TTFT p50/p99 ms", "errors")
    rows = [header]
    for name, result in results.items():
        for level in result["levels"]:
            base = plain.get(level["concurrency"])
            rows.append((
                name, str(level["concurrency"]), f"{level['output_tokens_per_second']:.1f}",
                f"{ratio_to_plain(level, base):.2f}x" if base and base["output_tokens_per_second"] else "-",
                f"{level['tokens_per_second_per_request']:.1f}",
                f"{level['itl_p50_ms']}/{level['itl_p99_ms']}", f"{level['ttft_p50_ms']}/{level['ttft_p99_ms']}",
                str(level["errors"]),
            ))
    return "\n".join(markdown_table(rows))


def schedule_table(results: dict[str, dict], method: str, lengths: list[int], schedule: str) -> str:
    """Per concurrency: plain decoding's total tokens/s, the best fixed draft length's, the schedule's, and the
    schedule against the better of the two (each ratio the median of the rounds' ratios, as `vs ar`)."""
    rows = [("concurrency", "ar tok/s", "best fixed length", "schedule tok/s", "schedule vs ar",
             "schedule vs best of fixed and ar")]
    for index, plain in enumerate(results["ar"]["levels"]):
        fixed = {k: results[f"{method}:{k}"]["levels"][index] for k in lengths}
        best_k = max(fixed, key=lambda k: fixed[k]["output_tokens_per_second"])
        level = results[schedule]["levels"][index]
        best = fixed[best_k] if fixed[best_k]["output_tokens_per_second"] > plain["output_tokens_per_second"] else plain
        rows.append((str(plain["concurrency"]), f"{plain['output_tokens_per_second']:.1f}",
                     f"{best_k}: {fixed[best_k]['output_tokens_per_second']:.1f}, {ratio_to_plain(fixed[best_k], plain):.2f}x",
                     f"{level['output_tokens_per_second']:.1f}", f"{ratio_to_plain(level, plain):.2f}x",
                     f"{ratio_to_plain(level, best):.2f}x"))
    return "\n".join(markdown_table(rows))
