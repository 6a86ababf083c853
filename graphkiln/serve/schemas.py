"""Request and response bodies of the OpenAI-compatible routes (pydantic, OpenAI's shapes).

Requests are untrusted: every model is strict about types (``"max_tokens": "8"`` or ``true`` is
refused, not coerced), forbids unknown fields (a misspelt ``max_token`` would otherwise be
silently ignored), and bounds every number. Fields OpenAI defines that graphkiln does not
implement are accepted only at their neutral value (``presence_penalty: 0``, ``echo: false``,
``n: 1``, ...), so a client that sends its defaults works and one that asks for the feature gets
a 400 naming the field. Responses are built as these models and dumped to JSON as they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, field_validator,
                      model_validator)

from graphkiln.errors import GraphkilnError
from graphkiln.runtime.request.speculate import parse_speculative

# OpenAI's own bounds, where it has them (temperature 0..2, top_logprobs 0..20, 4 stop strings).
MAX_STOPS = 4
MAX_STOP_CHARS = 256
MAX_TOP_LOGPROBS = 20
MAX_SEED = 2**63 - 1

Number = StrictInt | StrictFloat
# bounds on each member, so the JSON schema (/openapi.json) carries them as minimum/maximum
Temperature = Annotated[StrictInt, Field(ge=0, le=2)] | Annotated[StrictFloat, Field(ge=0, le=2, allow_inf_nan=False)]
TopP = Annotated[StrictInt, Field(gt=0, le=1)] | Annotated[StrictFloat, Field(gt=0, le=1, allow_inf_nan=False)]
_REQUEST = ConfigDict(extra="forbid", strict=True)


def _neutral(value: Any, neutral: tuple, name: str) -> Any:
    if value not in neutral:
        raise ValueError(f"{name} is not supported by graphkiln serve; leave it out (or {neutral[0]!r})")
    return value


class StreamOptions(BaseModel):
    model_config = _REQUEST
    include_usage: StrictBool = False


# -- structured output ---------------------------------------------------------------------
# OpenAI's response_format and vLLM's extensions (guided_json/guided_regex/guided_grammar, and the
# newer structured_outputs) on both generation routes, each one of the engine's constraints
# (GenerationConfig.json_schema/regex/grammar); a request sets at most one (the route refuses two).

JsonObject = dict[StrictStr, Any]  # a JSON Schema as a JSON object


class ResponseFormatText(BaseModel):
    """OpenAI's default: free text."""
    model_config = _REQUEST
    type: Literal["text"]


class ResponseFormatJsonObject(BaseModel):
    """OpenAI's JSON mode: the output is one JSON object (any)."""
    model_config = _REQUEST
    type: Literal["json_object"]


class JsonSchemaFormat(BaseModel):
    """OpenAI's ``response_format.json_schema``: the output is JSON valid against ``schema``
    (always enforced, ``strict`` or not)."""
    model_config = _REQUEST
    name: Annotated[StrictStr, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    description: StrictStr | None = None
    # "schema" would shadow BaseModel.schema: the field is schema_, its JSON name "schema"
    schema_: JsonObject = Field(alias="schema")
    strict: StrictBool | None = None


class ResponseFormatJsonSchema(BaseModel):
    model_config = _REQUEST
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


ResponseFormat = Annotated[ResponseFormatText | ResponseFormatJsonObject | ResponseFormatJsonSchema,
                           Field(discriminator="type")]
NonEmpty = Annotated[StrictStr, Field(min_length=1)]


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs``: exactly one of ``json`` (a JSON Schema, or its JSON text),
    ``regex``, ``grammar`` (Lark, llguidance's dialect)."""
    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra={"minProperties": 1})
    json_: JsonObject | StrictStr | None = Field(default=None, alias="json")
    regex: NonEmpty | None = None
    grammar: NonEmpty | None = None

    @model_validator(mode="after")
    def _exactly_one(self):
        given = [k for k, v in (("json", self.json_), ("regex", self.regex), ("grammar", self.grammar)) if v is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of json, regex, grammar (got {', '.join(given) or 'none'})")
        return self


@dataclass(frozen=True)
class OutputConstraint:
    """One constraint a request asked for: ``field`` the GenerationConfig field it sets, ``value``
    its value, ``param`` the request field that gave it, as OpenAI writes it."""
    field: str
    value: Any
    param: str


class _Sampling(BaseModel):
    """What both routes share: sampling, stops, length, streaming, structured output."""

    model_config = _REQUEST

    model: Annotated[StrictStr, Field(min_length=1, max_length=256)]
    max_tokens: Annotated[StrictInt, Field(ge=0)] | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: Annotated[StrictInt, Field(ge=0)] | None = None  # vLLM's extension; 0 disables it
    n: Annotated[StrictInt, Field(ge=1, le=1)] = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: Annotated[StrictStr, Field(min_length=1, max_length=MAX_STOP_CHARS)] | Annotated[
        list[Annotated[StrictStr, Field(min_length=1, max_length=MAX_STOP_CHARS)]], Field(max_length=MAX_STOPS)] | None = None
    seed: Annotated[StrictInt, Field(ge=0, le=MAX_SEED)] | None = None
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    logit_bias: dict[StrictStr, Number] | None = None
    user: Annotated[StrictStr, Field(max_length=256)] | None = None
    # graphkiln extensions (vLLM's names): also return the prompt's and the choice's token ids;
    # do not stop at the model's EOS tokens (benchmarks want exactly max_tokens)
    return_token_ids: StrictBool = False
    ignore_eos: StrictBool = False
    # structured output, at most one of them (constraints): OpenAI's, then vLLM's names
    response_format: ResponseFormat | None = None
    guided_json: JsonObject | StrictStr | None = None
    guided_regex: NonEmpty | None = None
    guided_grammar: NonEmpty | None = None
    structured_outputs: StructuredOutputs | None = None
    # graphkiln extension: this request's speculative decoding, over the server's --speculative
    # (runtime.request.speculate); greedy output is the same with it, sampled keeps its distribution
    speculative: Annotated[StrictStr, Field(max_length=16, examples=["ngram:4", "draft", "off"])] | None = None

    @field_validator("speculative")
    @classmethod
    def _speculation(cls, v):
        try:
            parse_speculative(v)
        except GraphkilnError as exc:  # pydantic reports ValueErrors as the field's error
            raise ValueError(str(exc)) from None
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, v, info):
        return _neutral(v, (None, 0, 0.0), info.field_name)

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, v, info):
        return _neutral(v or None, (None,), info.field_name)

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def constraints(self) -> list[OutputConstraint]:
        """Every output constraint the request sets (a route refuses more than one)."""
        out = []
        fmt = self.response_format
        if isinstance(fmt, ResponseFormatJsonObject):
            out.append(OutputConstraint("json_schema", {"type": "object"}, "response_format"))
        elif isinstance(fmt, ResponseFormatJsonSchema):
            out.append(OutputConstraint("json_schema", fmt.json_schema.schema_, "response_format.json_schema.schema"))
        for field, name in (("json_schema", "guided_json"), ("regex", "guided_regex"), ("grammar", "guided_grammar")):
            if getattr(self, name) is not None:
                out.append(OutputConstraint(field, getattr(self, name), name))
        so = self.structured_outputs
        if so is not None:
            for field, name, value in (("json_schema", "json", so.json_), ("regex", "regex", so.regex),
                                       ("grammar", "grammar", so.grammar)):
                if value is not None:
                    out.append(OutputConstraint(field, value, f"structured_outputs.{name}"))
        return out


TokenIds = Annotated[list[Annotated[StrictInt, Field(ge=0)]], Field(min_length=1)]


MAX_PROMPTS = 64  # prompts in one /v1/completions request: one choice each


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: a prompt, text or token ids, or a list of prompts of one kind
    (one choice each, ``index`` in order; as evaluation harnesses batch their requests)."""

    prompt: StrictStr | TokenIds | Annotated[list[StrictStr], Field(min_length=1, max_length=MAX_PROMPTS)] | Annotated[
        list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)]
    logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    # the prompt before the completion in text and logprobs (the first token's logprob null), as
    # evaluation harnesses score prompts: echo, logprobs N, max_tokens 0 or 1
    echo: StrictBool = False
    best_of: StrictInt | None = None
    suffix: StrictStr | None = None

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, v, info):
        return _neutral(v, (None, 1), info.field_name)

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v, info):
        return _neutral(v or None, (None,), info.field_name)

    @property
    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        return list(p) if isinstance(p, list) and isinstance(p[0], (str, list)) else [p]


class TextPart(BaseModel):
    model_config = _REQUEST
    type: Literal["text"]
    text: StrictStr


# -- tool calling ----------------------------------------------------------------------------
# OpenAI's tools (functions only), tool_choice, parallel_tool_calls; assistant messages' tool_calls
# and tool messages' tool_call_id in the history (graphkiln.serve.chat checks how they pair up).

MAX_TOOLS = 128  # OpenAI's own limit on tools in one request
ToolName = Annotated[StrictStr, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
ToolCallId = Annotated[StrictStr, Field(min_length=1, max_length=256)]


class FunctionDefinition(BaseModel):
    """A function the model may call: ``parameters`` the JSON Schema of its arguments (an object
    schema; absent: no arguments). ``strict``: see docs/serving.md (tool calling)."""
    model_config = _REQUEST
    name: ToolName
    description: StrictStr | None = None
    parameters: JsonObject | None = None
    strict: StrictBool | None = None


class ToolDefinition(BaseModel):
    model_config = _REQUEST
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = _REQUEST
    name: ToolName


class NamedToolChoice(BaseModel):
    """``tool_choice`` naming one function: the reply is a call of it."""
    model_config = _REQUEST
    type: Literal["function"]
    function: NamedFunction


class CalledFunction(BaseModel):
    model_config = _REQUEST
    name: ToolName
    arguments: StrictStr  # JSON text of an object, as the API returned it


class MessageToolCall(BaseModel):
    """A call an earlier assistant turn made (as the API returned it)."""
    model_config = _REQUEST
    id: ToolCallId
    type: Literal["function"]
    function: CalledFunction


class ChatMessage(BaseModel):
    # Messages may carry fields a template reads (name, ...): kept, passed through.
    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None
    tool_calls: Annotated[list[MessageToolCall], Field(max_length=MAX_TOOLS)] | None = None  # assistant's
    tool_call_id: ToolCallId | None = None  # a tool message's: the call it answers

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it: ``content`` one string (text parts joined)."""
        out = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            out["content"] = "".join(p.text for p in self.content)
        out.setdefault("content", "")
        return out


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[StrictInt, Field(ge=0)] | None = None
    tools: Annotated[list[ToolDefinition], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    # the chat template's own variables (vLLM's): enable_thinking, ...; never messages,
    # add_generation_prompt or the special tokens (chat_template.RESERVED)
    chat_template_kwargs: JsonObject | None = None
    # passed to the template as reasoning_effort (gpt-oss's reads it; OpenAI's field)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    logprobs: StrictBool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None

    @property
    def new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# -- responses ----------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose state came from the prefix cache


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = PromptTokensDetails()


class CompletionLogprobs(BaseModel):
    """The legacy completions shape: parallel lists, one entry per token."""

    tokens: list[str] = []
    token_logprobs: list[float | None] = []  # None: an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]
    refusal: list[ChatTokenLogprob] | None = None


class ToolCallFunction(BaseModel):
    name: str
    arguments: str  # JSON text of an object valid against the tool's parameters


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None  # null when the reply is only tool calls
    tool_calls: list[ToolCall] | None = None  # absent from the JSON when there are none
    reasoning_content: str | None = None  # the thinking (runtime.reasoning); absent when there is none


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: list[int] | None = None


class ToolCallDeltaFunction(BaseModel):
    name: str | None = None  # in a call's first delta only
    arguments: str | None = None  # fragments: joined, the call's arguments


class ToolCallDelta(BaseModel):
    """One piece of a streamed call, OpenAI's: the first has ``id``, ``type`` and the name (and
    empty arguments), the next the arguments; absent fields are left out of the JSON."""
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: ToolCallDeltaFunction


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None  # absent from the JSON when there are none
    reasoning_content: str | None = None  # a piece of the thinking; absent when there is none


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    """One served model: the base model (``parent`` null) or a LoRA adapter over it (vLLM's
    convention: ``root`` the adapter's path, ``parent`` the base model's id)."""
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "graphkiln"
    root: str | None = None
    parent: str | None = None
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok", "draining"]


class TokenizeRequest(BaseModel):
    """``POST /tokenize`` (vLLM's route, which lm-evaluation-harness's remote tokenizer calls)."""
    model_config = _REQUEST
    model: StrictStr | None = None
    prompt: StrictStr
    add_special_tokens: StrictBool = True


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(BaseModel):
    model_config = _REQUEST
    model: StrictStr | None = None
    tokens: list[Annotated[StrictInt, Field(ge=0)]]


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizerInfo(BaseModel):
    """``GET /tokenizer_info``: the special tokens and chat template a client-side tokenizer needs."""
    bos_token: str | None
    eos_token: str | None
    pad_token: str | None
    chat_template: str | None
    model_max_length: int
    vocab_size: int


# LoRA adapter names: what a request's ``model`` names, so the same bound as ``model``; paths as
# the server's file system spells them (no NUL: no OS takes one)
AdapterName = Annotated[StrictStr, Field(min_length=1, max_length=256)]


class LoadLoraAdapterRequest(BaseModel):
    """``POST /v1/load_lora_adapter`` (vLLM's route and field names): load the PEFT adapter
    directory ``lora_path`` (on the server's file system) and serve it as model ``lora_name``."""
    model_config = _REQUEST
    lora_name: AdapterName
    lora_path: Annotated[StrictStr, Field(min_length=1, max_length=4096)]

    @field_validator("lora_path")
    @classmethod
    def _no_nul(cls, v):
        if "\x00" in v:
            raise ValueError("a path cannot hold a NUL character")
        return v


class UnloadLoraAdapterRequest(BaseModel):
    """``POST /v1/unload_lora_adapter``: stop serving adapter ``lora_name`` and free its slot."""
    model_config = _REQUEST
    lora_name: AdapterName


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    error: ErrorDetail
