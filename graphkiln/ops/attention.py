"""``graphkiln.Attention``: rotary + grouped-query causal attention over a position-indexed cache.

q [B, S, Nq*D], k / v [B, S, Nkv*D] (projections of the new tokens, after any q/k norm),
past_key / past_value [B, Nkv, C, D] (the cache: row b's token at position p is at
``[b, :, p]``), position_ids [B, S] (row b's new tokens sit at positions start_b + 0..S-1,
start_b = tokens already cached), cos_cache / sin_cache (by ``rope_layout``: 0 (default), rotary
tables [P, D/2] by position, any rope scaling folded in, P >= every position used, gathered at
position_ids; 1, this step's per-token values [B, S, D/2], computed by the graph, e.g. M-RoPE's
sections from 3-D positions, which are not the cache positions), lookahead [B|1, S|1] int64
(how many positions past its own each new token may also see; 0 = causal; a text model passes
a constant zero [1, 1]; Gemma3 gives an image's tokens the distance to the image's last token,
which is transformers' OR(causal, same image) mask), sinks fp32 [Nq] (attention sinks, read
only when ``use_sinks`` = 1; a model without them passes a constant zero [Nq])
-> out [B, S, Nq*D] and, by ``kv_update``:
  0 (default): new_key / new_value [B, Nkv, S, D], the new tokens' rotated keys and values;
     the caller stores them at their positions.
  1: new_key / new_value [B, Nkv, C, D] are the whole cache (graphs name them
     present_key.i / present_value.i): past with row b's S new rotated keys / values written
     at positions position_ids[b, s] (positions >= C are skipped). TensorRT's plugin aliases
     them to past_key / past_value and writes the rows in place; onnxruntime, running the
     function below with them bound to the past_* buffers (``graphkiln.runtime.backends.ort_cpu``),
     does the same (ScatterElements writes into its input's buffer when they alias, without
     copying the cache).

Semantics: q and k are rotated "rotate-half" style (x * cos + rotate_half(x) * sin with the
tables gathered at position_ids and repeated to D); query head h reads KV head
h // (Nq / Nkv); a new token at position p sees cached keys at positions < start_b and new
keys at positions <= p + lookahead, and with ``window`` > 0 only keys at positions > p - window;
scores are scaled by ``scale`` and the softmax runs in fp32. With ``use_sinks`` = 1 (gpt-oss)
query head h's softmax over a row's visible keys gains one more logit, sinks[h], whose
probability is then dropped: probs = softmax([scores, sinks[h]])[:-1], so the row's weights sum
to less than 1 (a row that sees no key at all gets out = 0). With ``use_sinks`` = 0 (the
default, every model without sinks) ``sinks`` is never read, and every target runs exactly
the computation it ran before the input existed: the reference and the function take the same
ops, the kernel is compiled without the sink code, onnxruntime's GroupQueryAttention gets no
``head_sink``. Padding after a row's real tokens
(higher positions) is never seen by its real tokens (a lookahead never reaches past a row's
real tokens, and a block it opens must lie within one step: the runtime never splits an image
across prefill chunks). Only cache positions < start_b are read,
so the cache beyond them may hold anything.

Why one op: attention with a cache is what every runtime implements its own way — a
TensorRT plugin or onnxruntime's GroupQueryAttention (``lowering.ort_attention``), which
also writes the cache in place — so the portable graph carries it whole, with this
standard-ONNX body for runtimes that have neither.
"""

from __future__ import annotations

from graphkiln.ops.spec import AttrSpec, CustomOpSpec

SPEC = CustomOpSpec(
    name="Attention",
    torch_name="attention",
    inputs=("q", "k", "v", "past_key", "past_value", "position_ids", "cos_cache", "sin_cache", "lookahead", "sinks"),
    outputs=("out", "new_key", "new_value"),
    attributes=(
        AttrSpec("num_heads", "int", "Nq, query heads"),
        AttrSpec("num_kv_heads", "int", "Nkv, key/value heads (divides Nq)"),
        AttrSpec("window", "int", "sliding window in positions; 0 = full causal attention"),
        AttrSpec("scale", "float", "multiplies q.k (usually D ** -0.5)"),
        AttrSpec("kv_update", "int", "0: return the new rows; 1: return the whole cache with them written in place",
                 default=0),
        AttrSpec("rope_layout", "int", "0: cos/sin are tables [P, D/2] gathered at position_ids; "
                 "1: they are per-token [B, S, D/2]", default=0),
        AttrSpec("use_sinks", "int", "1: sinks[h] joins query head h's softmax as one extra logit, then dropped; "
                 "0: sinks is not read", default=0),
    ),
    output_dtypes_from=("q", "past_key", "past_value"),
    doc=__doc__,
)

# The attribute that makes the state outputs the whole (aliased) cache: 1 on every TensorRT node.
IN_PLACE_ATTR = "kv_update"


def visible_keys(position_ids, cache_len: int, window: int, lookahead=None):
    """Boolean [B, 1, 1, S, C + S]: may new token (b, s) see key j (cache then new tokens)?"""
    import torch

    start = position_ids[:, :1]
    cache_pos = torch.arange(cache_len, device=position_ids.device).unsqueeze(0).expand(position_ids.shape[0], -1)
    key_pos = torch.cat((cache_pos, position_ids), dim=1)
    key_ok = torch.cat((cache_pos < start, position_ids >= start), dim=1)
    q_pos, k_pos = position_ids.unsqueeze(2), key_pos.unsqueeze(1)
    limit = q_pos if lookahead is None else q_pos + lookahead.unsqueeze(2)
    visible = (k_pos <= limit) & key_ok.unsqueeze(1)
    if window > 0:
        visible = visible & (k_pos > q_pos - window)
    return visible[:, None, None]


def _rotate(x, cos, sin):
    import torch

    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def per_token_rope(cos_cache, sin_cache, position_ids, rope_layout: int):
    """(cos, sin) [B, S, D/2] of this step's tokens, by ``rope_layout``."""
    if rope_layout:
        return cos_cache, sin_cache
    return cos_cache[position_ids], sin_cache[position_ids]


def reference(q, k, v, past_key, past_value, position_ids, cos_cache, sin_cache, lookahead, sinks, num_heads,
              num_kv_heads, window, scale, kv_update=0, rope_layout=0, use_sinks=0):
    import torch

    b, s, _ = q.shape
    d = past_key.shape[-1]
    half_cos, half_sin = per_token_rope(cos_cache, sin_cache, position_ids, rope_layout)
    cos = half_cos.repeat(1, 1, 2).unsqueeze(1).to(q.dtype)  # [B, 1, S, D]
    sin = half_sin.repeat(1, 1, 2).unsqueeze(1).to(q.dtype)
    q4 = _rotate(q.view(b, s, num_heads, d).transpose(1, 2), cos, sin)
    k4 = _rotate(k.view(b, s, num_kv_heads, d).transpose(1, 2), cos, sin)
    v4 = v.view(b, s, num_kv_heads, d).transpose(1, 2)
    keys = torch.cat((past_key.to(q.dtype), k4), dim=2)
    values = torch.cat((past_value.to(q.dtype), v4), dim=2)
    # Fold each KV group's query heads into the sequence axis: one matmul per group, no
    # per-head copy of the cache.
    rep = num_heads // num_kv_heads
    scores = torch.matmul(q4.reshape(b, num_kv_heads, rep * s, d), keys.transpose(2, 3)) * scale
    scores = scores.float().view(b, num_kv_heads, rep, s, -1)
    ahead = lookahead.expand(b, s)
    scores = scores.masked_fill(~visible_keys(position_ids, past_key.shape[2], window, ahead), float("-inf"))
    if use_sinks:
        # query head h = kv head * rep + r: sinks viewed [Nkv, rep] lines up with the folded heads
        sink = sinks.float().view(1, num_kv_heads, rep, 1, 1).expand(b, -1, -1, s, 1)
        probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    probs = probs.to(q.dtype).reshape(b, num_kv_heads, rep * s, -1)
    out = torch.matmul(probs, values).view(b, num_heads, s, d).transpose(1, 2).reshape(b, s, num_heads * d)
    if kv_update:
        return out, write_rows(past_key, k4, position_ids), write_rows(past_value, v4, position_ids)
    return out, k4.to(past_key.dtype).contiguous(), v4.to(past_value.dtype).contiguous()


def write_rows(cache, rows, position_ids):
    """A copy of ``cache`` [B, N, C, D] with ``rows`` [B, N, S, D] written at position_ids [B, S]
    along C; positions >= C are skipped (kv_update=1's output)."""
    import torch

    out = cache.clone()
    b, s = torch.nonzero(position_ids < cache.shape[2], as_tuple=True)
    out[b, :, position_ids[b, s]] = rows[b, :, s].to(cache.dtype)
    return out


def fake(q, k, v, past_key, past_value, position_ids, cos_cache, sin_cache, lookahead, sinks, num_heads, num_kv_heads,
         window, scale, kv_update=0, rope_layout=0, use_sinks=0):
    if kv_update:
        return q.new_empty(q.shape), past_key.new_empty(past_key.shape), past_value.new_empty(past_value.shape)
    b, s, _ = q.shape
    shape = (b, num_kv_heads, s, past_key.shape[-1])
    return q.new_empty(q.shape), past_key.new_empty(shape), past_value.new_empty(shape)


def onnx_function(opset: int):
    import onnxscript
    from onnx import TensorProto
    from onnxscript.values import Opset

    op = Opset("", opset)
    gk = Opset(SPEC.domain, SPEC.version)

    @onnxscript.script(gk, default_opset=op)
    def Attention(q, k, v, past_key, past_value, position_ids, cos_cache, sin_cache, lookahead, sinks, num_heads: int,
                  num_kv_heads: int, window: int, scale: float, plugin_namespace: str, plugin_version: str,
                  kv_update: int = 0, rope_layout: int = 0, use_sinks: int = 0):
        one = op.Constant(value_ints=[1])
        minus1 = op.Constant(value_ints=[-1])
        nq = op.Reshape(op.Constant(value_int=num_heads), one)
        nkv = op.Reshape(op.Constant(value_int=num_kv_heads), one)
        bs = op.Shape(q, start=0, end=2)
        q4 = op.Transpose(op.Reshape(q, op.Concat(bs, nq, minus1, axis=0)), perm=[0, 2, 1, 3])  # [B, Nq, S, D]
        k4 = op.Transpose(op.Reshape(k, op.Concat(bs, nkv, minus1, axis=0)), perm=[0, 2, 1, 3])  # [B, Nkv, S, D]
        v4 = op.Transpose(op.Reshape(v, op.Concat(bs, nkv, minus1, axis=0)), perm=[0, 2, 1, 3])
        # rope_layout is a constant once inlined: onnxruntime folds the If (as kv_update's below).
        if op.Equal(op.Constant(value_int=rope_layout), op.Constant(value_int=1)):
            half_cos = op.Identity(cos_cache)  # [B, S, D/2], per token already
            half_sin = op.Identity(sin_cache)
        else:
            half_cos = op.Gather(cos_cache, position_ids, axis=0)  # [B, S, D/2]
            half_sin = op.Gather(sin_cache, position_ids, axis=0)
        cos = op.CastLike(op.Unsqueeze(op.Concat(half_cos, half_cos, axis=-1), one), q)  # [B, 1, S, D]
        sin = op.CastLike(op.Unsqueeze(op.Concat(half_sin, half_sin, axis=-1), one), q)
        q1, q2 = op.Split(q4, axis=-1, num_outputs=2)
        qr = op.Add(op.Mul(q4, cos), op.Mul(op.Concat(op.Neg(q2), q1, axis=-1), sin))
        k1, k2 = op.Split(k4, axis=-1, num_outputs=2)
        kr = op.Add(op.Mul(k4, cos), op.Mul(op.Concat(op.Neg(k2), k1, axis=-1), sin))
        keys = op.Concat(op.CastLike(past_key, q), kr, axis=2)  # [B, Nkv, C+S, D]
        values = op.Concat(op.CastLike(past_value, q), v4, axis=2)

        rep = op.Div(nq, nkv)
        qshape = op.Shape(qr)  # [B, Nq, S, D]
        folded = op.Reshape(qr, op.Concat(op.Shape(qr, start=0, end=1), nkv, minus1, op.Shape(qr, start=3, end=4), axis=0))
        scores = op.MatMul(folded, op.Transpose(keys, perm=[0, 1, 3, 2]))  # [B, Nkv, rep*S, C+S]
        scores = op.Mul(op.Cast(scores, to=TensorProto.FLOAT), op.Constant(value_float=scale))
        scores5 = op.Reshape(scores, op.Concat(op.Shape(qr, start=0, end=1), nkv, rep, op.Shape(qr, start=2, end=3),
                                               minus1, axis=0))

        # Which keys each new token sees (see visible_keys).
        cache_len = op.Shape(past_key, start=2, end=3)
        cache_pos = op.Range(op.Constant(value_int=0), op.Squeeze(cache_len), op.Constant(value_int=1))
        cache_pos = op.Expand(op.Unsqueeze(cache_pos, op.Constant(value_ints=[0])),
                              op.Concat(op.Shape(position_ids, start=0, end=1), cache_len, axis=0))  # [B, C]
        start = op.Slice(position_ids, op.Constant(value_ints=[0]), one, one)  # [B, 1]
        key_pos = op.Concat(cache_pos, position_ids, axis=1)  # [B, C+S]
        key_ok = op.Concat(op.Less(cache_pos, start), op.GreaterOrEqual(position_ids, start), axis=1)
        q_pos = op.Unsqueeze(position_ids, op.Constant(value_ints=[2]))  # [B, S, 1]
        k_pos = op.Unsqueeze(key_pos, one)  # [B, 1, C+S]
        limit = op.Add(q_pos, op.Unsqueeze(lookahead, op.Constant(value_ints=[2])))  # [B|1, S|1, 1]
        visible = op.And(op.LessOrEqual(k_pos, limit), op.Unsqueeze(key_ok, one))
        w = op.Constant(value_int=window)
        in_window = op.Or(op.Equal(w, op.Constant(value_int=0)), op.Greater(k_pos, op.Sub(q_pos, w)))
        visible = op.Unsqueeze(op.And(visible, in_window), op.Constant(value_ints=[1, 2]))  # [B, 1, 1, S, C+S]

        masked = op.Where(visible, scores5, op.Constant(value_float=float("-inf")))  # [B, Nkv, rep, S, C+S]
        # use_sinks is a constant once inlined, folded like rope_layout: without sinks the session
        # runs the plain softmax, and never reads the sinks input.
        if op.Equal(op.Constant(value_int=use_sinks), op.Constant(value_int=1)):
            # query head h = kv head * rep + r, so sinks [Nq] viewed [1, Nkv, rep, 1, 1] lines up
            sink = op.Reshape(op.Cast(sinks, to=TensorProto.FLOAT), op.Concat(one, nkv, rep, one, one, axis=0))
            sink = op.Expand(sink, op.Concat(op.Shape(masked, start=0, end=4), one, axis=0))
            with_sink = op.Softmax(op.Concat(masked, sink, axis=-1), axis=-1)
            weights = op.Slice(with_sink, op.Constant(value_ints=[0]), minus1, minus1)  # drop the sink's column
        else:
            weights = op.Softmax(masked, axis=-1)
        probs = op.Reshape(op.CastLike(weights, q), op.Shape(scores))
        out = op.Reshape(op.MatMul(probs, values), qshape)  # [B, Nq, S, D]
        out = op.Reshape(op.Transpose(out, perm=[0, 2, 1, 3]), op.Shape(q))

        # kv_update is a constant once the function is inlined: onnxruntime folds this If to one
        # branch (measured, onnxruntime 1.32), so a session runs only the chosen mode.
        if op.Equal(op.Constant(value_int=kv_update), op.Constant(value_int=1)):
            # Scatter each new row into the cache at its position; rows at positions >= C are
            # redirected to C-1 carrying the value C-1 ends up with anyway (the new row at C-1 if
            # the row writes there, else the cached one), so every write to one index carries one
            # value and the result does not depend on the scatter's order. At most C rows are
            # written: a longer prefill's later tokens are all at positions >= C.
            n = op.Min(op.Shape(position_ids, start=1, end=2), cache_len)
            pos = op.Slice(position_ids, op.Constant(value_ints=[0]), n, one)  # [B, n]
            target = op.Min(pos, op.Sub(cache_len, one))
            from_new = op.Unsqueeze(op.GreaterOrEqual(target, start), op.Constant(value_ints=[1, 3]))  # [B, 1, n, 1]
            offset = op.Max(op.Sub(target, start), op.Constant(value_int=0))  # the new row that lands there
            rows_shape = op.Concat(op.Shape(q, start=0, end=1), nkv, n, op.Shape(past_key, start=3, end=4), axis=0)
            at_target = op.Expand(op.Unsqueeze(target, op.Constant(value_ints=[1, 3])), rows_shape)
            at_offset = op.Expand(op.Unsqueeze(offset, op.Constant(value_ints=[1, 3])), rows_shape)
            key_rows = op.Where(from_new, op.GatherElements(op.CastLike(kr, past_key), at_offset, axis=2),
                                op.GatherElements(past_key, at_target, axis=2))
            value_rows = op.Where(from_new, op.GatherElements(op.CastLike(v4, past_value), at_offset, axis=2),
                                  op.GatherElements(past_value, at_target, axis=2))
            new_key = op.ScatterElements(past_key, at_target, key_rows, axis=2)
            new_value = op.ScatterElements(past_value, at_target, value_rows, axis=2)
        else:
            new_key = op.CastLike(kr, past_key)
            new_value = op.CastLike(v4, past_value)
        return out, new_key, new_value

    return Attention.to_function_proto()
