"""The manifest's vocabulary: format versions, tensor roles, graph names, dimension names, targets.

What a reader understands; a manifest naming anything else is refused (``manifest.specs``).
"""

from __future__ import annotations

import re
from typing import Literal

FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)  # format 1 had states[].update (see the module docstring)
MANIFEST_NAME = "manifest.json"
MAX_MANIFEST_BYTES = 16 << 20  # a 100-layer model's manifest is ~100 KB; refuse to read a huge one into memory

# What the runtime understands; anything else in a manifest is refused (see the validators below).
STATE_KINDS = ("kv", "conv", "recurrent")
KV_ROLES = ("past_key", "past_value", "new_key", "new_value", "present_key", "present_value")
CONV_ROLES = ("conv_state", "new_conv_state")
# a linear-recurrent layer's matrix state (gated delta net, Mamba-2): a pool [slots, heads, rows, cols]
RECURRENT_ROLES = ("recurrent_state", "new_recurrent_state")
# per-slot states (conv, recurrent): the input role -> the output role that updates it
SLOT_STATE_ROLES = {"conv_state": "new_conv_state", "recurrent_state": "new_recurrent_state"}
SLOT_STATE_INPUTS = {out: inp for inp, out in SLOT_STATE_ROLES.items()}  # the other way round
# LoRA (``LoraSpec``): per targeted projection of a layer, the adapter slots' stacks (``module`` names
# the projection), and per row the slot it uses
LORA_STACK_ROLES = ("lora_a", "lora_b")
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
INPUT_ROLES = ("hidden_states", "input_ids", "position_ids", "logits_index", "vision_embeddings", "vision_scatter_indices", "seq_lens",
               "slot_idx", "past_key", "past_value", "conv_state", "recurrent_state", "total_sequence_length",
               "window_offset", "window_total_sequence_length", "pixel_values",
               "image_grid_thw", "rope_position_ids", "lookahead", "patch_positions", "window_groups", "window_slots",
               "image_groups", "image_slots", "lora_rows", "lora_slots", "lora_a", "lora_b")
OUTPUT_ROLES = ("hidden_states", "logits", "next_token", "last_hidden_state", "new_key", "new_value", "new_conv_state",
                "new_recurrent_state", "present_key", "present_value", "image_embeddings")
# ``last_hidden_state`` (export --return-hidden-states): the last layer's hidden states AFTER the final
# norm (transformers' ``last_hidden_state`` == ``hidden_states[-1]``), [batch, n_logits, hidden] in the
# model dtype, at the logits_index positions; ``hidden_states`` is a pipeline stage's pre-norm residual
# stream, which a later stage takes as its input.
# graph name -> (input roles, output roles) it may have; "vision" is a vision-language model's encoder:
# preprocessed pixels (graphkiln.imaging) -> one embedding row per placeholder token, in decoder hidden size
GRAPH_ROLES = {
    "decoder": (("input_ids", "position_ids", "logits_index", "vision_embeddings", "vision_scatter_indices", "seq_lens",
                 "slot_idx", "past_key", "past_value", "conv_state", "recurrent_state", "total_sequence_length",
                 "window_offset", "window_total_sequence_length", "rope_position_ids", "lookahead", "lora_rows", "lora_slots", "lora_a", "lora_b"),
                ("logits", "next_token", "last_hidden_state", "new_key", "new_value", "new_conv_state",
                 "new_recurrent_state", "present_key", "present_value")),
    # patch_positions .. image_slots: a windowed tower's patch grid and attention groups (runtime.backends.vision_groups)
    "vision": (("pixel_values", "image_grid_thw", "patch_positions", "window_groups", "window_slots", "image_groups",
                "image_slots"), ("image_embeddings",)),
}
# A pipeline stage's decoder graph (``stages``, export.stages): named stage0, stage1, ...; a decoder
# graph whose first input may be the previous stage's hidden_states and whose output, but for
# the last stage, is hidden_states [batch, seq, hidden] instead of logits.
STAGE_GRAPH = re.compile(r"stage[0-9]{1,4}")


def graph_roles(name: str) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
    """(input roles, output roles) a graph named ``name`` may have; None for a name no runtime runs."""
    if STAGE_GRAPH.fullmatch(name):
        ins, outs = GRAPH_ROLES["decoder"]
        return ("hidden_states",) + ins, ("hidden_states",) + outs
    return GRAPH_ROLES.get(name)


# symbolic dimensions; the runtime sizes the outputs it allocates from the first three
DIM_NAMES = ("batch", "seq", "n_logits", "cache_len", "slots", "vision_rows", "images", "patches", "image_rows",
             "windows", "image_patches", "lora_rows")
ALLOCATED_DIMS = ("batch", "seq", "n_logits")

TARGETS = ("portable", "onnxruntime", "tensorrt")
Target = Literal[TARGETS]  # type: ignore[valid-type]
# backend -> graph targets it runs, best first (Manifest.graph_for)
BACKEND_TARGETS = {"onnxruntime": ("onnxruntime", "portable", "tensorrt"), "tensorrt": ("tensorrt",)}

# state kind -> the update modes a graph may use for it (``manifest.specs.state_update``)
UPDATES = {"kv": ("scatter_rows", "in_place"), "conv": ("slot_rows", "in_place"), "recurrent": ("slot_rows", "in_place")}
