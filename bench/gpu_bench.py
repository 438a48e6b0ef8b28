"""GPU benchmark: a Llama-3-8B-shaped model with random weights, driven through ModelRunner.

Measures, for each attention backend that imports (torch_native, triton, flashinfer):
- decode throughput at batch 1/32/128/256 with a 1024-token context per request, eager and
  (where the backend supports it) under CUDA graphs;
- prefill throughput of one 2k-token and one 8k-token request;
- each figure against the memory-bandwidth roofline (weights + KV bytes read per step over the
  card's bandwidth) and the dense bf16 matmul peak;
- logits of every backend against torch_native on the same KV (a correctness probe).

Every timed step is idempotent (same rows, positions and slots each time), so the KV pool is
filled once and reused. Results print as they come and are rewritten to the JSON summary after
each one (``$OUT/gpu_bench.json`` when OUT is set), so a run cut short keeps what it measured.

    python bench/gpu_bench.py            # on the GPU machine, from the repo root
    python bench/gpu_bench.py --smoke    # tiny model on CPU: checks the script's logic
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_common import (CARDS, LLAMA3_8B, TINY, Report, bootstrap_import,  # noqa: E402
                        kernel_profile, seconds_per_call, sync, write_config)

bootstrap_import()

from radixray.kernels import load_attention_backend  # noqa: E402
from radixray.worker.attention import create_attention_backend  # noqa: E402
from radixray.worker.forward_batch import ForwardBatch  # noqa: E402
from radixray.worker.layer_ops import TORCH_OPS  # noqa: E402
from radixray.worker.model_runner import ModelRunner, RunnerConfig  # noqa: E402
from radixray.worker.sampling_params import SamplingParams  # noqa: E402


class Bench:
    def __init__(self, args, runner: ModelRunner, report: Report, bandwidth: float, peak: float):
        self.args, self.runner, self.report = args, runner, report
        self.bandwidth, self.peak = bandwidth, peak
        self.dev = runner.device
        mc = self.mc = runner.model_config
        with torch.no_grad():  # norm weights at 1, as trained models have them: with the
            for p in runner.model.parameters():  # dummy std 0.02 they would flatten attention
                if p.dim() == 1:  # and logits, and the logits probe would check nothing
                    p.fill_(1.0)
        embed = runner.model.model.embed_tokens.weight
        params = list({id(p): p for p in runner.model.parameters()}.values())
        total = sum(p.numel() * p.element_size() for p in params)
        tied = runner.model.lm_head.weight is embed
        # a decode step reads every weight once, except the embedding table (B rows only)
        self.weight_bytes = total - (0 if tied else embed.numel() * embed.element_size())
        d, h = mc.head_dim, mc.hidden_size
        self.layer_flops_per_token = 2 * mc.num_layers * (
            h * (mc.num_heads + 2 * mc.num_kv_heads) * d + mc.num_heads * d * h
            + 3 * h * mc.intermediate_size)
        self.head_flops_per_row = 2 * h * mc.vocab_size
        self.kv_bytes_per_token = runner.kv.bytes_per_token(
            mc.num_layers, mc.num_kv_heads, d, runner.kv.k[0].dtype)
        self.logits: dict = {}
        self.sampling = SamplingParams(temperature=0.0)  # every request's; greedy by default
        tap = runner.sampler

        def keep_logits(logits, batch):
            self.last_logits = logits
            return tap(logits, batch)

        runner.sampler = keep_logits
        # slots: a fixed random permutation, as a radix cache leaves them after some churn
        g = torch.Generator().manual_seed(0)
        self.free = (torch.randperm(runner.max_total_tokens, generator=g) + 1).tolist()
        self.ctx = args.context
        n = max(args.batch_sizes)
        self.ctx_slots = [self._take(self.ctx) for _ in range(n)]
        self.decode_slots = self._take(n)
        self.prompts = torch.randint(3, mc.vocab_size, (n, self.ctx), generator=g)
        self.decode_ids = torch.randint(3, mc.vocab_size, (n,), generator=g)
        self.prefill_slots = self._take(max(args.prefill))
        self.prefill_ids = torch.randint(3, mc.vocab_size, (max(args.prefill),), generator=g)

    def _take(self, n: int) -> torch.Tensor:
        taken, self.free = self.free[:n], self.free[n:]
        return torch.tensor(taken, dtype=torch.int64)

    def _batch(self, ids, positions, rows, prefix_lens, extend_lens, out_loc) -> ForwardBatch:
        t = lambda x: torch.as_tensor(x, dtype=torch.int64)  # noqa: E731
        return ForwardBatch(
            input_ids=t(ids), positions=t(positions), req_pool_indices=t(rows),
            prefix_lens=t(prefix_lens), extend_lens=t(extend_lens), out_cache_loc=t(out_loc),
            prefix_slots=t([]), prefix_slot_lens=t([0] * len(rows)),
            sampling_params=[self.sampling] * len(rows))

    def fill_contexts(self) -> None:
        """Prefill every decode request's context once (rows 1..n), a few requests a batch."""
        n, per = len(self.ctx_slots), max(1, self.args.fill_tokens // self.ctx)
        for lo in range(0, n, per):
            idx = range(lo, min(n, lo + per))
            batch = self._batch(self.prompts[list(idx)].flatten(),
                                torch.arange(self.ctx).repeat(len(idx)), [i + 1 for i in idx],
                                [0] * len(idx), [self.ctx] * len(idx),
                                torch.cat([self.ctx_slots[i] for i in idx]))
            self.runner.forward(batch)
        sync()

    def decode_batch(self, bs: int) -> ForwardBatch:
        return self._batch(self.decode_ids[:bs], [self.ctx] * bs, range(1, bs + 1),
                           [self.ctx] * bs, [1] * bs, self.decode_slots[:bs])

    def prefill_batch(self, tokens: int) -> ForwardBatch:
        row = max(self.args.batch_sizes) + 1
        return self._batch(self.prefill_ids[:tokens], range(tokens), [row], [0], [tokens],
                           self.prefill_slots[:tokens])

    def _time(self, step, warmup: int, iters: int) -> float:
        """Seconds per step; each step ends by reading its tokens back, as a scheduler does."""
        return seconds_per_call(lambda: step().next_token_ids.cpu(), warmup, iters)

    # ------------------------------------------------------------------------------------
    def decode(self, backend: str, graphs, bs: int) -> None:
        batch = self.decode_batch(bs)
        use_graph = graphs is not None and graphs.can_run(batch)
        forward = graphs.forward if use_graph else self.runner.forward
        step = lambda: forward(batch)  # noqa: E731
        sec = self._time(step, self.args.warmup, self.args.iters)
        keys = self.ctx + 1
        kv_bytes = bs * keys * self.kv_bytes_per_token
        flops = bs * (self.layer_flops_per_token + self.head_flops_per_row
                      + 4 * self.mc.num_layers * self.mc.num_heads * self.mc.head_dim * keys)
        roof = (self.weight_bytes + kv_bytes) / self.bandwidth
        entry = dict(phase="decode", backend=backend, cuda_graph=use_graph, batch=bs,
                     context=keys, ms=sec * 1e3, tok_s=bs / sec, roofline_ms=roof * 1e3,
                     bw_fraction=roof / sec, mfu=flops / sec / self.peak)
        self.report.add("results", entry,
                        f"decode  {backend:12s} graph={int(use_graph)} bs={bs:4d} ctx={keys}: "
                        f"{sec * 1e3:8.2f} ms/step {bs / sec:9.0f} tok/s  roofline "
                        f"{roof * 1e3:6.2f} ms -> {roof / sec:5.1%} of bandwidth, "
                        f"{flops / sec / self.peak:5.1%} of matmul peak")

    def breakdown(self, backend: str, graphs, bs: int) -> None:
        """Where a graph decode step's time goes: the replay alone (the model and logits on
        the GPU), the sampler alone (on the graph's logits, tokens read back), and the rest
        of ``CudaGraphRunner.forward`` (host-side batch copy, table write, ``prepare``, the
        future-token write): the part no kernel speeds up."""
        batch = self.decode_batch(bs)
        padded = next(s for s in graphs.sizes if s >= bs)
        graphs.forward(batch)  # the static buffers hold this batch
        full = self._time(lambda: graphs.forward(batch), self.args.warmup, self.args.iters)
        graph, logits = graphs.graphs[padded], graphs.logits[padded][:bs]

        def replay():
            graph.replay()
            sync()

        parts = {"replay": seconds_per_call(replay, self.args.warmup, self.args.iters),
                 "sampler": self._time(lambda: self.runner.sampler(logits, batch),
                                       self.args.warmup, self.args.iters)}
        rest = full - parts["replay"] - parts["sampler"]
        entry = dict(phase="decode_breakdown", backend=backend, batch=bs, ms=full * 1e3,
                     replay_ms=parts["replay"] * 1e3, sampler_ms=parts["sampler"] * 1e3,
                     host_ms=rest * 1e3)
        self.report.add("results", entry,
                        f"split   {backend:12s} graph=1 bs={bs:4d}: {full * 1e3:.2f} ms/step = "
                        f"replay {parts['replay'] * 1e3:.2f} + sampler "
                        f"{parts['sampler'] * 1e3:.2f} + host {rest * 1e3:.2f} ms")
        self.kernel_profile(backend, bs, replay)

    def kernel_profile(self, backend: str, bs: int, replay) -> None:
        launches, total_ms, top = kernel_profile(replay)
        self.report.add("results", dict(phase="decode_kernels", backend=backend, batch=bs,
                                        launches=launches, kernel_ms=total_ms, top=top),
                        f"kernels {backend:12s} graph=1 bs={bs:4d}: {launches} launches, "
                        f"{total_ms:.2f} ms of kernel time; largest: " + "; ".join(
                            f"{t['kernel'][:48]} x{t['count']} {t['ms']:.2f} ms" for t in top[:6]))

    def contiguous_decode(self, backend: str, graphs, bs: int) -> None:
        """The graph decode again with each context in one run of slots, as one prefill
        allocates them (the default layout scatters every token, the gather's worst case);
        the scattered layout is filled back afterwards."""
        scattered = self.ctx_slots
        self.ctx_slots = list(torch.cat(scattered).sort().values.split(self.ctx))
        try:
            self.fill_contexts()
            self.decode(f"{backend}/contiguous", graphs, bs)
        finally:
            self.ctx_slots = scattered
            self.fill_contexts()

    def sampled_decode(self, backend: str, graphs, bs: int) -> None:
        """The graph decode with every request sampling (temperature 0.7, top-k 50, top-p
        0.9, as chat clients ask) instead of greedy: the sampler's full-vocabulary sort."""
        self.sampling = SamplingParams(temperature=0.7, top_k=50, top_p=0.9)
        try:
            self.decode(f"{backend}/sampled", graphs, bs)
        finally:
            self.sampling = SamplingParams(temperature=0.0)

    def torch_ops_decode(self, backend: str, bs: int) -> None:
        """The same graph decode with the model's elementwise work on unfused torch ops (the
        fused kernels' baseline, worker/layer_ops.py), side by side in this process."""
        from radixray.kernels.cuda_graph import CudaGraphRunner

        modules = [m for m in self.runner.model.modules() if hasattr(m, "ops")]
        fused = modules[0].ops
        for m in modules:
            m.ops = TORCH_OPS
        try:
            self.decode(f"{backend}/torch-ops", CudaGraphRunner(self.runner, [bs]), bs)
        finally:
            for m in modules:
                m.ops = fused

    def prefill(self, backend: str, tokens: int) -> None:
        batch = self.prefill_batch(tokens)
        sec = self._time(lambda: self.runner.forward(batch), 1, self.args.prefill_iters)
        attn = 4 * self.mc.num_layers * self.mc.num_heads * self.mc.head_dim \
            * tokens * (tokens + 1) / 2
        flops = tokens * self.layer_flops_per_token + self.head_flops_per_row + attn
        roof = self.weight_bytes / self.bandwidth
        entry = dict(phase="prefill", backend=backend, cuda_graph=False, tokens=tokens,
                     ms=sec * 1e3, tok_s=tokens / sec, mfu=flops / sec / self.peak,
                     bw_fraction=roof / sec)
        self.report.add("results", entry,
                        f"prefill {backend:12s} tokens={tokens:5d}: {sec * 1e3:8.2f} ms "
                        f"{tokens / sec:9.0f} tok/s  {flops / sec / self.peak:5.1%} of matmul "
                        f"peak ({flops / sec / 1e12:.0f} TFLOP/s)")

    def probe(self, backend: str) -> None:
        """Logits of one decode batch and one prefill, compared with the first backend's
        (torch_native unless left out)."""
        for name, batch in (("decode", self.decode_batch(min(8, max(self.args.batch_sizes)))),
                            ("prefill", self.prefill_batch(min(self.args.prefill)))):
            self.runner.forward(batch)
            logits = self.last_logits.float().cpu()
            ref_backend, ref = self.logits.setdefault(name, (backend, logits))
            diff = (logits - ref).abs().max().item()
            agree = (logits.argmax(-1) == ref.argmax(-1)).float().mean().item()
            self.report.add("checks", dict(backend=backend, batch=name, reference=ref_backend,
                                           max_abs_diff=diff, argmax_agree=agree),
                            f"check   {backend:12s} {name}: max|logits - {ref_backend}| = "
                            f"{diff:.3g} (logits max {ref.abs().max().item():.3g}), argmax "
                            f"agreement {agree:.0%}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU (checks the logic)")
    p.add_argument("--backends", default=None,
                   help="comma list; default: torch_native,triton,flashinfer (those that import)")
    p.add_argument("--batch-sizes", default=None, help="decode batch sizes, comma list")
    p.add_argument("--no-graphs", action="store_true")
    p.add_argument("--budget-s", type=float, default=200.0,
                   help="skip what is left after this many seconds")
    p.add_argument("--json", default=None, help="summary path (default: $OUT/gpu_bench.json)")
    p.add_argument("--card", default=None, choices=sorted(CARDS),
                   help="roofline figures (default: guessed from the device name, else H200)")
    args = p.parse_args()
    start = time.time()
    smoke = args.smoke
    device = "cpu" if smoke else "cuda"
    if not smoke and not torch.cuda.is_available():
        print("no CUDA device; use --smoke on CPU", flush=True)
        return 2
    args.batch_sizes = [int(x) for x in args.batch_sizes.split(",")] if args.batch_sizes \
        else ([1, 4, 8] if smoke else [1, 32, 128, 256])
    args.context = 64 if smoke else 1024
    args.prefill = [128, 256] if smoke else [2048, 8192]
    args.warmup, args.iters, args.prefill_iters = (1, 2, 1) if smoke else (3, 10, 3)
    args.fill_tokens = 256 if smoke else 16384
    wanted = args.backends.split(",") if args.backends else (
        ["torch_native"] + (["triton"] if os.environ.get("TRITON_INTERPRET") == "1" else [])
        if smoke else ["torch_native", "triton", "flashinfer"])

    device_name = "cpu" if smoke else torch.cuda.get_device_name()
    card = args.card or next((c for c in CARDS if c in device_name), "H200")
    bandwidth, peak = CARDS[card]
    out_dir = os.environ.get("OUT")
    json_path = args.json or (os.path.join(out_dir, "gpu_bench.json") if out_dir else None)
    report = Report(json_path, dict(device=device_name, roofline_card=card,
                                    bandwidth_bytes_s=bandwidth, peak_flops=peak,
                                    torch=torch.__version__, smoke=smoke))
    print(f"device {device_name}; roofline figures of {card}: {bandwidth / 1e12:.2f} TB/s, "
          f"{peak / 1e12:.0f} TFLOP/s", flush=True)

    folder = tempfile.mkdtemp(prefix="llama3_8b_dummy_")
    write_config(folder, TINY if smoke else LLAMA3_8B)
    n_req = max(args.batch_sizes)
    tokens = n_req * (args.context + 1) + max(args.prefill) + 64
    runner = ModelRunner(RunnerConfig(
        folder, device=device, dtype="float32" if smoke else "bfloat16", load_format="dummy",
        layer_ops="triton" if smoke and os.environ.get("TRITON_INTERPRET") == "1" else "auto",
        disable_cuda_graph=True,  # this script captures its own graphs, per backend
        max_total_tokens=tokens, max_running_requests=n_req + 1,
        max_context_len=max(max(args.prefill), args.context + 1)))
    bench = Bench(args, runner, report, bandwidth, peak)
    print(f"layer ops: {runner.model.model.norm.ops.name}", flush=True)
    print(f"model built in {time.time() - start:.1f} s: weights {bench.weight_bytes / 2**30:.2f} "
          f"GiB read per decode step, KV {bench.kv_bytes_per_token / 1024:.0f} KiB/token",
          flush=True)

    backends = [b for b in wanted if b == "torch_native" or load_attention_backend(b)]
    for b in set(wanted) - set(backends):
        report.add("errors", dict(backend=b, error="not importable"),
                   f"skip    {b}: not importable")
    mc = runner.model_config
    # Triton (compiled in seconds, unlike a flashinfer JIT build) fills the contexts once;
    # every backend then reads the same KV. torch_native is the fallback.
    for fill in (["triton"] if "triton" in backends else []) + ["torch_native"]:
        t0 = time.time()
        try:
            runner.attn = create_attention_backend(fill, device=runner.device, model_config=mc)
            bench.fill_contexts()
        except Exception as exc:
            report.add("errors", dict(backend=fill, what="fill contexts", error=repr(exc)),
                       f"FAILED  {fill} fill: {exc!r}\n{traceback.format_exc(limit=4)}")
            continue
        print(f"filled {n_req} x {args.context} context tokens with {fill} in "
              f"{time.time() - t0:.1f} s", flush=True)
        break

    def attempt(what: str, backend: str, fn) -> None:
        if time.time() - start > args.budget_s:
            report.add("errors", dict(backend=backend, what=what, error="time budget"),
                       f"skip    {backend} {what}: time budget spent")
            return
        try:
            fn()
        except Exception as exc:  # one broken configuration must not stop the rest
            report.add("errors", dict(backend=backend, what=what, error=repr(exc)),
                       f"FAILED  {backend} {what}: {exc!r}\n{traceback.format_exc(limit=4)}")

    for backend in backends:
        runner.attn = None

        def create():
            runner.attn = create_attention_backend(backend, device=runner.device,
                                                   model_config=mc)

        attempt("create", backend, create)
        if runner.attn is None:
            continue
        attempt("probe", backend, lambda: bench.probe(backend))
        for bs in args.batch_sizes:
            attempt(f"decode bs={bs}", backend, lambda: bench.decode(backend, None, bs))
        if not smoke and not args.no_graphs and getattr(runner.attn, "supports_cuda_graph", 0):
            holder = {}

            def capture():
                from radixray.kernels.cuda_graph import CudaGraphRunner

                t = time.time()
                holder["g"] = CudaGraphRunner(runner, batch_sizes=args.batch_sizes)
                print(f"captured {backend} graphs for {args.batch_sizes} in "
                      f"{time.time() - t:.1f} s", flush=True)

            attempt("cuda graph capture", backend, capture)
            for bs in args.batch_sizes if "g" in holder else []:
                attempt(f"decode+graph bs={bs}", backend,
                        lambda: bench.decode(backend, holder["g"], bs))
            if "g" in holder and 128 in args.batch_sizes:
                attempt("decode breakdown bs=128", backend,
                        lambda: bench.breakdown(backend, holder["g"], 128))
                attempt("decode bs=128, contiguous contexts", backend,
                        lambda: bench.contiguous_decode(backend, holder["g"], 128))
                attempt("decode bs=128, sampled", backend,
                        lambda: bench.sampled_decode(backend, holder["g"], 128))
            if "g" in holder and 128 in args.batch_sizes and runner.model.model.norm.ops.name \
                    != TORCH_OPS.name:
                holder.clear()  # one set of graphs at a time
                attempt("decode bs=128 with torch layer ops", backend,
                        lambda: bench.torch_ops_decode(backend, 128))
            holder.clear()
            torch.cuda.empty_cache()
        for tokens_ in args.prefill:
            attempt(f"prefill {tokens_}", backend, lambda: bench.prefill(backend, tokens_))
    for r in report.data["results"]:  # the target: batch-128 decode vs roofline
        if r["phase"] == "decode" and r["batch"] == 128 and "bw_fraction" in r:
            print(f"target  decode bs=128 {r['backend']} graph={int(r['cuda_graph'])}: "
                  f"{r['bw_fraction']:.1%} of the bandwidth roofline (target 70%)", flush=True)
    if "triton" in backends and not smoke:
        from radixray.kernels.decode_attention import device_decode_config

        print(f"triton decode attention block config: {device_decode_config(runner.device)}")
    if not smoke:
        print(f"peak memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB", flush=True)
    print(f"done in {time.time() - start:.1f} s" + (f"; summary in {json_path}" if json_path
                                                       else ""), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
