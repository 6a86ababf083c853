"""Register graphkiln's custom ops as ``tensorrt.plugin`` plugins (GPU build machines only).

A thin layer over ``rules``: every decision (signatures, shapes, aliasing, dtypes, which
kernel, launch parameters) is a plain function there, tested on CPU. This module only turns
them into TensorRT objects. It imports ``tensorrt`` lazily, inside ``register_plugins``: the
CPU test suite imports this module but never calls it, and this code has never run (no
TensorRT or GPU where graphkiln is built and tested).

Per op, ``register_plugins`` defines, under the op SPEC's ``namespace::name``:
  * ``register`` — output descriptors (state outputs ``.aliased()`` to their inputs in the
    in-place mode), from ``rules.output_rules``;
  * ``autotune`` — LINEAR formats, the activation dtypes as one dependent choice, ids and
    rotary tables fixed (``rules.autotune_types``), one tactic per kernel when an op has several;
  * ``aot_impl`` — the kernel module's ``launch_plan`` with symbolic shapes, compiled to PTX for
    the device's compute capability, as (kernel name, PTX, KernelLaunchParams, SymInt32 extras);
  * ``impl`` — for debugging (``aot=0``): the module's Python launcher on torch views of
    TensorRT's tensors.
The exported TensorRT-target graph marks its nodes ``aot=1``, which picks ``aot_impl``; the
engine then runs without Python.
"""

from __future__ import annotations

from graphkiln.errors import GraphkilnError
from graphkiln.plugins_trt import rules

_REGISTERED: set[str] = set()


def _plugin_api():
    try:
        import tensorrt.plugin as trtp
    except ImportError as exc:
        raise GraphkilnError(
            f"building TensorRT engines needs TensorRT's Python package ({exc}): install graphkiln[tensorrt] "
            "on a machine with an NVIDIA GPU") from None
    if not hasattr(trtp, "aot_impl"):
        raise GraphkilnError("this TensorRT has no ahead-of-time Python plugins: install TensorRT 10.9 or newer "
                             "(graphkiln[tensorrt])")
    return trtp


def register_plugins(with_impl: bool = True) -> tuple[str, ...]:
    """Register every custom op's plugin (once per process); returns the plugin ids.

    ``with_impl=False`` leaves out the Python ``impl``, so the plugins are AOT-only whatever the
    network's preference flags say.
    """
    trtp = _plugin_api()
    for d in rules.plugin_defs().values():
        if d.plugin_id not in _REGISTERED:
            _register_one(trtp, d, with_impl)
            _REGISTERED.add(d.plugin_id)
    return tuple(d.plugin_id for d in rules.plugin_defs().values())


def _register_one(trtp, d: rules.PluginDef, with_impl: bool) -> None:
    module = rules.kernel_module(d)
    cdiv = rules.make_cdiv(trtp.cdiv)
    base = d.name.lower()

    def describe(args):
        descs, attrs = rules.split_args(d, args)
        rules.check_kernel_mode(d, attrs, module)
        shapes = rules.resolve_shapes({n: tuple(t.shape_expr) for n, t in descs.items()})
        outs = []
        for r in rules.output_rules(d, shapes, attrs):
            if r.aliased_to is not None:
                outs.append(descs[r.aliased_to].aliased())
            elif r.like is not None:
                outs.append(descs[r.like].like())
            else:
                outs.append(trtp.from_shape_expr(r.shape, dtype=descs[r.dtype_from].dtype))
        return outs[0] if len(outs) == 1 else tuple(outs)

    def autotune(args):
        return [trtp.AutoTuneCombination(rules.autotune_types(d), rules.autotune_layouts(d), rules.tactic_list(module))]

    def aot_impl(args):
        descs, attrs = rules.split_args(d, args)
        shapes = rules.resolve_shapes({n: tuple(t.shape_expr) for n, t in descs.items()})
        dtype = rules.dtype_name(descs[d.activation_input].dtype)
        plan = rules.launch_plan(d, attrs, shapes, cdiv, dtype=dtype, tactic=args["tactic"], module=module)
        compiled = rules.compile_plan(plan, dtype, rules.device_arch())
        lp = rules.launch_params(plan, compiled)
        params = trtp.KernelLaunchParams()
        params.grid_x, params.grid_y, params.grid_z = lp.grid
        params.block_x, params.block_y, params.block_z = lp.block
        params.shared_mem = lp.shared_mem
        extra = trtp.SymIntExprs.from_tuple([trtp.SymInt32(s) for s in lp.extra_args])
        return compiled.name, compiled.ptx, params, extra

    def impl(args):
        import torch

        tensors, attrs = rules.split_args(d, args)
        rules.check_kernel_mode(d, attrs, module)
        torch_inputs = {n: _as_torch(t) for n, t in tensors.items()}
        torch_outputs = [_as_torch(t) for t in args["outputs"]]
        run = getattr(module, d.runner)
        values = {**rules.run_values(d, torch_inputs, attrs), **rules.tactic_arguments(module, args["tactic"])}
        with torch.cuda.stream(torch.cuda.ExternalStream(args["stream"])):
            results = run(**rules.bind_by_name(run, values, f"{module.__name__}.{d.runner}"))
            rules.write_outputs(results, torch_outputs, rules.aliased_outputs(d, attrs))

    defaults = d.defaults
    trtp.register(d.plugin_id)(
        rules.make_function(f"{base}_register", rules.register_signature(d, trtp), describe, defaults))
    trtp.autotune(d.plugin_id)(
        rules.make_function(f"{base}_autotune", rules.autotune_signature(d, trtp), autotune, defaults))
    trtp.aot_impl(d.plugin_id)(
        rules.make_function(f"{base}_aot_impl", rules.aot_impl_signature(d, trtp), aot_impl, defaults))
    if with_impl:
        trtp.impl(d.plugin_id)(rules.make_function(f"{base}_impl", rules.impl_signature(d, trtp), impl, defaults))


class _Interface:
    def __init__(self, desc):
        self.__cuda_array_interface__ = desc


def _as_torch(t):
    """A torch view of a ``tensorrt.plugin.Tensor`` (its buffer, no copy)."""
    import torch

    # stream None: no synchronisation needed, impl runs on TensorRT's stream already.
    desc, view = rules.cuda_array_interface(t.data_ptr, tuple(t.shape), tuple(t.strides), rules.dtype_name(t.dtype),
                                            None)
    out = torch.as_tensor(_Interface(desc), device="cuda")
    return out.view(getattr(torch, view)) if view else out
