"""Both engines answer the same API: the same requests, sent to the real vLLM and to the embedded engine (each
launched from what the operator renders, plain decoding), get the same status codes and responses of the same
shape. vLLM is the oracle; what only one of them does is listed here, with why (docs/api.md says the same)."""

import json
import urllib.error
import urllib.request

import pytest
from specserve_operator.measure import KEY_LABEL

from .conftest import SERVED

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
GREEDY = {"model": SERVED, "temperature": 0, "max_tokens": 8}
HI = [{"role": "user", "content": "Say hi"}]
SAME = [  # (case, path, body): the same status and the same shape from both
    ("content as text parts", CHAT, {**GREEDY, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "Say"}, {"type": "text", "text": "hi"}]}]}),
    ("a system message as text parts", CHAT, {**GREEDY, "messages": [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]}, {"role": "user", "content": "Hi"}]}),
    ("stop null", CHAT, {**GREEDY, "messages": HI, "stop": None}),
    ("max_completion_tokens", CHAT, {"model": SERVED, "messages": HI, "max_completion_tokens": 5}),
    ("seed", CHAT, {"model": SERVED, "messages": HI, "seed": 3, "temperature": 0.8, "max_tokens": 8}),
    ("ignore_eos", COMPLETIONS, {**GREEDY, "prompt": "Hi", "ignore_eos": True, "max_tokens": 40}),
    ("a completion", COMPLETIONS, {**GREEDY, "prompt": "The capital of France is"}),
    ("a one-prompt list", COMPLETIONS, {**GREEDY, "prompt": ["Hi"]}),
    ("n of 2, greedy", CHAT, {**GREEDY, "messages": HI, "n": 2}),  # both refuse: n > 1 needs sampling on vLLM
    ("an image part", CHAT, {**GREEDY, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://example.com/a.png"}}]}]}),
    ("an unknown model", CHAT, {**GREEDY, "model": "no-such-model", "messages": HI}),
    ("max_tokens below 1", CHAT, {**GREEDY, "messages": HI, "max_tokens": -1}),
    ("no messages", CHAT, {**GREEDY, "messages": []}),
]
STREAMS = [
    ("chat, usage in a last chunk", CHAT, {**GREEDY, "messages": HI, "stream": True,
                                           "stream_options": {"include_usage": True}}),
    ("chat, usage in every chunk", CHAT, {**GREEDY, "messages": HI, "stream": True,
                                          "stream_options": {"include_usage": True, "continuous_usage_stats": True}}),
    ("completion", COMPLETIONS, {**GREEDY, "prompt": "Hi", "stream": True}),
]
# vLLM answers 200, the embedded engine 400 naming the field: it returns one choice per request, no
# log-probabilities, no echo and no penalties; a client that asks for them gets an error, not an answer without them.
EMBEDDED_REFUSES = [
    ("n of 2, sampled", CHAT, {"model": SERVED, "messages": HI, "n": 2, "temperature": 0.8, "max_tokens": 8}, "n"),
    ("two prompts", COMPLETIONS, {**GREEDY, "prompt": ["Hi", "Yo"]}, "prompt"),
    ("chat logprobs", CHAT, {**GREEDY, "messages": HI, "logprobs": True, "top_logprobs": 2}, "logprobs"),
    ("completion logprobs", COMPLETIONS, {**GREEDY, "prompt": "Hi", "logprobs": 2}, "logprobs"),
    ("echo", COMPLETIONS, {**GREEDY, "prompt": "Hi", "echo": True}, "echo"),
    ("a presence penalty", CHAT, {**GREEDY, "messages": HI, "presence_penalty": 0.5}, "presence_penalty"),
]
# Fields only vLLM returns: its own extensions, and OpenAI's optional ones for features the embedded engine does
# not have (refusals, audio, tool calls, reasoning, service tiers, token details).
VLLM_ONLY = {"refusal", "annotations", "audio", "function_call", "tool_calls", "reasoning", "reasoning_content",
             "stop_reason", "token_ids", "routed_experts", "service_tier", "system_fingerprint", "prompt_tokens_details",
             "completion_tokens_details", "prompt_logprobs", "prompt_token_ids", "prompt_text", "kv_transfer_params",
             "ec_transfer_params", "metrics"}


def post(server, path: str, body: dict | None, raw: bytes | None = None) -> tuple[int, str]:
    data = raw if raw is not None else json.dumps(body).encode()
    request = urllib.request.Request(server.url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def shape(value, path: str = "") -> set[str]:
    """Every field's path and JSON type (list items share the path `[]`), leaving out VLLM_ONLY fields."""
    kind = {dict: "object", list: "array", str: "string", bool: "bool", int: "number", float: "number",
            type(None): "null"}[type(value)]
    paths = {f"{path}:{kind}"}
    if isinstance(value, dict):
        for key, item in value.items():
            if key not in VLLM_ONLY:
                paths |= shape(item, f"{path}.{key}")
    elif isinstance(value, list):
        for item in value:
            paths |= shape(item, f"{path}[]")
    return paths


def error_shape(body: str) -> set[str]:
    """An error's fields (their values differ: vLLM's type is its exception's name, its code the status)."""
    return {"error." + key for key in json.loads(body)["error"]}


def events(body: str) -> list:
    """A server-sent event stream's data payloads, `[DONE]` last."""
    payloads = [line.removeprefix("data: ") for line in body.splitlines() if line.startswith("data: ")]
    assert payloads[-1] == "[DONE]"
    return [json.loads(payload) for payload in payloads[:-1]]


@pytest.mark.parametrize("case, path, body", SAME, ids=[case for case, _, _ in SAME])
def test_both_engines_answer_a_request_with_the_same_status_and_shape(vllm_servers, embedded_server, case, path, body):
    (vllm_status, vllm_body), (own_status, own_body) = (post(s, path, body) for s in (vllm_servers["none"], embedded_server))
    assert own_status == vllm_status, (vllm_body, own_body)
    if vllm_status == 200:
        assert shape(json.loads(own_body)) == shape(json.loads(vllm_body))
        if case == "ignore_eos":  # past the end-of-sequence token, both to max_tokens
            assert json.loads(own_body)["usage"]["completion_tokens"] == 40
    else:
        assert error_shape(own_body) == error_shape(vllm_body) == {"error.message", "error.type", "error.param",
                                                                   "error.code"}


@pytest.mark.parametrize("case, path, body", STREAMS, ids=[case for case, _, _ in STREAMS])
def test_both_engines_stream_the_same_chunks(vllm_servers, embedded_server, case, path, body):
    streams = {}
    for name, server in (("vllm", vllm_servers["none"]), ("embedded", embedded_server)):
        status, text = post(server, path, body)
        assert status == 200, text
        streams[name] = events(text)
    assert set().union(*map(shape, streams["embedded"])) == set().union(*map(shape, streams["vllm"]))
    for chunks in streams.values():
        options = body.get("stream_options", {})
        if options.get("continuous_usage_stats"):
            assert all("usage" in chunk for chunk in chunks)
        if options.get("include_usage"):
            assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 8


@pytest.mark.parametrize("case, path, body, field", EMBEDDED_REFUSES, ids=[case for case, *_ in EMBEDDED_REFUSES])
def test_what_only_vllm_answers_the_embedded_engine_refuses_naming_the_field(vllm_servers, embedded_server, case,
                                                                           path, body, field):
    assert post(vllm_servers["none"], path, body)[0] == 200
    status, text = post(embedded_server, path, body)
    assert status == 400 and json.loads(text)["error"]["param"] == field, text


def test_both_engines_refuse_malformed_json(vllm_servers, embedded_server):
    for server in (vllm_servers["none"], embedded_server):
        status, text = post(server, CHAT, None, raw=b"{not json")
        assert status == 400 and json.loads(text)["error"]["message"], text


def test_both_engines_export_the_series_the_operator_reads_with_the_same_finish_reasons(vllm_servers, embedded_server):
    def finish_reasons(server) -> tuple[set[str], set[str]]:
        lines = [line for line in server.metrics().splitlines() if line and not line.startswith("#")]
        names = {line.split("{")[0].split(" ")[0] for line in lines}
        reasons = {line.split('finished_reason="')[1].split('"')[0] for line in lines if 'finished_reason="' in line}
        return names, reasons

    (vllm_names, vllm_reasons), (own_names, own_reasons) = map(finish_reasons, (vllm_servers["none"], embedded_server))
    assert own_reasons == vllm_reasons and "repetition" in own_reasons
    operator_reads = {name for name in KEY_LABEL if "spec_decode" not in name}  # plain decoding exports no drafts
    assert operator_reads <= vllm_names and operator_reads <= own_names
