"""Make the project's own tiny models: an HF-style folder with seeded random weights.

There is no model hub here, so tests, demos and benchmarks use folders this module writes:

    config.json              LlamaConfig / Qwen2Config saved by transformers
    generation_config.json   bos / eos / pad ids
    model.safetensors        seeded random weights (larger init std than HF's 0.02, see below)
    tokenizer.json           byte-level BPE trained with `tokenizers` on Python's stdlib sources
    tokenizer_config.json    special tokens, tokenizer class and a ChatML-like chat template

Both `transformers.AutoModelForCausalLM` and `AutoTokenizer` load the folder, so HF is the
reference the model runner is checked against.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import sysconfig
import tempfile

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
# Order fixes the ids: <|bos|>=0, <|eos|>=1, <|pad|>=2, <|im_start|>=3, <|im_end|>=4.
SPECIAL_TOKENS = [BOS, EOS, PAD, IM_START, IM_END]

# The split regex transformers' Qwen2Tokenizer installs whatever tokenizer.json says; training
# the qwen2 tokenizer with it keeps AutoTokenizer's ids equal to the trained ones.
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# ChatML-like. Llama folders start the prompt with <|bos|> (their tokenizer adds it to plain
# text too); qwen2 folders have no BOS, as Qwen's do. Tools are shown and calls written the
# way Qwen2.5's template does (the `qwen25` tool-call parser reads them back).
_CHAT_TOOLS = (
    "{%- if tools -%}{{ '<|im_start|>system\\n# Tools\\n<tools>\\n' }}"
    "{%- for tool in tools -%}{{ tool | tojson }}{{ '\\n' }}{%- endfor -%}"
    "{{ '</tools>\\nCall a function as <tool_call>\\n{\"name\": <name>, \"arguments\": "
    "<arguments>}\\n</tool_call><|im_end|>\\n' }}{%- endif -%}"
)
_CHAT_BODY = _CHAT_TOOLS + (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') }}"
    "{%- for call in message.tool_calls or [] -%}{{ '<tool_call>\\n' }}"
    "{{ {'name': call.function.name, 'arguments': call.function.arguments} | tojson }}"
    "{{ '\\n</tool_call>' }}{%- endfor -%}"
    "{{ '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)
CHAT_TEMPLATES = {"llama": "{{- bos_token -}}" + _CHAT_BODY, "qwen2": _CHAT_BODY}

# HF initialises with std 0.02, which on a tiny random model gives near-tied top-2 logits
# (median gap ~0.03) and makes token-exact comparisons with HF flaky. Matrices get std 0.25 and
# the final norm weight is doubled, which spreads the logits (median top-2 gap ~0.8, entropy
# ~2.8 nats at hidden 64) without making attention as peaked as std 0.5 everywhere would.
DEFAULT_INIT_STD = 0.25
FINAL_NORM_SCALE = 2.0

ARCHS = ("llama", "qwen2")
DTYPES = ("float32", "bfloat16", "float16")

_TOKENIZER_CACHE: dict[tuple[int, str], str] = {}  # (vocab_size, kind) -> tokenizer JSON


def stdlib_corpus_files() -> list[str]:
    """The training text: the top-level ``.py`` files of this Python's stdlib, sorted by name."""
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    if not files:
        raise RuntimeError("no stdlib .py files found to train the tokenizer on")
    return files


def train_tokenizer(vocab_size: int, kind: str):
    """Train (or take from the in-process cache) a byte-level BPE; returns a fresh Tokenizer.

    kind "qwen2": NFC + Split(Qwen's regex) + ByteLevel(use_regex=False), no BOS added.
    kind "llama": GPT-2 style ByteLevel pre-tokenizer, BOS added in front of every encoding.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from tokenizers import processors, trainers

    if kind not in ARCHS:
        raise ValueError(f"tokenizer kind must be one of {ARCHS}, got {kind!r}")
    min_vocab = len(SPECIAL_TOKENS) + 256
    if vocab_size < min_vocab:
        raise ValueError(f"vocab_size must be >= {min_vocab} (256 bytes + special tokens), "
                         f"got {vocab_size}")
    key = (vocab_size, kind)
    if key not in _TOKENIZER_CACHE:
        tok = Tokenizer(models.BPE())
        if kind == "qwen2":
            tok.normalizer = normalizers.NFC()
            tok.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ])
        else:
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # every byte encodable
        tok.train(stdlib_corpus_files(), trainer)
        if kind == "llama":
            bos_id = tok.token_to_id(BOS)
            tok.post_processor = processors.TemplateProcessing(
                single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)])
        _TOKENIZER_CACHE[key] = tok.to_str()
    return Tokenizer.from_str(_TOKENIZER_CACHE[key])


def _build_config(arch, hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size,
                  vocab_size, max_position, tie_word_embeddings, rope_scaling, dtype, token_ids):
    from transformers import LlamaConfig, Qwen2Config

    if hidden_size % num_heads:
        raise ValueError(f"hidden_size ({hidden_size}) must be divisible by num_heads "
                         f"({num_heads})")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be divisible by num_kv_heads "
                         f"({num_kv_heads})")
    if (hidden_size // num_heads) % 2:
        raise ValueError(f"head_dim ({hidden_size // num_heads}) must be even for rotary")
    common = dict(
        vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size, max_position_embeddings=max_position,
        rms_norm_eps=1e-6, tie_word_embeddings=tie_word_embeddings, **token_ids)
    if arch == "llama":
        rope = {"rope_type": "default", "rope_theta": 10000.0}
        if rope_scaling is not None:
            rope_type = rope_scaling.get("rope_type", rope_scaling.get("type"))
            if rope_type != "llama3":
                raise ValueError(f"rope_scaling type must be 'llama3', got {rope_type!r}")
            rope = {"rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": max(max_position // 4, 1)}
            rope.update({k: v for k, v in rope_scaling.items() if k != "type"})
            rope["rope_type"] = "llama3"
        cfg = LlamaConfig(rope_parameters=rope, attention_bias=False, mlp_bias=False, **common)
    else:
        if rope_scaling is not None:
            raise ValueError("rope_scaling is only supported for arch 'llama'")
        cfg = Qwen2Config(rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                          use_sliding_window=False, **common)
    cfg.architectures = ["LlamaForCausalLM" if arch == "llama" else "Qwen2ForCausalLM"]
    cfg.dtype = dtype
    return cfg


def _init_weights(model, seed: int, init_std: float) -> None:
    """Overwrite every parameter of ``model`` in place, in name order, from one seeded generator.

    Matrices get N(0, init_std); biases N(0, init_std/2) so qkv bias loading is exercised; norm
    weights 1 + N(0, 0.1) so a loader that skips them produces different outputs (the final
    norm times FINAL_NORM_SCALE).
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if "norm" in name:
                scale = FINAL_NORM_SCALE if name == "model.norm.weight" else 1.0
                p.copy_(scale * (1.0 + 0.1 * noise))
            elif name.endswith(".bias"):
                p.copy_(0.5 * init_std * noise)
            else:
                p.copy_(init_std * noise)


def _write_tokenizer(out_dir, tok, arch, max_position):
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    tok_cfg = {
        "tokenizer_class": "TokenizersBackend" if arch == "llama" else "Qwen2Tokenizer",
        "bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": None,
        "additional_special_tokens": [IM_START, IM_END],
        "add_bos_token": arch == "llama", "add_eos_token": False,
        "clean_up_tokenization_spaces": False,  # else decode(encode(x)) != x around punctuation
        "model_max_length": max_position,
        "chat_template": CHAT_TEMPLATES[arch],
    }
    if arch == "qwen2":
        tok_cfg["add_prefix_space"] = False
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(tok_cfg, f, indent=2, ensure_ascii=False)
    with open(os.path.join(out_dir, "special_tokens_map.json"), "w") as f:
        json.dump({"bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
                   "additional_special_tokens": [IM_START, IM_END]}, f, indent=2)


def make_model(out_dir: str, arch: str = "llama", hidden_size: int = 64, num_layers: int = 2,
               num_heads: int = 4, num_kv_heads: int = 2, intermediate_size: int = 128,
               vocab_size: int = 2048, max_position: int = 2048, seed: int = 0,
               init_std: float = DEFAULT_INIT_STD, tie_word_embeddings: bool | None = None,
               rope_scaling: dict | None = None, dtype: str = "float32") -> str:
    """Write a complete HF-style model folder to ``out_dir`` (created; files overwritten).

    Same arguments give byte-identical weights. ``tie_word_embeddings`` defaults to True for
    qwen2 and False for llama. Returns ``out_dir``.
    """
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if init_std <= 0:
        raise ValueError(f"init_std must be > 0, got {init_std}")
    for field, value in [("hidden_size", hidden_size), ("num_layers", num_layers),
                         ("num_heads", num_heads), ("num_kv_heads", num_kv_heads),
                         ("intermediate_size", intermediate_size),
                         ("max_position", max_position)]:
        if value < 1:
            raise ValueError(f"{field} must be >= 1, got {value}")
    if tie_word_embeddings is None:
        tie_word_embeddings = arch == "qwen2"

    tok = train_tokenizer(vocab_size, arch)
    if tok.get_vocab_size() != vocab_size:  # the corpus runs out of merges
        raise ValueError(f"vocab_size {vocab_size} is more than the stdlib corpus supports "
                         f"(training stopped at {tok.get_vocab_size()} tokens)")
    bos_id, eos_id, pad_id = (tok.token_to_id(t) for t in (BOS, EOS, PAD))
    eos_ids = [eos_id, tok.token_to_id(IM_END)]  # chat turns end with <|im_end|>
    token_ids = dict(bos_token_id=bos_id, eos_token_id=eos_ids, pad_token_id=pad_id)

    cfg = _build_config(arch, hidden_size, num_layers, num_heads, num_kv_heads,
                        intermediate_size, vocab_size, max_position, tie_word_embeddings,
                        rope_scaling, dtype, token_ids)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    _init_weights(model, seed, init_std)  # own generator: independent of the global RNG
    model = model.to(getattr(torch, dtype))
    model.generation_config = GenerationConfig(**token_ids)

    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)  # config.json, generation_config.json, model.safetensors
    _write_tokenizer(out_dir, tok, arch, max_position)
    return out_dir


# The trained demo model committed with the package (see train_demo.py).
DEMO_MODEL_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo_model")


def default_model_dir() -> str:
    """Where a made default model lives: ``$RADIXRAY_MODEL_DIR`` or the user cache."""
    env = os.environ.get("RADIXRAY_MODEL_DIR")
    if env:
        return os.path.expanduser(env)
    return os.path.join(os.path.expanduser("~"), ".cache", "radixray", "models", "tiny-llama")


def _has_weights(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "model.safetensors"))


def ensure_default_model() -> str:
    """The built-in model's folder, made if missing; returns its path.

    Without ``$RADIXRAY_MODEL_DIR`` that is the trained demo model shipped in the package, used
    in place. Otherwise (or in a tree without ``demo_model/``) ``default_model_dir()``, filled
    if it lacks weights with a copy of the demo model, else a random-weight tiny llama; written
    to a temporary sibling and renamed, so a concurrent reader never sees half a folder.
    """
    if not os.environ.get("RADIXRAY_MODEL_DIR") and _has_weights(DEMO_MODEL_DIR):
        return DEMO_MODEL_DIR
    path = default_model_dir()
    if _has_weights(path):
        return path
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tiny-model-", dir=parent)
    try:
        if _has_weights(DEMO_MODEL_DIR):
            shutil.copytree(DEMO_MODEL_DIR, tmp, dirs_exist_ok=True)
        else:
            make_model(tmp, arch="llama")
        try:
            os.replace(tmp, path)
        except OSError:  # another process won the race, or an empty folder is in the way
            if _has_weights(path):
                return path
            shutil.rmtree(path, ignore_errors=True)
            os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path
