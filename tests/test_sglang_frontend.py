"""SGLang's own frontend client (``sgl.RuntimeEndpoint``: gen, select, fork) against a real
radixray server over the in-process engine, checked against HF transformers; then the shipped
example program. Skipped where ``sglang`` is not installed (it is an optional, test-only
install: see deploy/examples/sglang_frontend.py)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

sgl = pytest.importorskip("sglang")

from hf_reference import hf_greedy, hf_logits  # noqa: E402
from http_helpers import ServerThread, make_engine, wait_idle  # noqa: E402

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "deploy", "examples",
                       "sglang_frontend.py")
PREFIX = "def parse(self, text):\n    return"
CHOICES = [" None", " self.value", " text.split()"]


@pytest.fixture(scope="module")
def server(tiny_llama_path):
    engine = make_engine(tiny_llama_path)
    srv = ServerThread(engine, tiny_llama_path)
    with srv as url:
        sgl.set_default_backend(sgl.RuntimeEndpoint(url))
        yield url, srv.tokenizer
        wait_idle(engine)
    engine.shutdown()


def greedy_text(model_path, tokenizer, prompt: str, max_new_tokens: int) -> str:
    """HF's greedy continuation of ``prompt`` as the server returns it: up to the first EOS,
    special tokens skipped."""
    ids = hf_greedy(model_path, tokenizer(prompt).input_ids, max_new_tokens)
    eos = {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")}
    cut = next((i for i, t in enumerate(ids) if t in eos), len(ids))
    return tokenizer.decode(ids[:cut], skip_special_tokens=True)


def select_score(model_path, tokenizer, prefix: str, choice: str) -> float:
    """The frontend's ``select`` score from HF logits: the mean logprob of prefix+choice's
    tokens after position max(len(prefix tokens) - 2, 0) + 1 (the entry there is null)."""
    ids = tokenizer(prefix + choice).input_ids
    start = max(len(tokenizer(prefix).input_ids) - 2, 0)
    assert not prefix.endswith(tokenizer.decode([ids[start]]))  # no token healing involved
    logprobs = torch.log_softmax(hf_logits(model_path, ids), dim=-1)
    values = [float(logprobs[i - 1, ids[i]]) for i in range(start + 1, len(ids))]
    return sum(values) / len(values)


@sgl.function
def gen_then_select(s, prefix, choices):
    s += prefix
    s += sgl.select("returns", choices=choices)
    s += "\n\ndef"
    s += sgl.gen("next", max_tokens=10, temperature=0)


@sgl.function
def forked(s, header, suffixes):
    s += header
    branches = s.fork(len(suffixes))
    for branch, suffix in zip(branches, suffixes):
        branch += suffix
        branch += sgl.gen("body", max_tokens=8, temperature=0)
    branches.join()
    s["bodies"] = [b["body"] for b in branches]  # plain Python values ride along too
    s["cached"] = [b.get_meta_info("body")["cached_tokens"] for b in branches]
    s["prompt_tokens"] = [b.get_meta_info("body")["prompt_tokens"] for b in branches]


def test_select_picks_the_best_choice_and_gen_continues_greedily(server, tiny_llama_path):
    _, tok = server
    state = gen_then_select.run(prefix=PREFIX, choices=CHOICES)
    scores = {c: select_score(tiny_llama_path, tok, PREFIX, c) for c in CHOICES}
    assert state["returns"] in CHOICES
    assert scores[state["returns"]] >= max(scores.values()) - 1e-4, scores
    prompt = PREFIX + state["returns"] + "\n\ndef"
    assert state["next"] == greedy_text(tiny_llama_path, tok, prompt, 10)
    assert state.text() == prompt + state["next"]


def test_fork_branches_continue_greedily_and_hit_the_cache(server, tiny_llama_path):
    _, tok = server
    header = "class Reader:\n    \"\"\"Read records from a file.\"\"\"\n"
    suffixes = ["    def read(self", "    def seek(self", "    def close(self"]
    first = forked.run(header=header, suffixes=suffixes)
    for suffix, body in zip(suffixes, first["bodies"]):
        assert body == greedy_text(tiny_llama_path, tok, header + suffix, 8)
    # The frontend caches the header first only when its own worker thread has already
    # appended it at fork time (a race inside sglang), so the first run's hits vary. A second
    # run finds every branch's whole prompt in the radix cache: all but the last token.
    second = forked.run(header=header, suffixes=suffixes)
    assert second["bodies"] == first["bodies"]
    assert second["cached"] == [n - 1 for n in second["prompt_tokens"]], second["cached"]


def test_shipped_example_runs(server):
    url, _ = server
    spec = importlib.util.spec_from_file_location("sglang_frontend_example", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    out = example.run(url)
    assert out["returns"] in ("None", "self", "True")
    assert out["method_text"].endswith("return " + out["returns"])
    assert out["method_text"].startswith('    def close(self):\n        """' + out["docstring"])
    assert out["class_text"].startswith("class Reader:\n    def read(self")
    assert out["class_text"].count("\n        pass\n") == 3
