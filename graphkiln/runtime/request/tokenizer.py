"""Text <-> token ids with the ``tokenizers`` library, plus incremental detokenization."""

from __future__ import annotations

from pathlib import Path

from graphkiln.errors import GraphkilnError


def check_text(text, what: str = "prompt") -> None:
    """Refuse what the tokenizer cannot take as one GraphkilnError line: anything but a str, and
    a str holding lone surrogates (how Python carries bytes that were not UTF-8, e.g. a
    ``--prompt`` argument in Latin-1, or a JSON ``\\udce9`` escape)."""
    if not isinstance(text, str):
        raise GraphkilnError(f"{what} must be text (str), got {type(text).__name__}: decode bytes to str first")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise GraphkilnError(f"{what} is not valid Unicode text: character {exc.start} is a lone surrogate "
                             f"({text[exc.start]!r}; bytes that were not UTF-8 become these): pass UTF-8 text") from None


class Tokenizer:
    def __init__(self, path: Path) -> None:
        self.path = path  # tokenizer.json (structured output builds its own view of it: request.constraint)
        from tokenizers import Tokenizer as HFTokenizer

        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as exc:
            raise GraphkilnError(f"cannot read {path.name} ({exc}): re-export the artifact") from None

    @property
    def backend(self):
        """The ``tokenizers.Tokenizer`` itself, for what reads its pipeline (the server's prompt bound)."""
        return self._tok

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        check_text(text)
        # encode_batch releases the GIL while it works; encode holds it (7 s for 7 MB of text,
        # during which every other thread of the process stalls)
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def token_text(self, token_id: int) -> str | None:
        """A token's own text (special tokens included, e.g. ``<image>``), not its decoding; None if unknown."""
        return self._tok.id_to_token(token_id)


class IncrementalDetokenizer:
    """Turns one request's growing token list into text a piece at a time.

    Decoding every token again at each step costs O(n) per token. Only the tokens since the
    last piece are decoded, together with the piece's own tokens as left context (decoders
    that strip a leading space from the first token, or merge bytes, then treat the new
    tokens as they would in the full sequence); the new text is the difference. A piece that
    ends in an incomplete UTF-8 character waits for the next token, unless ``final``.
    Invariant: the pieces joined equal ``decode(ids)`` whenever a piece boundary falls on a
    character boundary, which waiting for complete characters ensures.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self._prefix = 0  # first token of the left context
        self._read = 0  # first token not yet turned into text
        self._prefix_text = ""

    def step(self, ids: list[int], final: bool = False) -> str:
        text = self._tok.decode(ids[self._prefix:])
        if len(text) <= len(self._prefix_text) and not final:
            return ""
        if text.endswith("\ufffd") and not final:
            return ""
        piece = text[len(self._prefix_text):]
        self._prefix, self._read = self._read, len(ids)
        self._prefix_text = self._tok.decode(ids[self._prefix:self._read])
        return piece
