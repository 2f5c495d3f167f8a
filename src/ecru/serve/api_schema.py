"""The OpenAI request bodies `ecru serve api` accepts (strict types: a wrong type is a 400, not a guess),
and how each becomes `SamplingParams`. Unknown fields are ignored, as OpenAI-compatible servers do;
features ecru does not serve (n > 1, logprobs, tools, echo) are refused with a 400 rather than ignored."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from ecru.serve.sampling import SamplingParams


class APIError(Exception):
    """An error answered as OpenAI's body {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    @property
    def type(self) -> str:
        return {400: "invalid_request_error", 404: "invalid_request_error"}.get(self.status, "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class TextPart(_Strict):
    type: str
    text: str


class ChatMessage(_Strict):
    role: str
    content: str | list[TextPart] | None = None

    def to_template(self) -> dict:
        content = self.content
        if isinstance(content, list):
            if any(p.type != "text" for p in content):
                raise APIError(400, "only text content parts are supported", param="messages")
            content = "".join(p.text for p in content)
        return {"role": self.role, "content": content or ""}


class _Sampling(_Strict):
    """Fields shared by both endpoints."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool = False
    stream_options: dict | None = None
    n: int = 1
    logprobs: bool | int | None = None
    user: str | None = None

    def refuse_unsupported(self) -> None:
        if self.n != 1:
            raise APIError(400, f"n={self.n} is not supported; ask for one choice (n=1)", param="n")
        if self.logprobs:
            raise APIError(400, "logprobs are not supported", param="logprobs")

    def sampling(self, *, max_tokens: int) -> SamplingParams:
        """The request's `SamplingParams` (OpenAI's defaults: temperature 1, top_p 1), ValueError -> 400."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        values = {
            "max_tokens": max_tokens,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "top_k": self.top_k or 0,
            "seed": self.seed,
            "stop": tuple(stop),
            "presence_penalty": self.presence_penalty or 0.0,
            "frequency_penalty": self.frequency_penalty or 0.0,
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
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    tools: list | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if not self.messages:
            raise APIError(400, "messages is empty: give at least one message", param="messages")
        if self.tools:
            raise APIError(400, "tools are not supported", param="tools")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Sampling):
    prompt: str | list[str]
    echo: bool = False
    suffix: str | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if isinstance(self.prompt, list) and len(self.prompt) != 1:
            raise APIError(400, "give one prompt per request (a string)", param="prompt")
        if not self.text:
            raise APIError(400, "prompt is empty", param="prompt")
        if self.echo or self.suffix:
            raise APIError(400, "echo and suffix are not supported", param="echo" if self.echo else "suffix")

    @property
    def text(self) -> str:
        return self.prompt[0] if isinstance(self.prompt, list) else self.prompt

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens
