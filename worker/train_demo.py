"""Train the built-in demo model: a small Llama that writes recognisable Python.

    python -m radixray.worker.train_demo --out DIR        (or: radixray train-demo-model DIR)

The folder is made by ``make_model`` (config, byte-level BPE tokenizer trained on the stdlib,
chat template), then its weights are replaced by a model trained with HF transformers on the
same text the tokenizer saw: the top-level ``.py`` files of Python's stdlib, so no download is
needed. Defaults take ~35 minutes on 2 CPU cores and give a ~4 MB float16 checkpoint that
both transformers and radixray's own Llama load. The committed copy lives in ``demo_model/``
next to this file; ``ensure_default_model`` serves it.

Same arguments, same torch build and thread count give the same weights: one seeded generator
draws the initial weights and every batch.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import time

from .make_model import BOS, EOS, make_model, stdlib_corpus_files

DEMO_ARCH = dict(arch="llama", hidden_size=192, num_layers=4, num_heads=6, num_kv_heads=2,
                 intermediate_size=512, vocab_size=2048, max_position=2048,
                 tie_word_embeddings=True, dtype="float16")
VAL_EVERY = 50  # every 50th corpus file is held out for the validation loss


def corpus_token_streams(tokenizer) -> tuple[list[int], list[int]]:
    """(train, validation) token streams: each file's tokens followed by EOS, files in name
    order; every ``VAL_EVERY``-th file goes to validation."""
    eos = tokenizer.convert_tokens_to_ids(EOS)
    train, val = [], []
    for i, path in enumerate(stdlib_corpus_files()):
        with open(path, encoding="utf-8", errors="replace") as f:
            ids = tokenizer.encode(f.read(), add_special_tokens=False)
        (val if i % VAL_EVERY == 0 else train).extend(ids + [eos])
    return train, val


def batches(stream, bos_id: int, batch_size: int, seq_len: int, gen):
    """Endless random windows of the stream, each as [BOS] + seq_len tokens: every prompt the
    server sees starts with BOS too, so the model learns that anything may follow it."""
    import torch

    data = torch.tensor(stream, dtype=torch.long)
    while True:
        starts = torch.randint(0, len(data) - seq_len, (batch_size,), generator=gen)
        body = torch.stack([data[s:s + seq_len] for s in starts.tolist()])
        yield torch.cat([torch.full((batch_size, 1), bos_id), body], dim=1)


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train_demo_model(out_dir: str, steps: int = 1200, batch_size: int = 16, seq_len: int = 256,
                     lr: float = 2e-3, seed: int = 0, threads: int = 2,
                     log_every: int = 50) -> dict:
    """Write a trained demo model folder to ``out_dir`` (created; files overwritten).

    Sets torch's thread count to ``threads`` for the process. Returns the training log (also
    saved as ``train_log.json`` in the folder): arguments, seconds, loss curve, final losses.
    """
    import torch

    for field, value in [("steps", steps), ("batch_size", batch_size), ("seq_len", seq_len),
                         ("threads", threads), ("log_every", log_every)]:
        if value < 1:
            raise ValueError(f"{field} must be >= 1, got {value}")
    if lr <= 0:
        raise ValueError(f"lr must be > 0, got {lr}")
    torch.set_num_threads(threads)
    start = time.perf_counter()
    # Built in a temporary folder and moved in at the end, so ``out_dir`` never holds the
    # random weights make_model writes first (ensure_default_model may be serving it).
    os.makedirs(out_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir, prefix=".train-") as tmp:
        log = _train(tmp, steps, batch_size, seq_len, lr, seed, log_every, start)
        for name in os.listdir(tmp):
            os.chmod(os.path.join(tmp, name), 0o644)  # safetensors writes 0600
            os.replace(os.path.join(tmp, name), os.path.join(out_dir, name))
    return log


def _train(out_dir, steps, batch_size, seq_len, lr, seed, log_every, start) -> dict:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    make_model(out_dir, seed=seed, **DEMO_ARCH)  # config, tokenizer, chat template; weights redone
    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    train, val = corpus_token_streams(tokenizer)
    bos_id = tokenizer.convert_tokens_to_ids(BOS)

    torch.manual_seed(seed)  # HF's own init (std 0.02) trains better than make_model's std 0.25
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(out_dir),
                                             dtype=torch.float32)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(seed)
    curve, window = [], []
    model.train()
    for step, x in zip(range(steps), batches(train, bos_id, batch_size, seq_len, gen)):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr, warmup=min(100, steps // 10 + 1))
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        window.append(loss.item())
        if (step + 1) % log_every == 0 or step + 1 == steps:
            curve.append([step + 1, round(sum(window) / len(window), 4)])
            window = []
            print(f"step {step + 1}/{steps} loss {curve[-1][1]:.3f} "
                  f"({time.perf_counter() - start:.0f}s)", flush=True)

    val_loss = evaluate(model, val, bos_id, seq_len)
    model = model.to(torch.float16)
    model.save_pretrained(out_dir)  # replaces make_model's random weights
    log = {"args": dict(steps=steps, batch_size=batch_size, seq_len=seq_len, lr=lr, seed=seed,
                        threads=torch.get_num_threads(), torch=torch.__version__, **DEMO_ARCH),
           "train_tokens": len(train), "val_tokens": len(val),
           "seconds": round(time.perf_counter() - start, 1), "loss_curve": curve,
           "val_loss": round(val_loss, 4)}
    with open(os.path.join(out_dir, "train_log.json"), "w") as f:
        json.dump(log, f, indent=1)
    return log


def evaluate(model, stream, bos_id: int, seq_len: int, max_windows: int = 64) -> float:
    """Mean next-token loss over consecutive [BOS] + seq_len windows of ``stream``."""
    import torch

    model.eval()
    losses = []
    with torch.no_grad():
        for s in range(0, min(len(stream) - seq_len, max_windows * seq_len), seq_len):
            x = torch.tensor([[bos_id] + stream[s:s + seq_len]])
            losses.append(model(input_ids=x, labels=x).loss.item())
    return sum(losses) / max(1, len(losses))


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The training flags (mutates ``p``)."""
    p.add_argument("out", nargs="?", default=None, metavar="DIR",
                   help="folder to write; None: --out, else demo_model/ in the package")
    p.add_argument("--out", dest="out_flag", default=None, metavar="DIR",
                   help="same as the positional DIR")
    p.add_argument("--steps", type=int, default=1200, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per sequence, after BOS")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    p.add_argument("--seed", type=int, default=0, help="seeds the weights and the batches")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--log-every", type=int, default=50, help="steps per printed loss")


def run(args: argparse.Namespace) -> int:
    import sys

    from .make_model import DEMO_MODEL_DIR

    out = args.out or args.out_flag or DEMO_MODEL_DIR
    try:
        log = train_demo_model(out, steps=args.steps, batch_size=args.batch_size,
                               seq_len=args.seq_len, lr=args.lr, seed=args.seed,
                               threads=args.threads, log_every=args.log_every)
    except ValueError as e:
        print(f"radixray train-demo-model: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote the demo model to {out} in {log['seconds']}s: loss "
          f"{log['loss_curve'][0][1]} -> {log['loss_curve'][-1][1]}, val {log['val_loss']}")
    return 0


if __name__ == "__main__":
    import sys

    parser = argparse.ArgumentParser(prog="python -m radixray.worker.train_demo",
                                     description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
