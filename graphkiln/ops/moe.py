"""``graphkiln.MoE``: routed mixture of experts, routing included.

hidden [T, H], router_logits [T, E], gate_up [E, F, H], down [E, H, I], expert_bias [E]
(added to the scores for *selection* only; zeros when unused), gate_up_bias [E, F],
down_bias [E, H] (zeros when a checkpoint has none), where F = 2I (gate rows then up rows)
for the gated activations and F = I (up rows only) for the non-gated one
-> out [T, H] = sum over the top_k experts e of w_e * (down_e(act_e(x)) + down_bias_e), with
    y = gate_up_e x + gate_up_bias_e and, by ``activation``:
      0: silu(gate) * up                                (SwiGLU: Qwen3-MoE, Mixtral, LFM2-MoE)
      1: relu(y)^2, non-gated (y is the I up rows)      (Nemotron-H, mlp_hidden_act "relu2")
      2: g * sigmoid(alpha * g) * (u + 1) with g = min(gate, limit),
         u = clamp(up, -limit, limit)                   (gpt-oss, alpha 1.702, limit 7)
  (gate = y[:I], up = y[I:]). ``alpha`` and ``limit`` are read by activation 2 only.

Routing (attributes): scores = softmax(logits) (scoring=0) or sigmoid(logits) (scoring=1);
experts = top_k of scores + expert_bias; w = their scores, divided by (sum + norm_eps) when
normalize=1, times routed_scaling. That covers Qwen3-MoE (softmax, normalize per
norm_topk_prob), Mixtral (softmax, normalize), LFM2-MoE (sigmoid + expert bias, normalize
with eps 1e-6), gpt-oss (its softmax over the top-k logits is softmax + normalize, eps 0)
and Nemotron-H with n_group == 1 (sigmoid + e_score_correction_bias, normalize with eps
1e-20, routed scaling). Routing runs in fp32, as the reference does; the weights are then
rounded to the hidden dtype, and each expert's output (bias included) is computed in the
hidden dtype, weighted and summed there. A shared expert, where a model has one, is an
ordinary MLP outside this op.
"""

from __future__ import annotations

from graphkiln.ops.spec import AttrSpec, CustomOpSpec

# activation codes (the ``activation`` attribute)
SWIGLU, RELU2, SWIGLU_CLAMPED = 0, 1, 2
ACTIVATIONS = (SWIGLU, RELU2, SWIGLU_CLAMPED)
GPT_OSS_ALPHA, GPT_OSS_LIMIT = 1.702, 7.0

SPEC = CustomOpSpec(
    name="MoE",
    torch_name="moe",
    inputs=("hidden", "router_logits", "gate_up", "down", "expert_bias", "gate_up_bias", "down_bias"),
    outputs=("out",),
    attributes=(
        AttrSpec("top_k", "int", "experts per token"),
        AttrSpec("scoring", "int", "0: softmax, 1: sigmoid"),
        AttrSpec("normalize", "int", "1: divide the top-k weights by their sum + norm_eps"),
        AttrSpec("norm_eps", "float", "added to the sum when normalizing"),
        AttrSpec("routed_scaling", "float", "multiplies the routing weights"),
        AttrSpec("activation", "int", "0: silu(gate)*up; 1: relu(up)^2, non-gated (gate_up holds the I up rows); "
                 "2: clamped SwiGLU min(gate,limit)*sigmoid(alpha*min(gate,limit))*(clamp(up,-limit,limit)+1)",
                 default=SWIGLU),
        AttrSpec("alpha", "float", "activation 2: the sigmoid's scale", default=GPT_OSS_ALPHA),
        AttrSpec("limit", "float", "activation 2: the clamp limit", default=GPT_OSS_LIMIT),
    ),
    output_dtypes_from=("hidden",),
    doc=__doc__,
)


def gate_up_rows(intermediate: int, activation: int) -> int:
    """F, the rows of each expert's gate_up (and columns of gate_up_bias): 2I, or I for relu²."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"graphkiln.MoE: unknown activation {activation}")
    return intermediate if activation == RELU2 else 2 * intermediate


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


def expert_activation(y, activation: int, alpha: float, limit: float):
    """act(y) for y = gate_up_e x + gate_up_bias_e [..., F], in y's dtype, as the models write it
    (gpt-oss: GptOssExperts._apply_gate on de-interleaved columns; Nemotron-H: ACT2FN["relu2"])."""
    import torch
    import torch.nn.functional as F

    if activation == RELU2:
        return torch.square(F.relu(y))
    gate, up = y.chunk(2, dim=-1)
    if activation == SWIGLU_CLAMPED:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))
    if activation != SWIGLU:
        raise ValueError(f"graphkiln.MoE: unknown activation {activation}")
    return F.silu(gate) * up


def reference(hidden, router_logits, gate_up, down, expert_bias, gate_up_bias, down_bias, top_k, scoring, normalize,
              norm_eps, routed_scaling, activation=SWIGLU, alpha=GPT_OSS_ALPHA, limit=GPT_OSS_LIMIT):
    import torch
    import torch.nn.functional as F

    w, idx = routing(router_logits, expert_bias, top_k, scoring, normalize, norm_eps, routed_scaling)
    w = w.to(hidden.dtype)
    out = torch.zeros_like(hidden)
    for e in range(gate_up.shape[0]):
        tok, slot = torch.where(idx == e)
        if tok.numel() == 0:
            continue
        # matmul, then the bias in the hidden dtype (as gpt-oss adds it; adding zeros is exact,
        # so bias-free models get the very values of a bias-free linear)
        y = F.linear(hidden[tok], gate_up[e]) + gate_up_bias[e]
        h = F.linear(expert_activation(y, activation, alpha, limit), down[e]) + down_bias[e]
        out.index_add_(0, tok, h * w[tok, slot, None])
    return out


def fake(hidden, router_logits, gate_up, down, expert_bias, gate_up_bias, down_bias, top_k, scoring, normalize,
         norm_eps, routed_scaling, activation=SWIGLU, alpha=GPT_OSS_ALPHA, limit=GPT_OSS_LIMIT):
    return hidden.new_empty(hidden.shape)


def onnx_function(opset: int):
    """Dense decomposition: every expert on every token, weighted by the scattered top-k weights.

    Exact, and the only static form standard ONNX allows; it reads all experts' weights, so
    targets that care about speed claim the node (a TensorRT plugin, onnxruntime's MoE). The
    activation is chosen by an If on the attribute, a constant once the function is inlined,
    which onnxruntime folds: the graph runs only the chosen branch's ops.
    """
    import onnxscript
    from onnx import TensorProto
    from onnxscript.values import Opset

    op = Opset("", opset)
    gk = Opset(SPEC.domain, SPEC.version)

    @onnxscript.script(gk, default_opset=op)
    def MoE(hidden, router_logits, gate_up, down, expert_bias, gate_up_bias, down_bias, top_k: int, scoring: int,
            normalize: int, norm_eps: float, routed_scaling: float, activation: int, alpha: float, limit: float,
            plugin_namespace: str, plugin_version: str):
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
        axis2 = op.Constant(value_ints=[2])
        gu = op.Add(op.MatMul(gate_up, xt), op.Unsqueeze(gate_up_bias, axis2))  # [E, F, T]
        if op.Equal(op.Constant(value_int=activation), op.Constant(value_int=1)):
            r = op.Relu(gu)
            act = op.Mul(r, r)
        else:
            gate, up = op.Split(gu, axis=1, num_outputs=2)
            if op.Equal(op.Constant(value_int=activation), op.Constant(value_int=2)):
                lim = op.CastLike(op.Constant(value_float=limit), gate)
                g = op.Min(gate, lim)
                u = op.Clip(up, op.Neg(lim), lim)
                glu = op.Mul(g, op.Sigmoid(op.Mul(g, op.CastLike(op.Constant(value_float=alpha), g))))
                act = op.Mul(op.Add(u, op.CastLike(one, u)), glu)
            else:
                act = op.Mul(op.Mul(gate, op.Sigmoid(gate)), up)
        out = op.Add(op.MatMul(down, act), op.Unsqueeze(down_bias, axis2))  # [E, H, T]
        summed = op.ReduceSum(op.Mul(out, dense), op.Constant(value_ints=[0]), keepdims=0)  # [H, T]
        return op.Transpose(summed, perm=[1, 0])

    return MoE.to_function_proto()
