"""The committed built-in demo model (worker/demo_model/, made by worker/train_demo.py): it is
what `radixray serve` uses by default, radixray's greedy tokens equal HF's on it, and it was
trained: it predicts held-out Python far better than chance and writes mostly real words, where
a random-weight model writes fragments."""

from __future__ import annotations

import filecmp
import json
import os
import re

import pytest
from safetensors import safe_open

from hf_reference import hf_greedy
from radixray.cluster.engine import Engine
from radixray.worker.make_model import DEMO_MODEL_DIR, ensure_default_model, stdlib_corpus_files
from radixray.worker.model_config import ModelConfig

pytestmark = pytest.mark.skipif(not os.path.isfile(os.path.join(DEMO_MODEL_DIR,
                                                                "model.safetensors")),
                                reason="no trained demo model in this tree")

HELD_OUT = '''def read_config(path):
    """Return the settings in the file at path as a dict."""
    with open(path) as f:
        return json.load(f)
'''
WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@pytest.fixture(scope="module")
def engine():
    with Engine(max_total_tokens=4096, random_seed=0) as eng:  # no path: the demo model
        assert eng.model_path == DEMO_MODEL_DIR
        yield eng


@pytest.fixture(scope="module")
def corpus_words() -> set[str]:
    words = set()
    for path in stdlib_corpus_files():
        with open(path, encoding="utf-8", errors="replace") as f:
            words.update(WORD.findall(f.read()))
    return words


def test_serve_uses_the_committed_model_and_it_is_small(monkeypatch, tmp_path):
    monkeypatch.delenv("RADIXRAY_MODEL_DIR", raising=False)
    assert ensure_default_model() == DEMO_MODEL_DIR
    cfg = ModelConfig.from_pretrained(DEMO_MODEL_DIR)
    assert cfg.architecture == "llama" and cfg.tie_word_embeddings
    weights = os.path.join(DEMO_MODEL_DIR, "model.safetensors")
    assert os.path.getsize(weights) < 8 * 2**20
    with safe_open(weights, framework="pt") as f:
        assert {str(f.get_slice(k).get_dtype()) for k in f.keys()} == {"F16"}
    with open(os.path.join(DEMO_MODEL_DIR, "train_log.json")) as f:
        log = json.load(f)
    assert log["loss_curve"][-1][1] < log["loss_curve"][0][1] - 2  # it did learn
    # a RADIXRAY_MODEL_DIR without weights gets a copy of the demo model
    target = tmp_path / "models" / "demo"
    monkeypatch.setenv("RADIXRAY_MODEL_DIR", str(target))
    assert ensure_default_model() == str(target)
    assert filecmp.cmp(weights, target / "model.safetensors", shallow=False)


def test_greedy_equals_hf(engine):
    prompt = "class Queue:\n    def __init__(self"
    ids = engine.tokenizer.encode(prompt)
    out = engine.generate(input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": 32,
                                                          "ignore_eos": True})
    assert out["output_ids"] == hf_greedy(DEMO_MODEL_DIR, ids, 32)


def test_predicts_held_out_python_far_better_than_chance(engine):
    out = engine.generate(HELD_OUT, sampling_params={"max_new_tokens": 0}, return_logprob=True,
                          logprob_start_len=0)
    values = [e[0] for e in out["meta_info"]["input_token_logprobs"] if e[0] is not None]
    mean = sum(values) / len(values)
    # chance is log(1/2048) = -7.6 nats; the tests' random-weight tiny Llama scores -15.7
    assert mean > -4.0, mean  # the committed model: -2.9


@pytest.mark.parametrize("params", [{"temperature": 0},
                                    {"temperature": 0.7, "top_p": 0.9, "seed": 1}])
def test_writes_real_words(engine, corpus_words, params):
    prompts = ["def ", "import os\n\n\nclass ", "    # Return the "]
    outs = engine.generate(prompts, sampling_params={"max_new_tokens": 48, **params})
    text = "".join(o["text"] for o in outs)
    words = WORD.findall(text)
    assert len(words) >= 20, text
    known = sum(w in corpus_words for w in words) / len(words)
    printable = sum(c.isascii() and (c.isprintable() or c in "\n\t") for c in text) / len(text)
    # the committed model: 0.96 greedy, 0.86 sampled, printable 1.0; a random one: 0.43, 0.986
    assert known >= 0.7 and printable >= 0.99, (known, printable, text)
