"""Text <-> token ids with the ``tokenizers`` library, plus incremental detokenization."""

from __future__ import annotations

from pathlib import Path

from graphkiln.errors import GraphkilnError


class Tokenizer:
    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as exc:
            raise GraphkilnError(f"cannot read {path.name} ({exc}): re-export the artifact") from None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=True).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


def stable_text(text: str) -> str:
    """Text safe to emit while streaming: drop a trailing partial UTF-8 character."""
    return text[:-1] if text.endswith("\ufffd") else text
