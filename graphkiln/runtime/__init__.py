"""Runtime: load an artifact and generate, with onnxruntime and numpy only (no torch).

    from graphkiln.runtime import Engine, GenerationConfig
    engine = Engine.load("artifacts/llama")
    for result in engine.generate(["Hello", "Once upon"], GenerationConfig(max_new_tokens=32)):
        print(result.text)
"""

from graphkiln.runtime.engine import Engine
from graphkiln.runtime.requests import GenerationConfig, GenerationResult, TokenEvent, TokenLogprob

__all__ = ["Engine", "GenerationConfig", "GenerationResult", "TokenEvent", "TokenLogprob", "load"]


def load(artifact_dir, threads: int | None = None) -> Engine:
    return Engine.load(artifact_dir, threads=threads)
