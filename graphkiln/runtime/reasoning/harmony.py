"""gpt-oss's harmony format: messages in channels, the thinking on ``analysis``.

An assistant turn is a sequence of messages, each ``<|channel|>NAME[ to=RECIPIENT][ <|constrain|>TYPE]
<|message|>BODY`` ended by ``<|end|>`` (then ``<|start|>assistant`` opens the next), ``<|return|>``
(the turn's end) or ``<|call|>`` (a tool call's end). Every marker is a special token, which
decoding drops from the text, so the session reads markers by token id. The chat template's
generation prompt ends with ``<|start|>assistant``: the output starts in a message header.

What goes where: ``analysis`` bodies are reasoning; ``final`` bodies content; a ``commentary``
message with a recipient (``to=functions.NAME``: a tool call) is passed on as content in its raw
form, markers written out, for the tool-call format to parse; other commentary (a preamble) is
content. Text outside any message (a model that ignores the format) is content.
"""

from __future__ import annotations

from graphkiln.runtime.reasoning.base import ReasoningFormat, ReasoningSession, Split

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, RETURN, CALL = "<|end|>", "<|return|>", "<|call|>"
MARKERS = (START, CHANNEL, MESSAGE, CONSTRAIN, END, RETURN, CALL)


def _channel(header: str) -> tuple[str, bool]:
    """(channel name, has a recipient) of a message header (the text from its <|start|> or
    <|channel|> to its <|message|>, markers written out)."""
    after = header.rsplit(CHANNEL, 1)[-1] if CHANNEL in header else ""
    name = after.split(CONSTRAIN)[0].split()[0] if after.split() else ""
    return name, "to=" in header


class HarmonySession(ReasoningSession):
    def __init__(self, markers: dict[int, str], prompt: str) -> None:
        self.markers = markers
        tail = prompt.rsplit(START, 1)[-1] if START in prompt else ""
        # "header": between a message's start and its <|message|>; "body"; "outside": after its end
        self.state, self.header, self.kind, self.generated = "outside", "", "content", ""
        if START in prompt:
            if MESSAGE in tail:  # the template opened the message's body itself
                self.state, self.kind = "body", self._kind(tail.split(MESSAGE)[0])
            else:
                self.state, self.header = "header", START + tail

    @staticmethod
    def _kind(header: str) -> str:
        name, recipient = _channel(header)
        if recipient:
            return "raw"
        return "reasoning" if name == "analysis" else "content"

    def _text(self, text: str) -> Split:
        if self.state == "header":
            self.header += text
            self.generated += text
            return Split()
        if self.state == "body" and self.kind == "reasoning":
            return Split(reasoning=text)
        return Split(content=text)

    def feed(self, text: str, token_id: int = -1) -> Split:
        out = self._text(text) if text else Split()
        marker = self.markers.get(token_id)
        if marker is None:
            return out
        if marker in (START, CHANNEL, CONSTRAIN):
            if self.state != "header":
                self.state, self.header, self.generated = "header", "", ""
            self.header += marker
        elif marker == MESSAGE and self.state == "header":
            self.state, self.kind = "body", self._kind(self.header)
            if self.kind == "raw":
                out += Split(content=self.header + MESSAGE)
        elif marker in (END, RETURN, CALL) and self.state == "body":
            if self.kind == "raw":
                out += Split(content=marker)
            self.state = "outside"
        return out

    def finish(self) -> Split:
        # a header never closed by <|message|>: the model wrote text outside the format
        rest, self.generated = (self.generated, "") if self.state == "header" else ("", "")
        return Split(content=rest)


class Harmony(ReasoningFormat):
    name = "harmony"
    aliases = ("gpt_oss", "openai_gptoss")
    tools_see_reasoning = True  # runtime.tools.harmony: its grammar and parser cover the analysis channel

    @classmethod
    def detects(cls, template: str) -> bool:
        return CHANNEL in template and MESSAGE in template

    def session(self, prompt: str) -> HarmonySession:
        return HarmonySession({i: m for m, i in self.specials.items() if m in MARKERS}, prompt)

    def frame(self, prompt: str) -> str:
        tail = prompt.rsplit(START, 1)[-1] if START in prompt else ""
        if MESSAGE in tail:  # already inside a message's body
            return "start: @constraint\n"
        c, m, e, s = (self.literal(x) for x in (CHANNEL, MESSAGE, END, START))
        return (f'start: analysis? {c} "final" {m} @constraint\n'
                f'analysis: {c} "analysis" {m} ANALYSIS {e} {s} "assistant"\n'
                "ANALYSIS: /(.|\\n)*/\n")
