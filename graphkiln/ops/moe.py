"""``graphkiln.MoE``: routed mixture of SwiGLU experts, routing included.

hidden [T, H], router_logits [T, E], gate_up [E, 2I, H] (gate rows then up rows),
down [E, H, I], expert_bias [E] (added to the scores for *selection* only; zeros when unused)
-> out [T, H] = sum over the top_k experts e of w_e * down_e(silu(gate_e x) * up_e x).

Routing (attributes): scores = softmax(logits) (scoring=0) or sigmoid(logits) (scoring=1);
experts = top_k of scores + expert_bias; w = their scores, divided by (sum + norm_eps) when
normalize=1, times routed_scaling. That covers Qwen3-MoE (softmax, normalize per
norm_topk_prob), Mixtral (softmax, normalize) and LFM2-MoE (sigmoid + expert bias,
normalize with eps 1e-6). Routing runs in fp32, as the reference does. A shared expert,
where a model has one, is an ordinary MLP outside this op.
"""

from __future__ import annotations

from graphkiln.ops.spec import AttrSpec, CustomOpSpec

SPEC = CustomOpSpec(
    name="MoE",
    torch_name="moe",
    inputs=("hidden", "router_logits", "gate_up", "down", "expert_bias"),
    outputs=("out",),
    attributes=(
        AttrSpec("top_k", "int", "experts per token"),
        AttrSpec("scoring", "int", "0: softmax, 1: sigmoid"),
        AttrSpec("normalize", "int", "1: divide the top-k weights by their sum + norm_eps"),
        AttrSpec("norm_eps", "float", "added to the sum when normalizing"),
        AttrSpec("routed_scaling", "float", "multiplies the routing weights"),
    ),
    output_dtypes_from=("hidden",),
    doc=__doc__,
)


def routing(router_logits, expert_bias, top_k: int, scoring: int, normalize: int, norm_eps: float, routed_scaling: float):
    """(weights [T, k] fp32, expert ids [T, k]) exactly as the reference routers compute them."""
    import torch

    logits = router_logits.float()
    probs = torch.sigmoid(logits) if scoring == 1 else torch.softmax(logits, dim=-1)
    select = probs + expert_bias.float()
    idx = torch.topk(select, top_k, dim=-1).indices
    w = probs.gather(-1, idx)
    if normalize:
        w = w / (w.sum(-1, keepdim=True) + norm_eps)
    return w * routed_scaling, idx


def reference(hidden, router_logits, gate_up, down, expert_bias, top_k, scoring, normalize, norm_eps, routed_scaling):
    import torch
    import torch.nn.functional as F

    w, idx = routing(router_logits, expert_bias, top_k, scoring, normalize, norm_eps, routed_scaling)
    w = w.to(hidden.dtype)
    out = torch.zeros_like(hidden)
    for e in range(gate_up.shape[0]):
        tok, slot = torch.where(idx == e)
        if tok.numel() == 0:
            continue
        gate, up = F.linear(hidden[tok], gate_up[e]).chunk(2, dim=-1)
        h = F.linear(F.silu(gate) * up, down[e])
        out.index_add_(0, tok, h * w[tok, slot, None])
    return out


def fake(hidden, router_logits, gate_up, down, expert_bias, top_k, scoring, normalize, norm_eps, routed_scaling):
    return hidden.new_empty(hidden.shape)


def onnx_function(opset: int):
    """Dense decomposition: every expert on every token, weighted by the scattered top-k weights.

    Exact, and the only static form standard ONNX allows; it reads all experts' weights, so
    targets that care about speed claim the node (a TensorRT plugin, onnxruntime's MoE).
    """
    import onnxscript
    from onnx import TensorProto
    from onnxscript.values import Opset

    op = Opset("", opset)
    gk = Opset(SPEC.domain, SPEC.version)

    @onnxscript.script(gk, default_opset=op)
    def MoE(hidden, router_logits, gate_up, down, expert_bias, top_k: int, scoring: int, normalize: int,
            norm_eps: float, routed_scaling: float, plugin_namespace: str, plugin_version: str):
        logits = op.Cast(router_logits, to=TensorProto.FLOAT)
        one = op.Constant(value_float=1.0)
        use_sigmoid = op.Cast(op.Constant(value_int=scoring), to=TensorProto.FLOAT)
        probs = op.Add(op.Mul(op.Softmax(logits, axis=-1), op.Sub(one, use_sigmoid)),
                       op.Mul(op.Sigmoid(logits), use_sigmoid))
        select = op.Add(probs, op.Cast(expert_bias, to=TensorProto.FLOAT))
        k = op.Reshape(op.Constant(value_int=top_k), op.Constant(value_ints=[1]))
        _, idx = op.TopK(select, k, axis=-1)
        w = op.GatherElements(probs, idx, axis=-1)
        norm = op.Cast(op.Constant(value_int=normalize), to=TensorProto.FLOAT)
        denom = op.Add(op.ReduceSum(w, op.Constant(value_ints=[-1]), keepdims=1), op.Constant(value_float=norm_eps))
        w = op.Div(w, op.Add(op.Mul(denom, norm), op.Sub(one, norm)))
        w = op.Mul(w, op.Constant(value_float=routed_scaling))
        dense = op.ScatterElements(op.ConstantOfShape(op.Shape(probs)), idx, w, axis=-1)  # [T, E]
        dense = op.Unsqueeze(op.Transpose(op.CastLike(dense, hidden), perm=[1, 0]), op.Constant(value_ints=[1]))
        xt = op.Transpose(hidden, perm=[1, 0])  # [H, T]
        gu = op.MatMul(gate_up, xt)  # [E, 2I, T]
        gate, up = op.Split(gu, axis=1, num_outputs=2)
        act = op.Mul(op.Mul(gate, op.Sigmoid(gate)), up)
        out = op.MatMul(down, act)  # [E, H, T]
        summed = op.ReduceSum(op.Mul(out, dense), op.Constant(value_ints=[0]), keepdims=0)  # [H, T]
        return op.Transpose(summed, perm=[1, 0])

    return MoE.to_function_proto()
