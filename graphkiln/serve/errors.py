"""The serve package's errors: ``ApiError`` (an HTTP error in OpenAI's body) and the few that
several route families raise with the same words.

Every error is OpenAI's body ``{"error": {"message", "type", "param", "code"}}`` with one line of
message; ``param`` names the field as OpenAI writes it (``messages[0].content``).
"""

from __future__ import annotations

from fastapi.responses import JSONResponse

from graphkiln.serve import schemas as S

RETRY_AFTER_S = 1  # a full queue drains in about one request's time; clients back off from there


class ApiError(Exception):
    """An HTTP error in OpenAI's shape; ``message`` is one line."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return S.ErrorBody(error=S.ErrorDetail(message=self.message, type=self.type, param=self.param,
                                               code=self.code)).model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def clip(text: str, n: int = 200) -> str:
    """``text`` on one line, at most ``n`` characters (untrusted text quoted in a message)."""
    return " ".join(str(text).split())[:n]


def shutting_down() -> ApiError:
    return ApiError(503, "the server is shutting down: retry on another instance", "server_error",
                    code="shutting_down")


def unknown_model(name: str, served: str, lora: bool) -> ApiError:
    """OpenAI's (and vLLM's) answer to a model it does not serve: 404, code model_not_found."""
    also = " or a loaded LoRA adapter" if lora else ""
    return ApiError(404, f"model '{clip(name, 80)}' is not served here: use '{served}'{also} (GET /v1/models)",
                    param="model", code="model_not_found")
