"""Target lowerings: passes that rewrite the portable graph for one runtime.

The exported (portable) graph stays free of runtime-only ops: custom nodes such as
``graphkiln.MoE`` carry a standard-ONNX reference function that any runtime can run.
A lowering pass takes that graph and replaces such nodes with what one particular runtime
runs fastest (for example onnxruntime's ``com.microsoft`` contrib ops); its output is only
valid for that runtime.

* ``ort_moe.lower_moe_for_onnxruntime`` — ``graphkiln.MoE`` -> routing in standard ops +
  ``com.microsoft.MoE``.
* ``quantize.quantize_linear_weights`` — Linear MatMul/Gemm weights -> int4/int8
  block-wise ``com.microsoft.MatMulNBits`` (routers feeding MoE stay float).
* ``trt_target.lower_for_tensorrt`` — the TensorRT-target graph: every graphkiln node set to
  its plugin's ahead-of-time kernel (``aot=1``) and in-place state (KV cache and conv pool
  returned whole, aliased to their inputs); no weights change.
"""
