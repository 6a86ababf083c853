"""Module-name patterns a quantization_config gives (``modules_to_not_convert``, compressed-tensors'
``ignore`` and ``targets``), evaluated as the libraries that write them do."""

from __future__ import annotations

import re

from graphkiln.models.hf_quantized.layout import refuse

def listed(module: str, pattern: str) -> bool:
    """transformers' rule for modules_to_not_convert (quantizers_utils.should_convert_module): the
    pattern matches from the start up to a module boundary, as a regex too, or is a suffix."""
    try:
        if re.match(rf"(?:{pattern})(?:(?<=\.)|(?=\.|$))", module):
            return True
    except re.error:
        pass
    return module.endswith(pattern)


def refuse_not_converted(method: str, modules: dict, names: list[str], key: str) -> None:
    """Refuse packed modules that ``key`` (modules_to_not_convert) says stay float."""
    for module in modules:
        hit = next((n for n in names if n and listed(module, n)), None)
        if hit is not None:
            raise refuse(method, f"'{module}' stores packed weights but {key} lists '{hit}'",
                          f"remove it from {key} in config.json, or re-quantize the checkpoint")
