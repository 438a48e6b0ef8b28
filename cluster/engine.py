"""The offline Engine: tokenizer, model runner and scheduler in one process, no Ray.

    from radixray.cluster import Engine

    with Engine("path/to/model", schedule_policy="lpm") as engine:
        outs = engine.generate(["Hello", "Hello there"], sampling_params={"max_new_tokens": 8})

``generate`` queues every prompt at once and steps the scheduler until all are done, so a batch
call gets continuous batching and prefix sharing; results come back in input order, shaped as
SGLang's ``/generate`` response. Server arguments take SGLang's names.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
import uuid
from dataclasses import replace

from ..scheduler.config import SchedulerConfig
from ..scheduler.request import Req, prompt_fit_problem
from ..scheduler.scheduler import Scheduler
from ..scheduler.stop import (StopRegexTooSlow, decode_after, decode_context, trim_stop_text,
                              visible_output_ids)
from ..worker.sampling_params import SamplingParams, surrogate_at
from .engine_requests import Collected, copy_seed, logprob_start, per_request, plain_entry
from .request_checks import context_overflow
from .server_args import runner_config, split_server_args, take_process_args, tokenizer_eos

log = logging.getLogger(__name__)

def _serialised(method):
    """``method`` under the engine's lock: a shutdown in another thread waits for it."""
    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)
    return locked


class Engine:
    def __init__(self, model_path: str | None = None, **server_args):
        """Load the tokenizer and model and build the scheduler. ``model_path``: an HF model
        folder; None: the built-in demo model.

        ``server_args``: any of ``SchedulerConfig``'s fields (``schedule_policy``,
        ``max_total_tokens``, ``chunked_prefill_size``, ``disable_overlap_schedule``,
        ``enable_hierarchical_cache``, ... with SGLang's names; see scheduler/config.py) and
        of ``RUNNER_ARGS`` (``dtype``, ``device``, ``attention_backend``, ``context_length``,
        ``mem_fraction_static``, ``load_format``, ``tokenizer_path``). An unknown or invalid
        one raises ValueError naming it. ``sglang.Engine``'s ``tp_size`` and ``dp_size`` are
        taken when 1 (this engine runs one rank in this process: ``radixray serve`` runs
        more), ``log_level`` sets radixray's logging, and ``trust_remote_code`` is accepted
        and unused (radixray runs its own model code, never a checkpoint's).
        """
        from transformers import AutoTokenizer

        from ..worker.model_runner import ModelRunner

        import torch

        sched_args, runner_args = split_server_args(take_process_args(server_args))
        if runner_args["device"] == "auto":  # resolved here, so server_info shows the choice
            runner_args["device"] = "cuda" if torch.cuda.is_available() else "cpu"
        elif runner_args["device"].startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device: {runner_args['device']!r}, but torch sees no GPU here")
        self.config = SchedulerConfig(**sched_args)  # validates before the model loads
        if model_path is None:
            from ..worker.make_model import ensure_default_model

            model_path = ensure_default_model()
        for name, path in (("model_path", model_path),
                           ("tokenizer_path", runner_args["tokenizer_path"])):
            # a folder: no model hub is asked (a typo retried an unreachable hub for ~50 s)
            if path is not None and not os.path.isdir(path):
                raise ValueError(f"{name}: {path!r} is not a folder (an HF model folder with "
                                 "config.json and safetensors weights)")
        self.model_path = model_path
        self.server_args = {**runner_args, **{k: getattr(self.config, k)
                                              for k in SchedulerConfig.field_names()}}
        self.tokenizer = AutoTokenizer.from_pretrained(runner_args["tokenizer_path"] or model_path)
        self.runner = ModelRunner(runner_config(model_path, self.config, runner_args,
                                                tokenizer_eos(self.tokenizer)))
        # One generate at a time (two threads stepping one scheduler corrupt it), held from its
        # checks on; shutdown and flush_cache wait for it.
        self._lock = threading.Lock()
        self._stepping = False  # a generate call has queued requests (see _run)
        self.scheduler = self._new_scheduler()
        self.server_args["disable_overlap_schedule"] = not self.scheduler.overlap  # effective
        self.server_args["enable_hierarchical_cache"] = self.runner.host_pool_tokens > 0
        self.server_args["host_pool_tokens"] = self.runner.host_pool_tokens

    def _new_scheduler(self) -> Scheduler:
        mc = self.runner.model_config
        return Scheduler(self.config, self.runner, eos_token_ids=self.runner.eos_token_ids,
                         decode=self.tokenizer.decode, vocab_size=mc.vocab_size,
                         tokenizer=self.tokenizer)

    # ------------------------------------------------------------------ generation
    @_serialised
    def generate(self, prompt=None, sampling_params=None, input_ids=None, *,
                 return_logprob=False, logprob_start_len=None, top_logprobs_num=None,
                 return_text_in_logprobs=False, rid=None, priority=None, routing_key=None,
                 extra_key=None):
        """Generate for one prompt (returns a dict) or a list (returns a list, input order).

        ``prompt`` is text, ``input_ids`` token ids (one list or a list of lists); exactly one
        of them. ``sampling_params`` is a dict (shared) or one dict per prompt, with SGLang's
        keys. The first three go in SGLang's order (``generate(prompt, sampling_params)``),
        the rest by keyword; each takes one value or a list, None meaning its default (a
        logprob_start_len of -1: the last prompt token only). With ``n > 1`` each prompt's
        samples follow each other in the result.
        """
        if self.scheduler is None:  # before anything reads the model config it dropped
            raise RuntimeError("the engine has been shut down")
        single, ids = self._token_ids(prompt, input_ids)
        prompt_field = "prompt" if prompt is not None else "input_ids"
        count = len(ids)
        raw_params = per_request(sampling_params, count, "sampling_params", dict)
        params = [SamplingParams.from_dict(p) for p in raw_params]
        if not isinstance(return_text_in_logprobs, bool):  # "no" read as true
            raise ValueError("return_text_in_logprobs: must be true or false")
        per = {name: per_request(value, count, name, kind)
               for name, value, kind in (("return_logprob", return_logprob, bool),
                                         ("logprob_start_len", logprob_start_len, int),
                                         ("top_logprobs_num", top_logprobs_num, int),
                                         ("rid", rid, str), ("priority", priority, int),
                                         ("routing_key", routing_key, str),
                                         ("extra_key", extra_key, str))}
        reqs, warmups = [], {}  # warmups: copy rid -> its prompt's warm-up (n > 1)
        for i in range(count):
            params[i].verify(self.runner.model_config.vocab_size)
            self._check_length(len(ids[i]), raw_params[i], params[i], prompt_field)
            base, sp = per["rid"][i] or uuid.uuid4().hex, params[i]
            if isinstance(rid, str) and not single:  # one rid for a batch: rid-0, rid-1, ...
                base = f"{rid}-{i}"
            start = logprob_start(per["return_logprob"][i], per["logprob_start_len"][i],
                                   len(ids[i]))
            top_n = per["top_logprobs_num"][i]
            top_n = 0 if top_n is None else top_n
            if sp.n > 1:  # as the HTTP API: the prompt is computed once, then its copies run
                warm = Req(f"{base}-prefill-{uuid.uuid4().hex[:8]}", ids[i],
                           replace(sp, n=1, max_new_tokens=0, min_new_tokens=0),
                           priority=per["priority"][i], routing_key=per["routing_key"][i],
                           extra_key=per["extra_key"][i])
                warmups.update({f"{base}-{k}": warm for k in range(sp.n)})
            for k in range(sp.n):
                # copy k samples with seed + k, as the HTTP API's copies do: one seed for all
                # would make the n samples identical
                copy = sp if sp.n == 1 else replace(sp, n=1, seed=copy_seed(sp.seed, k))
                reqs.append(Req(
                    base if sp.n == 1 else f"{base}-{k}", ids[i], copy,
                    return_logprob=per["return_logprob"][i],
                    logprob_start_len=start,
                    top_logprobs_num=top_n, priority=per["priority"][i],
                    routing_key=per["routing_key"][i], extra_key=per["extra_key"][i]))
        collected = self._run(list({id(w): w for w in warmups.values()}.values()), reqs)
        for r in reqs:  # a copy reports its prompt's real hit and arrival: the warm-up's
            warm = warmups.get(r.rid)
            if warm is not None:
                collected[r.rid].after_warmup(collected[warm.rid], r.prompt_len)
        results = [self._result(r, collected[r.rid], return_text_in_logprobs) for r in reqs]
        return results[0] if single and len(results) == 1 else results

    def _check_length(self, prompt_len: int, raw: dict | None, sp: SamplingParams,
                      prompt_field: str) -> None:
        """As the HTTP API (and SGLang): the prompt must fit the context and the KV cache, and
        a max_new_tokens the caller set must fit the context after the prompt; the default is
        cut short at the context's end instead."""
        problem = prompt_fit_problem(prompt_len, self.scheduler.max_context_len,
                                     self.scheduler.cache.pool_size, prompt_field)
        if problem:
            raise ValueError(problem)
        if (raw or {}).get("max_new_tokens") is not None:
            overflow = context_overflow(prompt_len, sp.max_new_tokens,
                                        self.scheduler.max_context_len, "max_new_tokens")
            if overflow:
                raise ValueError(overflow)

    def _token_ids(self, prompt, input_ids) -> tuple[bool, list[list[int]]]:
        """(one prompt?, each prompt's token ids); ValueError naming a malformed argument."""
        if (prompt is None) == (input_ids is None):
            raise ValueError("prompt: give exactly one of prompt and input_ids")
        if prompt is not None:
            if not isinstance(prompt, (str, list, tuple)):  # list(5): a TypeError
                raise ValueError("prompt: must be a string or a non-empty list of strings")
            single = isinstance(prompt, str)
            texts = [prompt] if single else list(prompt)
            if not texts or not all(isinstance(t, str) for t in texts):
                raise ValueError("prompt: must be a string or a non-empty list of strings")
            for t in texts:  # the tokenizer's own error (a TypeError) names nothing
                at = surrogate_at(t)
                if at is not None:
                    raise ValueError(f"prompt: not valid Unicode text (a lone surrogate at "
                                     f"character {at})")
            ids = [self.tokenizer.encode(t) for t in texts]
            if not all(ids):  # as the HTTP API: "" is BOS alone where the tokenizer adds one
                raise ValueError("prompt: the prompt is empty (no tokens)")
            return single, ids
        if not isinstance(input_ids, (list, tuple)) or not input_ids:
            raise ValueError("input_ids: must be a non-empty list of token ids or of lists")
        single = not isinstance(input_ids[0], (list, tuple))
        if not single and not all(isinstance(x, (list, tuple)) for x in input_ids):
            raise ValueError("input_ids: a batch must be a list of lists of token ids")
        if not single and not all(input_ids):
            raise ValueError("input_ids: the prompt is empty")
        return single, [list(input_ids)] if single else [list(x) for x in input_ids]

    def _run(self, warmups: list[Req], reqs: list[Req]) -> dict[str, Collected]:
        """Run ``warmups``, then ``reqs`` (all validated first): queue them, step until each has
        finished. Called under the engine's lock (``generate``). A step that raises (Ctrl-C in a
        notebook, a failed forward) leaves the scheduler between a batch it built and the
        outputs it never processed: it is replaced by a fresh one (the radix cache starts
        empty), so the engine goes on serving, and the exception is raised."""
        try:
            return self._run_locked(warmups, reqs)
        except BaseException:
            if self.scheduler is not None and self._stepping:
                old, self.scheduler = self.scheduler, self._new_scheduler()
                if old.grammars is not None:
                    old.grammars.backend.shutdown()
            raise

    def _run_locked(self, warmups: list[Req], reqs: list[Req]) -> dict[str, Collected]:
        # Set once requests are queued: from then on a failure may leave the scheduler half way
        self._stepping = False
        seen = set()
        for r in warmups + reqs:
            if r.rid in seen:
                raise ValueError(f"rid: {r.rid!r} appears twice")
            seen.add(r.rid)
            self.scheduler.validate_request(r)
        self._stepping = True
        collected = self._run_phase(warmups, {})
        return self._run_phase(reqs, collected)

    def _run_phase(self, reqs: list[Req], collected: dict[str, Collected]
                   ) -> dict[str, Collected]:
        """Queue ``reqs`` and step until each has finished; adds their outputs to ``collected``."""
        for r in reqs:
            self.scheduler.add_request(r)
        collected.update({r.rid: Collected() for r in reqs})
        started = time.perf_counter()
        pending = {r.rid for r in reqs}
        while pending:
            for out in self.scheduler.step():
                if out.rid in collected:
                    collected[out.rid].add(out)
                    if out.finished:
                        collected[out.rid].latency = time.perf_counter() - started
                        pending.discard(out.rid)
            if pending and not self.scheduler.has_work:
                raise RuntimeError(f"scheduler went idle with {len(pending)} requests unfinished")
        return collected

    def _result(self, req: Req, c: Collected, text_in_logprobs: bool) -> dict:
        sp, reason = req.sampling_params, c.last.finish_reason
        shown = visible_output_ids(c.output_ids, reason, sp.no_stop_trim)
        decode = functools.partial(
            self.tokenizer.decode, skip_special_tokens=sp.skip_special_tokens,
            spaces_between_special_tokens=sp.spaces_between_special_tokens)
        text = decode_after(decode, decode_context(decode, req.origin_input_ids), shown)
        meta = {
            "id": req.rid,
            "prompt_tokens": c.last.prompt_tokens,
            "completion_tokens": c.last.completion_tokens,
            "cached_tokens": c.last.cached_tokens,
            "cached_tokens_details": {"device": c.last.cached_tokens - c.last.host_cached_tokens,
                                      "host": c.last.host_cached_tokens},
            "finish_reason": reason.to_dict() if reason else None,
            "e2e_latency": c.latency,
        }
        if req.return_logprob:
            entry = self._logprob_entry if text_in_logprobs else plain_entry
            meta["input_token_logprobs"] = [entry(lp, t) for lp, t in
                                            (c.input_token_logprobs or [])]
            meta["output_token_logprobs"] = [entry(lp, t) for lp, t in c.output_token_logprobs]
            if req.top_logprobs_num > 0:
                meta["input_top_logprobs"] = [None if top is None else
                                              [entry(lp, t) for lp, t in top]
                                              for top in (c.input_top_logprobs or [])]
                meta["output_top_logprobs"] = [[entry(lp, t) for lp, t in top]
                                               for top in c.output_top_logprobs]
        try:
            text = trim_stop_text(text, reason, sp.no_stop_trim, sp.stop_regex)
        except StopRegexTooSlow:  # the scheduler found the stop; only the cut is lost
            log.warning("request %s: its stop regex took too long to find again in the whole "
                        "output; the text is not cut at it", req.rid)
        return {"text": text, "output_ids": c.output_ids, "meta_info": meta}

    def _logprob_entry(self, logprob, token_id) -> list:
        return [logprob, token_id, self.tokenizer.decode([token_id])]

    # ------------------------------------------------------------------ housekeeping
    def flush_cache(self) -> bool:
        """Empty the radix cache (after a generate call running in another thread)."""
        with self._lock:
            if self.scheduler is None:
                raise RuntimeError("the engine has been shut down")
            return self.scheduler.flush_cache()

    def shutdown(self) -> None:
        """Drop the model and the scheduler; the engine cannot be used afterwards. Waits for a
        generate call running in another thread to finish."""
        with self._lock:
            if self.scheduler is not None and self.scheduler.grammars is not None:
                self.scheduler.grammars.backend.shutdown()
            if self.runner is not None:
                self.runner.close()
            self.scheduler = None
            self.runner = None

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
