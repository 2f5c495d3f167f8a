"""The OpenAI request bodies `ecru serve api` accepts (strict types: a wrong type is a 400, not a guess),
and how each becomes `SamplingParams`. Unknown fields are ignored, as OpenAI-compatible servers do;
OpenAI features ecru does not serve (`NOT_SERVED`: tools, response_format, ...; echo, suffix) are refused
with a 400 that names them rather than ignored."""

from __future__ import annotations

from typing import Annotated, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from ecru.serve.engine.sampling import MAX_LOGPROBS, SamplingParams

MAX_N = 16  # choices per request
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit on /v1/completions' logprobs
# a list stops at its first invalid item: a 1 MiB body of bad items would otherwise make ~500k errors, seconds of
# work on the event loop (only the first is answered)
_T = TypeVar("_T")
_List = Annotated[list[_T], Field(fail_fast=True)]
NOT_SERVED = ("tools", "tool_choice", "parallel_tool_calls", "functions", "function_call", "response_format",
              "logit_bias", "best_of", "audio", "modalities", "prediction")  # fmt: skip


class APIError(Exception):
    """An error answered as OpenAI's body {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


def check_text(text: str, param: str) -> None:
    """A lone surrogate (valid JSON, e.g. "\\ud800", but not Unicode text) is the client's error."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise APIError(
            400, f"{param} is not valid Unicode text ({exc.reason} at {exc.start})", param=param
        ) from None


class TextPart(_Strict):
    type: str
    text: str


class ChatMessage(_Strict):
    role: str
    content: str | _List[TextPart] | None = None

    def to_template(self) -> dict:
        content = self.content
        if isinstance(content, list):
            if any(p.type != "text" for p in content):
                raise APIError(400, "only text content parts are supported", param="messages")
            content = "".join(p.text for p in content)
        check_text(self.role, "messages")
        check_text(content or "", "messages")
        return {"role": self.role, "content": content or ""}


class _Sampling(_Strict):
    """Fields shared by both endpoints (unknown fields kept in `model_extra`, to refuse `NOT_SERVED`)."""

    model_config = ConfigDict(strict=True, extra="allow")

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)  # what a torch.Generator takes
    stop: str | _List[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool = False
    stream_options: dict | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    user: str | None = None

    def refuse_unsupported(self) -> None:
        named = [k for k in NOT_SERVED if (self.model_extra or {}).get(k) not in (None, [], {})]
        if named:
            raise APIError(400, f"not supported here: {', '.join(named)}; remove them", param=named[0])
        for s in [self.stop] if isinstance(self.stop, str) else self.stop or []:
            check_text(s, "stop")

    @property
    def top_logprobs_asked(self) -> int | None:
        """SamplingParams.logprobs: None (no logprobs) or how many top alternatives per token."""
        return None

    def sampling(self, *, max_tokens: int, choice: int = 0) -> SamplingParams:
        """The request's `SamplingParams` (OpenAI's defaults: temperature 1, top_p 1), ValueError -> 400;
        choice i > 0 of n draws with seed + i, so that seeded choices differ yet repeat."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        values = {
            "max_tokens": max_tokens,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "top_k": self.top_k or 0,
            "seed": None if self.seed is None else self.seed + choice,
            "stop": tuple(stop),
            "presence_penalty": self.presence_penalty or 0.0,
            "frequency_penalty": self.frequency_penalty or 0.0,
            "logprobs": self.top_logprobs_asked,
        }
        try:
            return SamplingParams(**values)
        except ValueError as exc:
            named = [(str(exc).find(k), k) for k in values if k in str(exc)]
            raise APIError(400, str(exc), param=min(named)[1] if named else None) from None

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class ChatCompletionRequest(_Sampling):
    messages: _List[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if not self.messages:
            raise APIError(400, "messages is empty: give at least one message", param="messages")
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")

    @property
    def top_logprobs_asked(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Sampling):
    prompt: str | _List[str]
    echo: bool = False
    suffix: str | None = None
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if isinstance(self.prompt, list) and len(self.prompt) != 1:
            raise APIError(400, "give one prompt per request (a string)", param="prompt")
        if not self.text:
            raise APIError(400, "prompt is empty", param="prompt")
        check_text(self.text, "prompt")
        if self.echo or self.suffix:
            raise APIError(400, "echo and suffix are not supported", param="echo" if self.echo else "suffix")

    @property
    def top_logprobs_asked(self) -> int | None:
        return self.logprobs

    @property
    def text(self) -> str:
        return self.prompt[0] if isinstance(self.prompt, list) else self.prompt

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens
