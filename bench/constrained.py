"""Constrained decoding through the integrated Engine: what the grammar costs, what
jump-forward saves.

One run, one tiny random-weight Llama (made on the fly, or ``--model``), per JSON schema
``--requests`` requests submitted together (continuous batching, overlap scheduling on):

1. ``free``: unconstrained, as many tokens per request as ``plain`` produced (ignore_eos).
2. ``plain``: constrained, ``disable_jump_forward``: one forward pass per output token.
3. ``jump``: constrained with jump-forward: forced text is appended without decode steps and
   computed as one extend in the request's next pass.

Constrained requests sample (seeded) with a logit bias toward tokens holding a closing
character and toward EOS, so a random model's strings and numbers end (as the tests do).
Reported: forward passes per request (batches it took part in), output tokens/s of the whole
batch (best of ``--repeats`` runs), and whether every output parses and validates. The free
requests carry the same logit bias, so only the grammar differs. Then, at batch 32 (``plain``,
overlap off so the timings are clean), the scheduler's grammar work per decode step (building
the batch mask, accepting the sampled tokens) and the sampler's mask application, against one
decode step of the model.

    python bench/constrained.py                # ~1 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections import Counter

import jsonschema
import torch

from radixray.cluster import Engine
from radixray.worker.vocab_mask import apply_vocab_mask_

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



def closing_bias(tokenizer) -> dict[int, float]:
    bias = {i: 3.0 for i in range(len(tokenizer))
            if any(c in tokenizer.decode([i]) for c in '"}]),;')}
    bias[tokenizer.eos_token_id] = 3.0
    return bias


def count_passes(engine: Engine) -> Counter:
    """Count, per request id, the forward batches it takes part in (wraps ``advance``)."""
    passes: Counter = Counter()
    sched = engine.scheduler
    advance = sched.advance

    def counting(batch):
        passes.update(r.rid for r in batch.reqs)
        advance(batch)

    sched.advance = counting
    return passes


def run(engine: Engine, passes: Counter, params: list[dict], tag: str, repeats: int) -> dict:
    """Run the batch ``repeats`` times (seeded: the same outputs each time); the fastest
    wall time counts, as the machine may be shared."""
    walls = []
    for k in range(repeats):
        passes.clear()
        rids = [f"{tag}-{k}-{i}" for i in range(len(params))]
        start = time.perf_counter()
        outs = engine.generate(prompt=[PROMPT] * len(params), sampling_params=params, rid=rids)
        walls.append(time.perf_counter() - start)
        engine.scheduler.check_invariant()
    wall = min(walls)
    tokens = [o["meta_info"]["completion_tokens"] for o in outs]
    counts = [passes[r] for r in rids]
    return dict(passes_mean=statistics.mean(counts), passes_min=min(counts),
                passes_max=max(counts), tokens_mean=statistics.mean(tokens),
                tok_per_s=sum(tokens) / wall, wall=wall, texts=[o["text"] for o in outs],
                reasons=[o["meta_info"]["finish_reason"]["type"] for o in outs])


def valid(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def timed(obj, name: str, sink: list, when=lambda *a: True):
    """Wrap ``obj.name`` so each call's duration is appended to ``sink`` when ``when(args)``."""
    fn = getattr(obj, name)

    def wrapper(*args):
        t = time.perf_counter()
        result = fn(*args)
        if when(*args):
            sink.append(time.perf_counter() - t)
        return result

    setattr(obj, name, wrapper)


def step_costs(model_path: str, schema: dict, batch: int, max_new: int) -> dict:
    """Per decode step at ``batch`` requests: the grammar's work in the scheduler (mask fill,
    accepts) and the model step with the mask applied, against a free decode step."""
    def full(b) -> bool:  # a decode step of the whole batch
        return b.forward_batch.batch_size == batch and b.forward_batch.is_decode_only

    with Engine(model_path, disable_overlap_schedule=True, disable_jump_forward=True,
                max_running_requests=batch) as engine:
        sched, runner = engine.scheduler, engine.runner
        fills, accepts, fwd_mask, fwd_free = [], [], [], []
        timed(sched.grammars, "fill_mask", fills, full)
        timed(sched.grammars, "on_token", accepts)
        masks = []

        def masked_step(fb) -> bool:
            if fb.vocab_mask is not None and fb.batch_size == batch and fb.is_decode_only:
                masks.append(fb.vocab_mask)
                return True
            return False
        timed(runner, "forward", fwd_mask, masked_step)
        # no logit bias here (it has a cost of its own in the sampler): requests may end at
        # their length limit instead of the grammar's end, which does not matter for timing
        params = [{"json_schema": json.dumps(schema), "max_new_tokens": max_new,
                   "temperature": 1.0, "seed": i} for i in range(batch)]
        engine.generate(prompt=[PROMPT] * batch, sampling_params=params)
        steps = len(fills)
        runner.forward = type(runner).forward.__get__(runner)
        timed(runner, "forward", fwd_free,
              lambda fb: fb.batch_size == batch and fb.is_decode_only)
        engine.generate(prompt=[PROMPT] * batch, sampling_params=[
            {"max_new_tokens": 32, "ignore_eos": True, "temperature": 1.0, "seed": i}
            for i in range(batch)])
        costs = dict(
            decode_steps_at_batch=steps,
            decode_step_free=statistics.median(fwd_free),
            decode_step_masked=statistics.median(fwd_mask),
            fill_mask=statistics.median(fills),
            # on_token runs per request; a step accepts one token for each of the batch
            accept=statistics.median(accepts) * batch,
        )
        # the sampler's mask application, timed alone on the masks these steps used
        vocab = runner.model_config.vocab_size
        logits = torch.randn(batch, vocab)
        applies = []
        for _ in range(5):  # every step's mask, five rounds (the median is over all)
            for mask in masks:
                x = logits.clone()
                t = time.perf_counter()
                apply_vocab_mask_(x, mask)
                applies.append(time.perf_counter() - t)
        costs["apply_mask"] = statistics.median(applies)
    costs["mask_work_share"] = (costs["fill_mask"] + costs["accept"] + costs["apply_mask"]) \
        / costs["decode_step_free"]
    return costs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="model folder (default: make a tiny Llama)")
    ap.add_argument("--requests", type=int, default=16, help="requests per schema and mode")
    ap.add_argument("--schemas", default=",".join(SCHEMAS))
    ap.add_argument("--batch", type=int, default=32, help="batch size for the step costs")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3, help="runs per mode; the fastest counts")
    ap.add_argument("--json", help="write the results here (default $OUT/constrained.json)")
    args = ap.parse_args()
    torch.set_num_threads(2)

    model_path = args.model
    if model_path is None:
        from radixray.worker.make_model import make_model
        model_path = make_model(tempfile.mkdtemp(prefix="radixray-bench-"), arch="llama", **TINY)
    common = dict(max_total_tokens=32768)
    jump_engine = Engine(model_path, **common)
    plain_engine = Engine(model_path, disable_jump_forward=True, **common)
    bias = closing_bias(jump_engine.tokenizer)
    passes = {"jump": count_passes(jump_engine), "plain": count_passes(plain_engine)}
    results: dict = {"requests": args.requests, "schemas": {}}

    print(f"{args.requests} requests per schema and mode, submitted together\n"
          f"{'schema':<8} {'mode':<6} {'passes/req':>15} {'tok/req':>8} {'tok/s':>8} "
          f"{'valid':>6}")
    for name in args.schemas.split(","):
        schema = SCHEMAS[name]
        params = [{"json_schema": json.dumps(schema), "max_new_tokens": args.max_new_tokens,
                   "temperature": 1.0, "seed": i, "logit_bias": bias}
                  for i in range(args.requests)]
        for engine in (jump_engine, plain_engine):  # compile the grammar, warm the caches
            engine.generate(prompt=PROMPT, sampling_params=params[0])
        row: dict = {}
        row["plain"] = run(plain_engine, passes["plain"], params, f"{name}-plain", args.repeats)
        row["jump"] = run(jump_engine, passes["jump"], params, f"{name}-jump", args.repeats)
        n_free = round(row["plain"]["tokens_mean"])
        row["free"] = run(jump_engine, passes["jump"], [
            {"max_new_tokens": n_free, "ignore_eos": True, "temperature": 1.0, "seed": i,
             "logit_bias": bias} for i in range(args.requests)], f"{name}-free", args.repeats)
        for mode in ("plain", "jump"):
            r = row[mode]
            r["valid"] = sum(reason == "stop" and valid(text, schema)
                             for text, reason in zip(r["texts"], r["reasons"]))
        row["pass_reduction"] = 1 - row["jump"]["passes_mean"] / row["plain"]["passes_mean"]
        for mode in ("free", "plain", "jump"):
            r = row[mode]
            span = f"{r['passes_mean']:.1f} ({r['passes_min']}-{r['passes_max']})"
            ok = f"{r['valid']}/{args.requests}" if mode != "free" else "-"
            print(f"{name:<8} {mode:<6} {span:>15} {r['tokens_mean']:>8.1f} "
                  f"{r['tok_per_s']:>8.0f} {ok:>6}")
        print(f"{name:<8} jump-forward: {row['pass_reduction']:.0%} fewer forward passes, "
              f"{row['jump']['tok_per_s'] / row['plain']['tok_per_s']:.2f}x tok/s vs plain; "
              f"plain runs at {row['plain']['tok_per_s'] / row['free']['tok_per_s']:.2f}x "
              f"and jump at {row['jump']['tok_per_s'] / row['free']['tok_per_s']:.2f}x the "
              f"free tok/s")
        print(f"         example: {row['jump']['texts'][0]}")
        for mode in ("free", "plain", "jump"):
            del row[mode]["texts"], row[mode]["reasons"]
        results["schemas"][name] = row
    jump_engine.shutdown()
    plain_engine.shutdown()

    first = args.schemas.split(",")[0]
    costs = step_costs(model_path, SCHEMAS[first], args.batch, 48)
    results["step_costs"] = costs
    print(f"\nper decode step at batch {args.batch} (schema {first}, jump-forward off, overlap "
          f"off; medians over {costs['decode_steps_at_batch']} steps):")
    for key in ("decode_step_free", "decode_step_masked", "fill_mask", "accept",
                "apply_mask"):
        share = "" if key.startswith("decode") else \
            f"  {costs[key] / costs['decode_step_free']:6.1%}"
        print(f"  {key:<20} {costs[key] * 1e3:8.3f} ms{share}")
    print(f"  mask work (fill + accept + apply) = {costs['mask_work_share']:.1%} of a free "
          f"decode step")

    path = args.json or (os.path.join(os.environ["OUT"], "constrained.json")
                         if os.environ.get("OUT") else None)
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
