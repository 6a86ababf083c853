"""``graphkiln.ShortConv``: causal depthwise short convolution over new tokens with a state pool.

x [B, S, C] (right-padded rows), weight [C, K], bias [C] (zeros when the layer has none),
state_pool [slots, C, K-1], slot_idx [B] (row b's slot), seq_lens [B] (row b's real tokens)
-> y [B, S, C] and, by ``state_update``:
  0 (default): new_state [B, C, K-1], row b's new state; the caller writes the rows back into
     ``state_pool[slot_idx]``.
  1: new_state [slots, C, K-1], the whole pool with row slot_idx[b] replaced by row b's new
     state (other slots unchanged). TensorRT's plugin aliases it to state_pool and writes the
     rows in place; onnxruntime runs the function's ScatterND into the pool's own buffer when
     the runtime binds new_state to it (``graphkiln.runtime.backends.ort_cpu``).

State convention: a slot holds the last K-1 *inputs* of the convolution, oldest first —
the minimum that determines future outputs, and what onnxruntime's CausalConvWithState
keeps (transformers' LFM2 cache keeps K columns; the first is never read). Row b's output
at step t is bias + sum_j weight[:, j] * ext[b, :, t + j] with ext = state ++ x; its new
state is ext[b, :, len_b : len_b + K-1], so padding after a row's real tokens never enters
the state. slot_idx holds distinct slots.
"""

from __future__ import annotations

from graphkiln.ops import slot_state
from graphkiln.ops.spec import AttrSpec, CustomOpSpec

SPEC = CustomOpSpec(
    name="ShortConv",
    torch_name="short_conv",
    inputs=("x", "weight", "bias", "state_pool", "slot_idx", "seq_lens"),
    outputs=("y", "new_state"),
    attributes=(
        AttrSpec("channels", "int", "C; the depthwise convolution's group count"),
        AttrSpec("state_update", "int", "0: return the new rows; 1: return the whole pool with them written in place",
                 default=0),
    ),
    output_dtypes_from=("x", "state_pool"),
    doc=__doc__,
)

# The attribute that makes new_state the whole (aliased) pool: 1 on every TensorRT node.
IN_PLACE_ATTR = "state_update"


def reference(x, weight, bias, state_pool, slot_idx, seq_lens, channels, state_update=0):
    import torch
    import torch.nn.functional as F

    state = state_pool.index_select(0, slot_idx).to(x.dtype)
    ext = torch.cat((state, x.transpose(1, 2)), dim=2)
    y = F.conv1d(ext, weight.unsqueeze(1), bias, groups=channels).transpose(1, 2).contiguous()
    width = state_pool.shape[2]
    idx = (seq_lens.unsqueeze(1) + torch.arange(width, device=x.device)).unsqueeze(1).expand(-1, ext.shape[1], -1)
    rows = torch.gather(ext, 2, idx).to(state_pool.dtype)
    return y, slot_state.new_state(state_pool, slot_idx, rows, state_update)


def fake(x, weight, bias, state_pool, slot_idx, seq_lens, channels, state_update=0):
    return x.new_empty(x.shape), slot_state.fake_new_state(state_pool, x.shape[0], state_update)


def onnx_function(opset: int):
    import onnxscript
    from onnx import TensorProto
    from onnxscript.values import Opset

    op = Opset("", opset)
    gk = Opset(SPEC.domain, SPEC.version)

    @onnxscript.script(gk, default_opset=op)
    def ShortConv(x, weight, bias, state_pool, slot_idx, seq_lens, channels: int, plugin_namespace: str,
                  plugin_version: str, state_update: int = 0):
        state = op.CastLike(op.Gather(state_pool, slot_idx, axis=0), x)  # [B, C, K-1]
        ext = op.Concat(state, op.Transpose(x, perm=[0, 2, 1]), axis=2)  # [B, C, K-1+S]
        kernel = op.Unsqueeze(op.CastLike(weight, x), op.Constant(value_ints=[1]))  # [C, 1, K]
        y = op.Conv(ext, kernel, op.CastLike(bias, x), group=channels)
        width = op.Shape(state_pool, start=2, end=3)
        steps = op.Range(op.Constant(value_int=0), op.Squeeze(width), op.Constant(value_int=1))
        lens = op.Cast(seq_lens, to=TensorProto.INT64)  # int32 indices are TensorRT's native type
        idx = op.Add(op.Unsqueeze(lens, op.Constant(value_ints=[1])), op.Unsqueeze(steps, op.Constant(value_ints=[0])))
        idx = op.Expand(op.Unsqueeze(idx, op.Constant(value_ints=[1])), op.Shape(state))
        rows = op.CastLike(op.GatherElements(ext, idx, axis=2), state_pool)
        # state_update is a constant once the function is inlined: onnxruntime folds the If.
        if op.Equal(op.Constant(value_int=state_update), op.Constant(value_int=1)):
            slots = op.Unsqueeze(op.Cast(slot_idx, to=TensorProto.INT64), op.Constant(value_ints=[1]))  # [B, 1]
            new_state = op.ScatterND(state_pool, slots, rows)  # reads the pool first: rows depend on it
        else:
            new_state = op.Identity(rows)
        return op.Transpose(y, perm=[0, 2, 1]), new_state

    return ShortConv.to_function_proto()
