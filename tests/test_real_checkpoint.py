"""A real checkpoint end to end: SmolLM2-135M-Instruct (``scripts/real_checkpoint.py``), built and
exported once per test run by the session fixture ``real_checkpoint`` (tests/conftest.py).

Greedy generation through the Engine equals transformers' on real English text (plain prompts and
one rendered by the checkpoint's own chat template), token for token, and the prompt logits agree
to well within 1e-3; a chat completion through ``graphkiln serve`` (the ``openai`` client) answers
"What is the capital of France?" with Paris, exactly as the Engine does from the prompt the
checkpoint's tokenizer renders.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("openai")

from graphkiln.runtime import Engine, GenerationConfig  # noqa: E402

from test_serve import MODEL, serving  # noqa: E402

NEW_TOKENS = 24
# last-position logits, max |graphkiln - transformers| over the three prompts, measured 4e-5..6e-5
# (every prompt position: at most 1.1e-4; logits reach ~38 in size): the bound leaves ~15x headroom
LOGITS_ATOL = 1e-3


@pytest.fixture(scope="module")
def tokenizer(real_checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(real_checkpoint[0]))


@pytest.fixture(scope="module")
def engine(real_checkpoint):
    return Engine.load(real_checkpoint[1], threads=1)


def _chat(tokenizer, question: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                         tokenize=False)


def test_greedy_generation_and_prompt_logits_equal_transformers(real_checkpoint, tokenizer, engine):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(real_checkpoint[0]), dtype=torch.float32).eval()
    prompts = ["The history of the Roman Empire began when", "Photosynthesis is the process by which plants",
               _chat(tokenizer, "Write one sentence about the sea.")]
    ids = [tokenizer(p).input_ids for p in prompts]
    assert [engine.encode(p) for p in prompts] == ids  # the artifact's tokenizer reads real text as the checkpoint's
    # no EOS stop on either side: NEW_TOKENS tokens each, past the chat answer's <|im_end|> if it comes
    got = engine.generate(prompts, GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, stop_token_ids=()))
    worst_last = worst_any = 0.0
    for prompt_ids, result, logits in zip(ids, got, engine.prompt_logits(ids)):
        x = torch.tensor([prompt_ids])
        with torch.no_grad():  # an explicit mask: the chat prompt holds the pad id (2, <|im_end|>)
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW_TOKENS, do_sample=False,
                                 eos_token_id=None)
            want_logits = model(x).logits[0].numpy()
        want = out[0, len(prompt_ids):].tolist()
        assert len(want) == NEW_TOKENS and result.token_ids == want, (tokenizer.decode(want), result.text)
        assert result.prompt_ids == prompt_ids
        diff = np.abs(logits - want_logits)
        worst_last, worst_any = max(worst_last, float(diff[-1].max())), max(worst_any, float(diff.max()))
    assert worst_last < LOGITS_ATOL and worst_any < LOGITS_ATOL, (worst_last, worst_any)
    print(f"\nreal checkpoint: max |logits - transformers| last position {worst_last:.2e}, any position "
          f"{worst_any:.2e}; {got[0].text!r}")


def test_chat_completion_through_the_server_equals_the_engine(real_checkpoint, tokenizer, engine):
    question = "What is the capital of France?"
    rendered = _chat(tokenizer, question)
    want = engine.generate(rendered, GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False))[0]
    with serving(real_checkpoint[1]) as srv:
        r = srv.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}],
                                                 max_tokens=NEW_TOKENS, temperature=0,
                                                 extra_body={"return_token_ids": True})
    text = r.choices[0].message.content
    assert "Paris" in text, text
    assert r.prompt_token_ids == tokenizer(rendered).input_ids  # the server renders the checkpoint's template
    assert text == want.text and r.choices[0].token_ids == want.token_ids
    assert r.choices[0].finish_reason == want.finish_reason == "stop"  # the answer ends with <|im_end|>


def test_multi_turn_chat_reuses_each_turn_and_equals_no_reuse(real_checkpoint, tokenizer, engine):
    """Three chat turns over a shared document, each rendered whole by the checkpoint's template:
    every turn after the first starts from the previous turn's cached blocks (its prompt and the
    reply), and every reply equals the same turn on an engine without the cache."""
    plain = Engine.load(real_checkpoint[1], threads=1, prefix_cache=False)
    cfg = GenerationConfig(max_new_tokens=16, do_sample=False)
    doc = ("The lighthouse at the edge of the harbour was built in 1871 from granite quarried on the island. "
           "Its lamp burned whale oil until 1902, then kerosene, and since 1958 it has been electric. ") * 4
    messages = [{"role": "system", "content": "Answer from this text only.\n\n" + doc}]
    previous = 0
    for question in ("When was the lighthouse built?", "What did the lamp burn first?", "And since 1958?"):
        messages.append({"role": "user", "content": question})
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        got, want = engine.generate(text, cfg)[0], plain.generate(text, cfg)[0]
        assert got.token_ids == want.token_ids, question
        # every full block of the previous turn's sequence (its last token is never fed back)
        assert got.cached_tokens >= (previous - 1) // 32 * 32 - 32 and (previous == 0 or got.cached_tokens > 0)
        previous = len(got.prompt_ids) + len(got.token_ids)
        messages.append({"role": "assistant", "content": got.text})
