"""The built-in model maker: folders that transformers loads, a sound tokenizer, seeded weights."""

import json
import os
import statistics
import unicodedata

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from radixray.cluster.cli import main
from radixray.worker.make_model import (BOS, EOS, IM_END, IM_START, PAD, default_model_dir,
                                        ensure_default_model, make_model, train_tokenizer)
from radixray.worker.model_config import ModelConfig

TEXTS = [
    "Hello, world!",
    "def f(x):\n    return x ** 2  # square\n",
    "  leading spaces, trailing spaces   ",
    "tabs\tand\r\nCRLF\r\n\n\nblank lines",
    "Ünïcödé: naïve café, Straße, Ελληνικά, русский, 日本語のテキスト, 한국어",
    "emoji 🙂🚀 and symbols ∑∫√ ≠ ≤ ™ €",
    "numbers 1234567890 3.14159 -42 1e-9",
    "contractions: don't, I'M, we've, they'll",
    "spaced punctuation a , b . c ! d ? it 's do n't",  # HF's clean-up would eat these spaces
    "",
    " ",
]


@pytest.fixture(params=["llama", "qwen2"])
def arch_path(request, tiny_llama_path, tiny_qwen2_path):
    return request.param, (tiny_llama_path if request.param == "llama" else tiny_qwen2_path)


def test_folder_loads_with_transformers(arch_path):
    arch, path = arch_path
    for name in ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json"]:
        assert os.path.isfile(os.path.join(path, name)), name
    cfg = AutoConfig.from_pretrained(path)
    assert cfg.model_type == arch
    assert cfg.architectures == ["LlamaForCausalLM" if arch == "llama" else "Qwen2ForCausalLM"]
    assert cfg.tie_word_embeddings is (arch == "qwen2")

    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    attn = model.model.layers[0].self_attn
    if arch == "qwen2":  # qkv bias present and not zero, lm_head shares the embedding
        assert attn.q_proj.bias is not None and attn.q_proj.bias.abs().sum() > 0
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    else:
        assert attn.q_proj.bias is None
        assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    with torch.no_grad():
        logits = model(torch.tensor([[5, 6, 7, 8]])).logits
    assert logits.shape == (1, 4, 2048) and torch.isfinite(logits).all()

    tok = AutoTokenizer.from_pretrained(path)
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == (BOS, EOS, PAD)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2)
    assert len(tok) == 2048
    ids = tok("hello")["input_ids"]
    assert (ids[0] == tok.bos_token_id) is (arch == "llama")  # only llama prepends BOS
    gen = json.load(open(os.path.join(path, "generation_config.json")))
    assert gen["eos_token_id"] == [1, tok.convert_tokens_to_ids(IM_END)]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tokenizer_round_trip_and_ids_match_raw(arch, tiny_llama_path, tiny_qwen2_path):
    path = tiny_llama_path if arch == "llama" else tiny_qwen2_path
    hf = AutoTokenizer.from_pretrained(path)
    raw = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    trained = train_tokenizer(2048, arch)
    for text in TEXTS:
        ids = hf(text, add_special_tokens=False)["input_ids"]
        assert hf.decode(ids) == text
        assert raw.decode(raw.encode(text, add_special_tokens=False).ids) == text
        # AutoTokenizer (Qwen2Tokenizer for qwen2) gives exactly the trained ids
        assert hf(text)["input_ids"] == raw.encode(text).ids == trained.encode(text).ids, text
    code = TEXTS[1]  # BPE merges were learnt: stdlib-like code compresses well below 1 id/byte
    assert len(hf(code, add_special_tokens=False)["input_ids"]) < len(code.encode()) / 2
    # special tokens in text are single ids
    assert hf(f"{IM_START}user", add_special_tokens=False)["input_ids"][0] == 3
    # qwen2 normalises to NFC (as Qwen does); llama keeps the bytes as they are
    decomposed = unicodedata.normalize("NFD", "café naïve")
    out = hf.decode(hf(decomposed, add_special_tokens=False)["input_ids"])
    assert out == (unicodedata.normalize("NFC", decomposed) if arch == "qwen2" else decomposed)


def test_chat_template(arch_path):
    arch, path = arch_path
    tok = AutoTokenizer.from_pretrained(path)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    body = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
    prefix = BOS if arch == "llama" else ""
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == prefix + body + "<|im_start|>assistant\n"
    assert tok.apply_chat_template(messages, tokenize=False) == prefix + body
    ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                  return_dict=True)["input_ids"]
    assert ids == tok(text, add_special_tokens=False)["input_ids"]
    assert ids.count(tok.bos_token_id) == (1 if arch == "llama" else 0)  # never a double BOS


def _weights(path):
    return load_file(os.path.join(path, "model.safetensors"))


def test_seed_determines_weights(tiny_llama_path, tmp_path):
    same = make_model(str(tmp_path / "same"), arch="llama", seed=0)
    other = make_model(str(tmp_path / "other"), arch="llama", seed=1)
    a, b, c = _weights(tiny_llama_path), _weights(same), _weights(other)
    assert a.keys() == b.keys() == c.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
        assert not torch.equal(a[name], c[name]), name
    # the larger-than-HF init actually took effect
    assert 0.2 < a["model.layers.0.mlp.up_proj.weight"].std() < 0.3


def test_greedy_top2_logit_gap_is_not_a_near_tie(arch_path):
    """Greedy HF decoding must not hinge on near-tied logits, or HF-equality tests get flaky."""
    arch, path = arch_path
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    gen = torch.Generator().manual_seed(0)
    gaps = []
    with torch.no_grad():
        for _ in range(4):
            ids = torch.randint(5, 2048, (1, 12), generator=gen)
            for _ in range(12):  # no KV cache: 12 short forwards are cheap at this size
                last = model(ids).logits[0, -1]
                top2 = last.topk(2).values
                gaps.append(float(top2[0] - top2[1]))
                ids = torch.cat([ids, last.argmax().view(1, 1)], dim=1)
    assert statistics.median(gaps) > 0.2, sorted(gaps)[:5]


def test_model_config_reads_the_folder(arch_path):
    arch, path = arch_path
    mc = ModelConfig.from_pretrained(path)
    assert (mc.architecture, mc.vocab_size, mc.hidden_size, mc.num_layers) == (arch, 2048, 64, 2)
    assert (mc.num_heads, mc.num_kv_heads, mc.head_dim, mc.intermediate_size) == (4, 2, 16, 128)
    assert mc.max_position_embeddings == 2048 and mc.rms_norm_eps == 1e-6
    assert mc.rope_theta == 10000.0 and mc.rope_scaling.rope_type == "default"
    assert mc.tie_word_embeddings is (arch == "qwen2") and mc.qkv_bias is (arch == "qwen2")
    assert mc.bos_token_id == 0 and mc.eos_token_ids == (1, 4)
    assert mc.torch_dtype == "float32"


def test_llama3_rope_scaling_and_bfloat16(tmp_path):
    path = make_model(str(tmp_path / "m"), arch="llama", max_position=512, dtype="bfloat16",
                      rope_scaling={"rope_type": "llama3", "factor": 4.0,
                                    "original_max_position_embeddings": 128})
    mc = ModelConfig.from_pretrained(path)
    assert mc.rope_scaling.rope_type == "llama3" and mc.rope_scaling.factor == 4.0
    assert mc.rope_scaling.original_max_position_embeddings == 128
    assert mc.rope_scaling.high_freq_factor == 4.0 and mc.torch_dtype == "bfloat16"
    assert all(t.dtype == torch.bfloat16 for t in _weights(path).values())
    hf = AutoConfig.from_pretrained(path)
    assert hf.rope_parameters["rope_type"] == "llama3" and hf.rope_parameters["factor"] == 4.0


def test_bad_arguments_name_the_field(tmp_path):
    out = str(tmp_path / "x")
    for kwargs, field in [({"arch": "gpt2"}, "arch"), ({"vocab_size": 100}, "vocab_size"),
                          ({"num_heads": 3}, "num_heads"), ({"num_kv_heads": 3}, "num_kv_heads"),
                          ({"dtype": "int8"}, "dtype"), ({"num_layers": 0}, "num_layers"),
                          ({"arch": "qwen2", "rope_scaling": {"rope_type": "llama3"}},
                           "rope_scaling"),
                          ({"rope_scaling": {"rope_type": "yarn"}}, "rope_scaling")]:
        with pytest.raises(ValueError, match=field):
            make_model(out, **kwargs)


def test_cli_make_model(tmp_path, capsys):
    out = str(tmp_path / "cli")
    rc = main(["make-model", out, "--arch", "qwen2", "--hidden-size", "32", "--num-layers", "3",
               "--num-heads", "2", "--num-kv-heads", "1", "--intermediate-size", "48",
               "--vocab-size", "1024", "--max-position", "256", "--seed", "7"])
    assert rc == 0 and out in capsys.readouterr().out
    mc = ModelConfig.from_pretrained(out)
    assert (mc.architecture, mc.hidden_size, mc.num_layers, mc.num_heads, mc.num_kv_heads) == \
        ("qwen2", 32, 3, 2, 1)
    assert (mc.intermediate_size, mc.vocab_size, mc.max_position_embeddings) == (48, 1024, 256)
    assert mc.tie_word_embeddings
    assert AutoTokenizer.from_pretrained(out).vocab_size == 1024
    ref = make_model(str(tmp_path / "ref"), arch="qwen2", hidden_size=32, num_layers=3,
                     num_heads=2, num_kv_heads=1, intermediate_size=48, vocab_size=1024,
                     max_position=256, seed=7)
    a, b = _weights(out), _weights(ref)
    assert all(torch.equal(a[k], b[k]) for k in a)  # --seed reached the weights

    assert main(["make-model", str(tmp_path / "bad"), "--num-heads", "3"]) == 2
    assert "num_heads" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["make-model", out, "--arch", "gpt2"])


def test_default_model_dir_and_ensure(tmp_path, monkeypatch):
    monkeypatch.delenv("RADIXRAY_MODEL_DIR", raising=False)
    assert default_model_dir().endswith(os.path.join(".cache", "radixray", "models",
                                                      "tiny-llama"))
    target = str(tmp_path / "models" / "demo")
    monkeypatch.setenv("RADIXRAY_MODEL_DIR", target)
    assert default_model_dir() == target
    assert ensure_default_model() == target
    weights = os.path.join(target, "model.safetensors")
    assert ModelConfig.from_pretrained(target).architecture == "llama"
    mtime = os.stat(weights).st_mtime_ns
    assert ensure_default_model() == target and os.stat(weights).st_mtime_ns == mtime  # kept
    assert os.listdir(tmp_path / "models") == ["demo"]  # no temporary folder left behind
