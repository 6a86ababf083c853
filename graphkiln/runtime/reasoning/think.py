"""``<think>…</think>``: Qwen3, DeepSeek-R1, QwQ, SmolLM3 (vLLM's ``qwen3``/``deepseek_r1``
reasoning parsers, llama.cpp's ``deepseek`` reasoning format).

Where the output starts: a generation prompt that ends with ``<think>`` (DeepSeek-R1's template,
Qwen3-Thinking's) starts it inside the thinking, which then runs to ``</think>``; otherwise the
output is thinking only if it opens with ``<think>`` (after whitespace: Qwen3 with
``enable_thinking``), else all content (Qwen3 with ``enable_thinking: false``, whose template writes
an empty ``<think>\\n\\n</think>`` itself). Whitespace between ``</think>`` and the answer is not
content. An output cut off inside the thinking is all reasoning.
"""

from __future__ import annotations

from graphkiln.runtime.reasoning.base import ReasoningFormat, ReasoningSession, Split, held

OPEN, CLOSE = "<think>", "</think>"
GAP = "{0,4}"  # whitespace the frame allows between </think> and the constrained answer


def opened(prompt: str) -> bool:
    """Whether the generation prompt leaves the model inside ``<think>``."""
    return prompt.rstrip().endswith(OPEN)


class ThinkSession(ReasoningSession):
    def __init__(self, inside: bool) -> None:
        # "start": before a possible <think>; "reasoning"; "gap": whitespace after </think>; "content"
        self.state = "reasoning" if inside else "start"
        self.buf = ""

    def feed(self, text: str, token_id: int = -1) -> Split:
        self.buf += text
        reasoning = content = ""
        while self.buf:
            if self.state == "start":
                rest = self.buf.lstrip()
                if rest.startswith(OPEN):
                    self.buf, self.state = rest[len(OPEN):], "reasoning"
                elif OPEN.startswith(rest):  # blank, or a part of <think>: wait
                    break
                else:
                    self.state = "content"
            elif self.state == "reasoning":
                end = self.buf.find(CLOSE)
                if end >= 0:
                    reasoning += self.buf[:end]
                    self.buf, self.state = self.buf[end + len(CLOSE):], "gap"
                    continue
                keep = held(self.buf, CLOSE)
                reasoning += self.buf[:len(self.buf) - keep]
                self.buf = self.buf[len(self.buf) - keep:]
                break
            elif self.state == "gap":
                self.buf = self.buf.lstrip()
                if self.buf:
                    self.state = "content"
            else:
                content, self.buf = content + self.buf, ""
        return Split(reasoning, content)

    def finish(self) -> Split:
        rest, self.buf = self.buf, ""
        if self.state == "reasoning":
            return Split(reasoning=rest)
        return Split(content=rest.strip() if self.state in ("start", "gap") and not rest.strip() else rest)


class Think(ReasoningFormat):
    name = "think"
    aliases = ("qwen3", "deepseek_r1")

    @classmethod
    def detects(cls, template: str) -> bool:
        return OPEN in template and CLOSE in template

    def session(self, prompt: str) -> ThinkSession:
        return ThinkSession(opened(prompt))

    def frame(self, prompt: str) -> str:
        # lazy: the thinking ends at the first </think> (a greedy match would let it run past one)
        rest = f"think_rest[lazy]: /(.|\\n)*/ {self.literal(CLOSE)}\n"
        gap = f"GAP: /[ \\t\\n]{GAP}/\n"
        if opened(prompt):
            return f"start: think_rest GAP @constraint\n{rest}{gap}"
        return f"start: (think GAP)? @constraint\nthink: /[ \\n]{GAP}/ {self.literal(OPEN)} think_rest\n{rest}{gap}"
