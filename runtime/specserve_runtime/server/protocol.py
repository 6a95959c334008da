"""The OpenAI wire format: request models (validation with clear errors) and response builders."""

import time
import uuid
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..errors import field_location


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = {400: "invalid_request_error", 404: "invalid_request_error", 429: "rate_limit_error"}.get(self.status, "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def _unicode(value: str) -> str:
    """JSON can carry a lone UTF-16 surrogate ("\\ud800"); no tokenizer can encode one."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"is not valid Unicode text ({exc.reason} at character {exc.start})") from None
    return value


Text = Annotated[str, AfterValidator(_unicode)]


class StreamOptions(BaseModel):
    include_usage: bool = False  # a last chunk with the request's usage
    continuous_usage_stats: bool = False  # vLLM's: the usage so far in every chunk


class SamplingFields(BaseModel):
    # Unknown fields (user, ...) are ignored, as OpenAI-compatible servers do; the ones this server would have
    # to answer differently are refused by name instead (REFUSED), not silently dropped. Strict, as OpenAI's API
    # is: "4" is not a number of tokens, nor true one.
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    stop: Text | list[Text] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # vLLM's: generate past the end-of-sequence token, up to max_tokens
    n: int = 1
    logprobs: bool | int | None = None
    top_logprobs: int | None = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, value):
        if value != 1:
            raise ValueError(f"the embedded engine returns one choice per request, not {value} (send {value} requests)")
        return value

    @field_validator("logprobs", "top_logprobs")
    @classmethod
    def _no_logprobs(cls, value):
        if value not in (None, False, 0):
            raise ValueError("the embedded engine does not return log-probabilities")
        return value

    @field_validator("stop")
    @classmethod
    def _stops(cls, value):
        stops = [value] if isinstance(value, str) else (value or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop takes up to 4 non-empty strings")
        return stops

    def stops(self) -> tuple[str, ...]:
        return tuple(self.stop or ())


class CompletionRequest(SamplingFields):
    prompt: Text | list[Text]
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for completions

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value):
        if isinstance(value, list):
            if len(value) != 1:
                raise ValueError("send one prompt per request")
            value = value[0]
        if not value:
            raise ValueError("prompt is empty")
        return value


class TextPart(BaseModel):
    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant"]
    content: Text | list[TextPart]  # a list of parts, as OpenAI's API and vLLM take it: text parts only

    def text(self) -> str:
        """The message's text: its parts joined by newlines, as vLLM joins them."""
        return self.content if isinstance(self.content, str) else "\n".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


# OpenAI and vLLM fields that change the answer, which the embedded engine does not implement: each with the test
# for "it asks for something" (a field at its no-op value, such as presence_penalty 0, is accepted).
REFUSED = {
    "echo": bool, "suffix": bool, "logit_bias": bool, "tools": bool, "functions": bool,
    "best_of": lambda value: value not in (None, 1),
    "presence_penalty": lambda value: value not in (None, 0),
    "frequency_penalty": lambda value: value not in (None, 0),
    "repetition_penalty": lambda value: value not in (None, 1),
    "min_tokens": lambda value: value not in (None, 0),
    "response_format": lambda value: value not in (None, {"type": "text"}),
    "guided_json": bool, "guided_regex": bool, "guided_choice": bool, "guided_grammar": bool,
    "structured_outputs": bool,
}


def parse(model: type[BaseModel], payload) -> BaseModel:
    if not isinstance(payload, dict):
        raise ApiError(400, "the request body must be a JSON object")
    for name, asks in REFUSED.items():
        if name in payload and asks(payload[name]):
            raise ApiError(400, f"{name}: the embedded engine does not support it (leave it out)", param=name)
    try:
        return model.model_validate(payload)
    except ValidationError as exc:
        param, message = _first_error(exc)
        raise ApiError(400, f"{param}: {message}" if param else message, param=param) from exc


def _first_error(exc: ValidationError) -> tuple[str | None, str]:
    """The first invalid field, named by its path in the request. A field that takes one of several shapes
    (content: a string or a list of parts) fails once per shape; the deepest failure under it says most."""
    def path(error) -> list[str]:
        return [str(part) for part in field_location(error["loc"])]
    errors = exc.errors()
    first = path(errors[0])
    under = [error for error in errors if path(error)[:len(first)] == first]
    deepest = max(under, key=lambda error: len(path(error)))
    return ".".join(path(deepest)) or None, deepest["msg"].removeprefix("Value error, ")



def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}


def completion_body(request_id, model, text, finish_reason, usage_) -> dict:
    return {
        "id": request_id, "object": "text_completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
        "usage": usage_,
    }


def chat_body(request_id, model, text, finish_reason, usage_) -> dict:
    return {
        "id": request_id, "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                     "finish_reason": finish_reason}],
        "usage": usage_,
    }


def completion_chunk(request_id, model, text, finish_reason) -> dict:
    return {
        "id": request_id, "object": "text_completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
    }


def chat_chunk(request_id, model, delta: dict, finish_reason) -> dict:
    return {
        "id": request_id, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
    }
