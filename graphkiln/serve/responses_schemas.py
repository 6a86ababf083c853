"""``POST /v1/responses`` bodies: the request as the route parses it (strict, unknown fields a 400,
as the other routes), the response object and its stream events, in the OpenAI Responses API's
shapes (the ``openai`` client's ``types/responses``), function tools only.

Input items the route reads: messages (``type`` "message" or absent; roles user, system,
developer, assistant; content a string or ``input_text``/``output_text`` parts), ``function_call``
and ``function_call_output`` (a tool's result), ``reasoning`` (an earlier turn's thinking, given
back to the template as the next assistant message's ``reasoning_content``). Items that come
back from an earlier response (assistant messages, calls, reasoning) carry fields the route does
not need (``id``, ``status``, ``annotations``, ...): those are accepted and ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, StrictBool, StrictInt, StrictStr, Tag

from graphkiln.serve import schemas as S

_REQUEST = ConfigDict(extra="forbid", strict=True)
_ECHOED = ConfigDict(extra="ignore", strict=True)  # items a client hands back from an earlier response
MAX_ITEMS = 4096  # input items in one request: far above an agent's history in any artifact's context


TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")


class InputText(BaseModel):
    """A content part: text, or a kind the route refuses by name (images, files, audio)."""
    model_config = _ECHOED
    type: Literal["input_text", "output_text", "text", "summary_text", "reasoning_text", "input_image", "input_file",
                  "input_audio", "refusal"]
    text: StrictStr = ""


class MessageItem(BaseModel):
    model_config = _ECHOED
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: StrictStr | list[InputText]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(BaseModel):
    model_config = _ECHOED
    type: Literal["function_call"]
    call_id: S.ToolCallId
    name: S.ToolName
    arguments: StrictStr  # JSON text of an object, as the response gave it


class FunctionCallOutputItem(BaseModel):
    model_config = _ECHOED
    type: Literal["function_call_output"]
    call_id: S.ToolCallId
    output: StrictStr | list[InputText]

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


class ReasoningItem(BaseModel):
    model_config = _ECHOED
    type: Literal["reasoning"]
    summary: list[InputText] = []
    content: list[InputText] | None = None

    def text(self) -> str:
        return "".join(p.text for p in (self.content or self.summary))


def _item_kind(value: Any) -> str:
    """The item's ``type`` (a message may leave it out, as OpenAI's EasyInputMessage does)."""
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", "message")
    return kind if kind in ("message", "function_call", "function_call_output", "reasoning") else "message"


InputItem = Annotated[Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
                      | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
                      | Annotated[ReasoningItem, Tag("reasoning")], Discriminator(_item_kind)]


class FunctionTool(BaseModel):
    """A function the model may call (Responses' flat shape: ``name`` beside ``type``)."""
    model_config = _REQUEST
    type: Literal["function"]
    name: S.ToolName
    description: StrictStr | None = None
    parameters: S.JsonObject | None = None
    strict: StrictBool | None = None


class NamedFunctionChoice(BaseModel):
    model_config = _REQUEST
    type: Literal["function"]
    name: S.ToolName


class TextFormatText(BaseModel):
    model_config = _REQUEST
    type: Literal["text"]


class TextFormatJsonObject(BaseModel):
    model_config = _REQUEST
    type: Literal["json_object"]


class TextFormatJsonSchema(BaseModel):
    """Responses' json_schema format: the chat route's ``json_schema`` object, flattened."""
    model_config = _REQUEST
    type: Literal["json_schema"]
    name: Annotated[StrictStr, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    schema_: S.JsonObject = Field(alias="schema")
    strict: StrictBool | None = None
    description: StrictStr | None = None


TextFormat = Annotated[TextFormatText | TextFormatJsonObject | TextFormatJsonSchema, Field(discriminator="type")]


class TextConfig(BaseModel):
    model_config = _REQUEST
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # accepted; nothing to tune here


class ReasoningConfig(BaseModel):
    model_config = _REQUEST
    # passed to the chat template as reasoning_effort (gpt-oss's template reads it)
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None  # accepted: the thinking is returned whole
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(BaseModel):
    """What the route takes. Stateless: ``store`` is accepted and always false in the response
    (nothing is kept, so nothing can be retrieved); ``previous_response_id`` and ``conversation``
    are a 400 (send the whole history as ``input``)."""

    model_config = _REQUEST

    model: Annotated[StrictStr, Field(min_length=1, max_length=256)]
    input: Annotated[StrictStr, Field(min_length=1)] | Annotated[list[InputItem], Field(min_length=1, max_length=MAX_ITEMS)]
    instructions: StrictStr | None = None
    tools: Annotated[list[FunctionTool], Field(max_length=S.MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    temperature: S.Temperature | None = None
    top_p: S.TopP | None = None
    stream: StrictBool = False
    store: StrictBool | None = None
    previous_response_id: StrictStr | None = None
    conversation: StrictStr | S.JsonObject | None = None
    include: Annotated[list[StrictStr], Field(max_length=16)] | None = None  # accepted; nothing more to include
    metadata: dict[StrictStr, Annotated[StrictStr, Field(max_length=512)]] | None = Field(None, max_length=16)
    truncation: Literal["auto", "disabled"] | None = None
    user: Annotated[StrictStr, Field(max_length=256)] | None = None
    safety_identifier: Annotated[StrictStr, Field(max_length=256)] | None = None
    prompt_cache_key: Annotated[StrictStr, Field(max_length=256)] | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    # graphkiln extensions (the chat route's): top_k, seed, stop strings, the template's own variables
    top_k: Annotated[StrictInt, Field(ge=0)] | None = None
    stop: S._Sampling.model_fields["stop"].annotation = None
    seed: Annotated[StrictInt, Field(ge=0, le=S.MAX_SEED)] | None = None
    chat_template_kwargs: S.JsonObject | None = None


# -- the response ---------------------------------------------------------------------------


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = []
    logprobs: list[Any] = []


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class OutputFunctionCall(BaseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class OutputReasoning(BaseModel):
    id: str
    type: Literal["reasoning"] = "reasoning"
    summary: list[Any] = []
    content: list[ReasoningText]
    status: Literal["in_progress", "completed", "incomplete"]


OutputItem = Annotated[OutputMessage | OutputFunctionCall | OutputReasoning, Field(discriminator="type")]


class InputTokensDetails(BaseModel):
    cached_tokens: int
    cache_write_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens", "content_filter"]


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: float
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    model: str
    output: list[OutputItem]
    error: dict[str, Any] | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str] = {}
    parallel_tool_calls: bool = True
    previous_response_id: None = None
    reasoning: dict[str, Any] | None = None
    store: Literal[False] = False
    temperature: float | None = None
    text: dict[str, Any] = {}
    tool_choice: Any = "auto"
    tools: list[dict[str, Any]] = []
    top_p: float | None = None
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None


class ResponseEvent(BaseModel):
    """One server-sent event of a streamed response (``type`` names it, as the event's ``event:``
    line does): response.created / in_progress / completed / incomplete (``response``),
    response.output_item.added / done (``item``), response.content_part.added / done (``part``),
    response.output_text.delta / done, response.reasoning_text.delta / done,
    response.function_call_arguments.delta / done; each with its ``sequence_number``."""

    model_config = ConfigDict(extra="allow")
    type: str
    sequence_number: int
