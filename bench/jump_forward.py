"""Jump-forward benchmark: what constrained decoding costs and what jump-forward saves.

One run, one tiny random-weight Llama (made on the fly, or ``--model``), side by side per JSON
schema, each request run alone (batch 1) through HF's forward with a KV cache:

1. ``free``: unconstrained sampling of as many tokens as the constrained requests produced.
2. ``plain``: the grammar's mask on every step, one forward pass per output token.
3. ``jump``: the same with jump-forward (``GrammarState.jump_forward``): forced text is appended
   without decode steps, the boundary re-tokenized, and the next forward runs as an extend over
   the cached prefix (cropping the KV of retracted tokens).

Reported: forward passes per request, output tokens/s, how much of the text was forced, and
whether every output parses and validates. Then the per-step grammar work at batch 32
(mask fill, the sampler's mask application, accepts, the jump check) against one decode step of
the same model at batch 32.

    python bench/jump_forward.py                  # ~1 min on 2 cores
    python bench/jump_forward.py --requests 4     # quicker
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time

import jsonschema
import torch

from radixray.scheduler.grammar import GrammarBackend
from radixray.scheduler.grammar_state import MaskFiller
from radixray.worker.sampler import unpack_vocab_mask

TINY = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
            vocab_size=2048, max_position=4096, seed=0)
PROMPT = "Reply with one JSON object describing a person:"

SCHEMAS = {
    # four fixed keys, an enum and a boolean (the example shape)
    "four_keys": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12},
                       "age": {"type": "integer", "minimum": 0, "maximum": 120},
                       "color": {"enum": ["red", "green", "blue"]},
                       "married": {"type": "boolean"}},
        "required": ["name", "age", "color", "married"],
    },
    "nested": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 9999},
            "profile": {"type": "object",
                        "properties": {"username": {"type": "string", "maxLength": 10},
                                       "email_verified": {"type": "boolean"},
                                       "role": {"enum": ["administrator", "user", "guest"]}},
                        "required": ["username", "email_verified", "role"]},
            "tags": {"type": "array", "items": {"enum": ["alpha", "beta", "gamma"]},
                     "maxItems": 3},
        },
        "required": ["id", "profile", "tags"],
    },
    "flags": {
        "type": "object",
        "properties": {k: {"type": "boolean"} for k in
                       ("is_active", "has_subscription", "accepts_marketing", "is_verified")}
        | {"tier": {"enum": ["free", "pro", "enterprise"]}},
        "required": ["is_active", "has_subscription", "accepts_marketing", "is_verified", "tier"],
    },
}


class Runner:
    """One request at a time through HF's forward, keeping a KV cache across passes."""

    def __init__(self, model_path: str):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(model_path).eval()
        self.vocab_size = self.model.config.vocab_size
        self.eos = self.tokenizer.eos_token_id

    def start(self) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache(config=self.model.config)
        self.fed: list[int] = []  # tokens whose K/V sit in the cache

    @torch.no_grad()
    def logits(self, seq: list[int]) -> torch.Tensor:
        """Next-token logits after ``seq``: crops the cache to the longest prefix it shares
        with ``seq`` (retracted tokens leave) and runs the rest as one extend."""
        common = 0
        while common < min(len(self.fed), len(seq)) and self.fed[common] == seq[common]:
            common += 1
        common = min(common, len(seq) - 1)  # at least one token to compute
        if common < len(self.fed):
            self.cache.crop(common - len(self.fed))
        out = self.model(input_ids=torch.tensor([seq[common:]]), past_key_values=self.cache,
                         use_cache=True)
        self.fed = list(seq)
        return out.logits[0, -1].float()


def run_constrained(runner: Runner, backend: GrammarBackend, compiled, prompt: list[int],
                    jump: bool, gen: torch.Generator, max_new: int) -> dict:
    tok = runner.tokenizer
    fill = MaskFiller(backend.vocab)
    state = backend.new_state(compiled)
    output: list[int] = []
    passes = forced_chars = eos_only = 0
    runner.start()
    start = time.perf_counter()
    while not state.is_terminated() and len(output) < max_new:
        if jump:
            j = state.jump_forward(tok, output)
            if j is not None:
                before = len(tok.decode(output))
                output = output[:len(output) - j.retract] + j.tokens
                forced_chars += len(tok.decode(output)) - before
            eos_only += state.only_stop_allowed()  # a pass that can only pick EOS
        logits = runner.logits(prompt + output)
        passes += 1
        logits.masked_fill_(~unpack_vocab_mask(fill([state]), runner.vocab_size)[0],
                            float("-inf"))
        token = int(torch.multinomial(logits.softmax(-1), 1, generator=gen))
        assert state.accept(token)
        output.append(token)
    wall = time.perf_counter() - start
    text = tok.decode(output, skip_special_tokens=True)
    return dict(passes=passes, tokens=len(output), chars=len(text), forced_chars=forced_chars,
                eos_only=eos_only, wall=wall, text=text, terminated=state.is_terminated())


def run_free(runner: Runner, prompt: list[int], n: int, gen: torch.Generator) -> dict:
    runner.start()
    output: list[int] = []
    start = time.perf_counter()
    for _ in range(n):
        logits = runner.logits(prompt + output)
        output.append(int(torch.multinomial(logits.softmax(-1), 1, generator=gen)))
    return dict(passes=n, tokens=n, wall=time.perf_counter() - start)


def valid(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def step_costs(runner: Runner, backend: GrammarBackend, compiled, outputs: list[list[int]],
               batch: int, reps: int, context: int = 64) -> dict:
    """Per-step grammar work for ``batch`` requests at random points of real outputs, and one
    decode step of the model at that batch size (median seconds)."""
    from transformers import DynamicCache

    rng = random.Random(0)
    states = []
    while len(states) < batch:
        out = rng.choice(outputs)
        s = backend.new_state(compiled, out[:rng.randrange(len(out) - 1)])  # before EOS
        states.append(s)
    vocab = runner.vocab_size

    def median(fn) -> float:
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    fill1, fill2 = MaskFiller(backend.vocab, 1), MaskFiller(backend.vocab, 2)
    mask = fill1(states)
    logits = torch.randn(batch, vocab)
    tokens = [int(torch.multinomial(logits[i].masked_fill(~unpack_vocab_mask(mask, vocab)[i],
                                                          float("-inf")).softmax(-1), 1))
              for i in range(batch)]

    def accept_all():
        for s, t in zip(states, tokens):
            s.accept(t)
        for s in states:
            s.rollback(1)

    cache = DynamicCache(config=runner.model.config)
    with torch.no_grad():
        runner.model(input_ids=torch.randint(5, vocab, (batch, context)), past_key_values=cache,
                     use_cache=True)
        step_ids = torch.randint(5, vocab, (batch, 1))

        def decode_step():
            runner.model(input_ids=step_ids, past_key_values=cache, use_cache=True)
            cache.crop(-1)

        costs = dict(
            decode_step=median(decode_step),
            fill_mask_1_thread=median(lambda: fill1(states)),
            fill_mask_2_threads=median(lambda: fill2(states)),
            apply_mask=median(lambda: logits.clone().masked_fill_(
                ~unpack_vocab_mask(mask, vocab), float("-inf"))),
            accept=median(accept_all),
            jump_check=median(lambda: [s.matcher.find_jump_forward_string() for s in states]),
        )
    return costs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="model folder (default: make a tiny Llama)")
    ap.add_argument("--requests", type=int, default=12, help="requests per schema and mode")
    ap.add_argument("--schemas", default=",".join(SCHEMAS))
    ap.add_argument("--batch", type=int, default=32, help="batch size for the step costs")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--json", help="write the results here (default $OUT/jump_forward.json)")
    args = ap.parse_args()
    torch.set_num_threads(2)

    model_path = args.model
    if model_path is None:
        from radixray.worker.make_model import make_model
        model_path = make_model(tempfile.mkdtemp(prefix="radixray-bench-"), arch="llama", **TINY)
    runner = Runner(model_path)
    backend = GrammarBackend(runner.tokenizer, runner.vocab_size)
    prompt = runner.tokenizer.encode(PROMPT)
    results: dict = {"requests": args.requests, "schemas": {}}

    print(f"{'schema':<10} {'mode':<6} {'passes/req':>14} {'tok/req':>8} {'tok/s':>8} "
          f"{'forced':>7} {'valid':>6}")
    for name in args.schemas.split(","):
        schema = SCHEMAS[name]
        compiled = backend.compile("json_schema", json.dumps(schema))
        row: dict = {}
        outputs = []
        for mode in ("plain", "jump"):
            gen = torch.Generator().manual_seed(1)
            runs = [run_constrained(runner, backend, compiled, prompt, mode == "jump", gen,
                                    args.max_new_tokens) for _ in range(args.requests)]
            if mode == "plain":
                outputs = [runner.tokenizer.encode(r["text"], add_special_tokens=False)
                           + [runner.eos] for r in runs]
            passes = [r["passes"] for r in runs]
            row[mode] = dict(
                passes_mean=statistics.mean(passes), passes_min=min(passes),
                passes_max=max(passes),
                tokens_mean=statistics.mean(r["tokens"] for r in runs),
                tok_per_s=sum(r["tokens"] for r in runs) / sum(r["wall"] for r in runs),
                forced_fraction=sum(r["forced_chars"] for r in runs)
                / max(sum(r["chars"] for r in runs), 1),
                chars_mean=statistics.mean(r["chars"] for r in runs),
                eos_only_passes=sum(r["eos_only"] for r in runs) / len(runs),
                valid=sum(r["terminated"] and valid(r["text"], schema) for r in runs),
                example=runs[0]["text"])
        gen = torch.Generator().manual_seed(1)
        n_free = round(row["plain"]["tokens_mean"])
        free = [run_free(runner, prompt, n_free, gen) for _ in range(args.requests)]
        row["free"] = dict(passes_mean=n_free, passes_min=n_free, passes_max=n_free,
                           tokens_mean=n_free,
                           tok_per_s=sum(r["tokens"] for r in free) / sum(r["wall"] for r in free))
        row["pass_reduction"] = 1 - row["jump"]["passes_mean"] / row["plain"]["passes_mean"]
        row["step_costs"] = step_costs(runner, backend, compiled, outputs, args.batch, reps=30)
        results["schemas"][name] = row
        for mode in ("free", "plain", "jump"):
            r = row[mode]
            span = f"{r['passes_mean']:.1f} ({r['passes_min']}-{r['passes_max']})"
            forced = f"{r['forced_fraction']:.0%}" if mode == "jump" else "-"
            ok = f"{r['valid']}/{args.requests}" if mode != "free" else "-"
            print(f"{name:<10} {mode:<6} {span:>14} {r['tokens_mean']:>8.1f} "
                  f"{r['tok_per_s']:>8.0f} {forced:>7} {ok:>6}")
        print(f"{name:<10} jump-forward: {row['pass_reduction']:.0%} fewer forward passes, "
              f"{row['jump']['tok_per_s'] / row['plain']['tok_per_s']:.2f}x tok/s vs plain; "
              f"plain is {row['plain']['tok_per_s'] / row['free']['tok_per_s']:.2f}x free; "
              f"{row['jump']['eos_only_passes']:.1f} pass/req could only pick EOS")
        print(f"           example: {row['jump']['example']}")

    print(f"\nper-step grammar work at batch {args.batch} vs one decode step "
          f"(schema {name}, median of 30):")
    costs = results["schemas"][name]["step_costs"]
    for key, value in costs.items():
        share = "" if key == "decode_step" else f"  {value / costs['decode_step']:6.1%}"
        print(f"  {key:<20} {value * 1e3:8.3f} ms{share}")
    per_step = (costs["fill_mask_1_thread"] + costs["apply_mask"] + costs["accept"]) \
        / costs["decode_step"]
    print(f"  fill (1 thread) + apply + accept = {per_step:.1%} of a decode step")
    results["mask_work_share"] = per_step

    path = args.json or (os.path.join(os.environ["OUT"], "jump_forward.json")
                         if os.environ.get("OUT") else None)
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=1)
    backend.shutdown()


if __name__ == "__main__":
    main()
