"""The values of flags, checked as argparse parses them (``type=``) or as a command reads them:
each refusal names the flag and what it takes.
"""

from __future__ import annotations

import argparse
import math
import re

from graphkiln.errors import GraphkilnError
from graphkiln.untrusted import show


_IDS = re.compile(r"[0-9]+(?:\s*,\s*[0-9]+|\s+[0-9]+)*")


def parse_ids(text: str) -> list[int]:
    """'1,2,3' or '1 2 3': ASCII digits only (int() would take '١٢' and ' 1', and '1,,2' was
    read as 1,2), separated by one comma or by spaces."""
    if not _IDS.fullmatch(text.strip()):
        raise GraphkilnError(f"--prompt-ids {text!r} is not a list of token ids: write ASCII integers separated by "
                             "commas or spaces, e.g. '1,2,3'")
    return [int(t) for t in re.split(r"[\s,]+", text.strip())]


def int_at_least(low: int):
    """argparse type: an integer >= low (a negative --seed would crash numpy, --threads 0 would
    silently mean 'every core')."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"'{text}' is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {value}")
        return value
    return parse


_SIZE = re.compile(r"([0-9]+)([KMG]i?B?|B)?", re.IGNORECASE)


def byte_size(text: str) -> int:
    """argparse type: a number of bytes, plain or with a K/M/G suffix (powers of 1024: 512M, 2G)."""
    m = _SIZE.fullmatch(text.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"'{text}' is not a size: write bytes, or a number with K, M or G (e.g. 512M)")
    unit = (m.group(2) or "B")[0].upper()
    return int(m.group(1)) * {"B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[unit]


def number(low: float, high: float = math.inf, low_open: bool = False):
    """argparse type: a finite float in [low, high] ((low, high] with low_open); NaN and inf
    are refused (a NaN --temperature silently ran greedy)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"'{text}' is not a number") from None
        if not (math.isfinite(value) and (value > low if low_open else value >= low) and value <= high):
            bound = f"> {low:g}" if low_open else f">= {low:g}"
            upper = f" and <= {high:g}" if high != math.inf else ""
            raise argparse.ArgumentTypeError(f"must be a finite number {bound}{upper}, got {text}")
        return value
    return parse


def stop_string(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("needs a non-empty string (an empty stop string would stop after the first token)")
    return text


def lora_pair(text: str) -> tuple[str, str]:
    """argparse type of serve's --lora: NAME=DIR, both non-empty, NAME by the rule the load route
    applies too (``runtime.lora.check_adapter_name``: NAME is what clients send as model)."""
    from graphkiln.runtime.lora.targets import check_adapter_name

    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path:
        raise argparse.ArgumentTypeError(f"{show(text)} is not NAME=DIR: give the name clients send as 'model', "
                                         "'=', then the PEFT adapter directory, e.g. --lora sql=./adapters/sql")
    try:
        check_adapter_name(name)
    except GraphkilnError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return name, path


def sha256_hex(text: str) -> str:
    from graphkiln.artifact import is_sha256

    if not is_sha256(text):
        raise argparse.ArgumentTypeError(f"'{text}' is not a sha256 (64 hex digits): copy the digest line of 'graphkiln inspect'")
    return text.lower()


def port(text: str) -> int:
    value = int_at_least(0)(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port 0..65535, got {value}")
    return value


def check_utf8(flag: str, text: str | None) -> None:
    if text is None:
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:  # argv bytes that were not UTF-8 arrive as lone surrogates
        raise GraphkilnError(f"{flag} is not UTF-8 text (byte 0x{ord(text[exc.start]) - 0xDC00:02x} at "
                             f"character {exc.start}): convert it, e.g. with iconv -t UTF-8") from None
