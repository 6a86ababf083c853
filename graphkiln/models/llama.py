"""LlamaForCausalLM: the reference dense decoder (GQA, optional attention/MLP bias)."""

from graphkiln.models.config import parse_dense
from graphkiln.models.registry import ModelFamily, register

FAMILY = register(ModelFamily("LlamaForCausalLM", lambda raw: parse_dense(raw, "LlamaForCausalLM")))
