"""The scheduler: continuous batching around the radix cache.

One ``step()`` is one forward pass:

1. ``schedule()``: merge the last prefill batch's requests into the running set; try to build a
   prefill batch (prefill has priority: the chunked request first, then waiting requests in
   policy order, under the ``PrefillAdder`` budgets, with in-batch prefix sharing; running
   decodes ride along with ``--enable-mixed-chunk``); otherwise a decode batch of all running
   requests, retracting some first if the KV pool is short.
2. ``runner.forward(batch.forward_batch)``.
3. ``process_output(batch, output)``: append tokens, check stops, hand finished requests' KV
   to the radix tree, and emit one ``RequestOutput`` per request that got a token or finished.

Overlap scheduling (overlap.py): batch N+1 is built and submitted while batch N runs, when
the runner can compute beside the scheduler. Constrained decoding and jump-forward: see
constrained.py.

Hierarchical cache: a request whose prefix continues in the host tier waits in ``loading``
until the batch carrying its load confirms it, then matches again (hicache_copies.py); under
overlap scheduling the step after a batch that carries loads waits for its results.
"""

from __future__ import annotations

from dataclasses import replace

from ..worker.forward_batch import ForwardOutput
from .batch import ScheduleBatch
from .cache_manager import CacheManager
from .config import SchedulerConfig
from .constrained import check_constraint, make_constrained, split_extends
from .decode import decode_slots_needed, make_room_for_decode
from .logprobs import attach_logprobs, collect_input_logprobs
from .overlap import OverlapLoop
from .policy import InBatchPrefixSharing, QueueView, make_policy
from .prefill_adder import AddResult, PrefillAdder
from .request import FinishReason, Req, RequestOutput, prompt_fit_problem
from .stats import SchedulerStats, scheduler_metrics
from .stop import Decode, StopChecker
from .token_ratio import NewTokenRatio


class Scheduler:
    def __init__(self, config: SchedulerConfig, runner, *, eos_token_ids=(),
                 decode: Decode | None = None, vocab_size: int | None = None, tokenizer=None):
        """``runner`` has ``forward(ForwardBatch) -> ForwardOutput`` and the pool sizes it
        allocated: ``max_total_tokens``, ``max_running_requests``, ``max_context_len``.
        ``decode(ids) -> str`` is needed for stop strings, a Hugging Face ``tokenizer`` for
        constrained decoding (regex, json_schema, ebnf)."""
        self.config = config
        self.runner = runner
        self.max_context_len = runner.max_context_len
        self.vocab_size = vocab_size
        self.cache = CacheManager(runner.max_total_tokens, runner.max_running_requests,
                                  runner.max_context_len, config.page_size,
                                  config.radix_eviction_policy, config.disable_radix_cache,
                                  # the host tier's size is the runner's: it holds the data
                                  getattr(runner, "host_pool_tokens", 0)
                                  if config.enable_hierarchical_cache else 0,
                                  config.hicache_write_policy)
        self.policy = make_policy(config.schedule_policy, config.random_seed,
                                  config.schedule_max_wait)
        self.ratio = NewTokenRatio(config.schedule_conservativeness)
        self.stop = StopChecker(eos_token_ids, decode, self.max_context_len)
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.loading: list[Req] = []  # waiting for a host-tier load (see the module docstring)
        self.chunked_req: Req | None = None  # a prompt mid-chunk; continues first
        self.last_batch: ScheduleBatch | None = None
        self.live: dict[str, Req] = {}  # every unfinished request by rid
        self.stats = SchedulerStats()
        self._outputs: list[RequestOutput] = []
        wanted = (getattr(runner, "overlap_by_default", True)
                  if config.disable_overlap_schedule is None else
                  not config.disable_overlap_schedule)
        self.overlap = wanted and hasattr(runner, "submit") and hasattr(runner, "result")
        self.loop = OverlapLoop(self) if self.overlap else None
        self.grammars = None if tokenizer is None else make_constrained(
            tokenizer, vocab_size or len(tokenizer), eos_token_ids, self.max_context_len,
            config.grammar_compile_timeout, not config.disable_jump_forward)

    # ------------------------------------------------------------------ requests in and out
    def add_request(self, req: Req) -> None:
        """Queue ``req``. Raises ValueError naming the field for a request that can never run.
        A max_new_tokens past the context, or past what the KV pool holds alone, is cut to it:
        the request ends there anyway (``length``, not an abort losing the answer), and its KV
        reservation must not count tokens that can never come."""
        self.validate_request(req)
        room = min(self.max_context_len, self.cache.pool_size) - req.prompt_len
        if req.sampling_params.max_new_tokens > room:
            req.sampling_params = replace(req.sampling_params, max_new_tokens=room)
        self.live[req.rid] = req
        if req.sampling_params.constraint is not None:
            self.grammars.add(req)  # joins the waiting queue once its grammar has compiled
        else:
            self.waiting.append(req)

    def validate_request(self, req: Req) -> None:
        """Raise ValueError("<field>: ...") if ``req`` can never run here. Mutates nothing."""
        if req.rid in self.live:
            raise ValueError(f"rid: {req.rid!r} is already in use")
        req.sampling_params.verify(self.vocab_size)
        check_constraint(req.sampling_params, self.grammars)
        if req.sampling_params.stop and self.stop.decode is None:
            raise ValueError("stop: stop strings need a tokenizer (decode) in the scheduler")
        if self.vocab_size is not None and max(req.origin_input_ids) >= self.vocab_size:
            raise ValueError(f"input_ids: token ids must be < vocab size {self.vocab_size}")
        if self.vocab_size is not None and req.top_logprobs_num > self.vocab_size:
            raise ValueError(f"top_logprobs_num: must be in [0, {self.vocab_size}] (the vocab "
                             "size)")
        problem = prompt_fit_problem(req.prompt_len, self.max_context_len, self.cache.pool_size,
                                     "input_ids")
        if problem:
            raise ValueError(problem)

    def abort(self, rid: str, message: str = "aborted by request") -> bool:
        """Finish request ``rid`` with an abort reason; False if no such live request. A waiting
        request ends now; a running one at the next ``step`` (its output says so)."""
        return self.abort_many([rid], message) == 1

    def abort_many(self, rids: list[str], message: str = "aborted by request") -> int:
        """``abort`` for each of ``rids`` in one pass over the queues (one scan each froze a
        replica whose client dropped 60k queued prompts); how many were live."""
        reqs = [req for req in map(self.live.get, dict.fromkeys(rids)) if req is not None]
        ids = {id(req) for req in reqs}
        queued = {id(r) for queue in (self.waiting, self.loading) for r in queue if id(r) in ids}
        if queued:  # a loading request holds nothing: its load goes on, filling the cache
            self.waiting = [r for r in self.waiting if id(r) not in queued]
            self.loading = [r for r in self.loading if id(r) not in queued]
        if self.grammars is not None and self.grammars.queue:
            queued |= self.grammars.remove([r for r in reqs if id(r) not in queued])
        for req in reqs:
            if id(req) in queued:
                req.load = None
                req.finish_reason = FinishReason.abort(message)
                self._emit(req, [])
                self._retire(req)
            else:
                req.to_abort = message
        return len(reqs)

    @property
    def has_work(self) -> bool:
        return bool(self.live) or self.in_flight

    @property
    def in_flight(self) -> bool:
        """Whether a batch submitted under overlap scheduling awaits processing."""
        return self.loop is not None and self.loop.inflight is not None

    def step(self) -> list[RequestOutput]:
        """Run one forward step (if there is anything to run) and return the outputs that
        are ready: this step's, or under overlap scheduling the previous step's."""
        if self.grammars is not None and self.grammars.queue:
            self._poll_grammars()
        if self.loop is not None:
            self.loop.step()
        else:
            batch = self.schedule()
            if batch is not None:
                self.advance(batch)
                self.process_output(batch, self.runner.forward(batch.forward_batch))
        if self.config.debug_invariants:
            self.check_invariant()
        outputs, self._outputs = self._outputs, []
        return outputs

    def _poll_grammars(self) -> None:
        """Requests whose grammar has compiled join the waiting queue (text it forces at the
        start is sent now); those whose compilation failed finish with an abort reason."""
        idle = not (self.running or self.waiting or self.loading or self.chunked_req
                    or self.in_flight)
        for req, new_ids in self.grammars.poll(idle):
            if new_ids or req.finished:
                self.stats.generated_tokens += len(new_ids)
                self._emit(req, new_ids)
            if req.finished:
                self._retire(req)
            else:
                self.waiting.append(req)

    def flush_cache(self) -> bool:
        """Empty the radix cache; refused (False) while any request is live."""
        if self.live:
            return False
        if self.loop is not None:
            self.loop.finish()
        self.cache.flush()
        return True

    # ------------------------------------------------------------------ scheduling
    def schedule(self) -> ScheduleBatch | None:
        """Pick the next batch and allocate its slots; None when there is nothing to run."""
        self.merge_last_prefill()
        self._reap_aborted()
        batch = self._prefill_batch() or self._decode_batch()
        if batch is None and self.cache.has_queued_copies():
            batch = ScheduleBatch.copies_only(self.cache)  # a load must not wait for work
            self.stats.num_copy_batches += 1
        if batch is not None and self.grammars is not None:
            self.grammars.fill_mask(batch)
        self.last_batch = batch
        if batch is None and not self.running:
            self.ratio.on_idle()
        return batch

    def merge_last_prefill(self) -> None:
        """Requests whose prompt is now complete join the running (decoding) set."""
        last, self.last_batch = self.last_batch, None
        if last is not None:  # (a running request that extended after a jump is there)
            running = {id(r) for r in self.running}
            self.running += [r for r in last.prefill if not r.finished
                             and r is not self.chunked_req and id(r) not in running]

    def _reap_aborted(self) -> None:
        for req in [*self.running, self.chunked_req]:
            if req is not None and req.to_abort is not None and not req.finished:
                req.finish_reason = FinishReason.abort(req.to_abort)
                self._emit(req, [])
                self._retire(req)
        self.running = [r for r in self.running if not r.finished]

    def _prefill_batch(self) -> ScheduleBatch | None:
        if not self.waiting and self.chunked_req is None:
            return None
        mixed = self.config.enable_mixed_chunk and bool(self.running)
        adder = PrefillAdder(
            self.cache, self.running, self.ratio.value, self.config.chunk_size,
            self.config.max_prefill_tokens,
            decode_slots_needed(self.running, self.cache) if mixed else 0,
            has_chunked_req=self.chunked_req is not None)
        continuing = self.chunked_req
        if continuing is not None:
            self.chunked_req = adder.add_chunked_req(continuing)

        admitted: list[Req] = []
        loading: list[Req] = []
        # (with no request row free nothing is admitted: ordering would match the queue for
        # nothing, every decode step)
        if (self.waiting and adder.budget_state() is AddResult.CONTINUE
                and self.cache.free_rows() > 0):
            self.policy.order(self.waiting, QueueView(self.cache, self.running))
            sharing = None if self.cache.disabled else InBatchPrefixSharing()
            if sharing is not None and continuing is not None:
                sharing.add(continuing)  # its prompt is ahead of everyone, done or not
            for req in self.waiting:
                if len(admitted) >= self.cache.free_rows():
                    break
                self.cache.match(req)
                if req.host_nodes and self.cache.start_load(req, adder.load_budget(req)):
                    loading.append(req)  # back in the queue when the load is confirmed
                    continue
                if sharing is not None and sharing.hold_back(req):
                    continue
                result = adder.add_one_req(req)
                if adder.can_run and adder.can_run[-1] is req:
                    admitted.append(req)
                if result is not AddResult.CONTINUE:
                    break
        done = {id(r) for r in admitted + loading}
        self.waiting = [r for r in self.waiting if id(r) not in done]
        self.loading += loading
        if not adder.can_run:
            return None
        for req in admitted:
            self.cache.assign_row(req)
            req.count_prompt_hits()
        if adder.new_chunked_req is not None:
            assert self.chunked_req is None, "two chunked requests at once"
            self.chunked_req = adder.new_chunked_req
        extend, decode = split_extends(self.running) if mixed else ([], [])
        if mixed:
            self.stats.num_mixed_batches += 1
        self.stats.num_prefill_batches += 1
        return ScheduleBatch.build(adder.can_run + extend, decode, self.cache)

    def _decode_batch(self) -> ScheduleBatch | None:
        if not self.running:
            return None
        room = make_room_for_decode(self.running, self.cache, self.chunked_req)
        if self.chunked_req in room.retracted:  # it continues from the queue, matched anew
            self.chunked_req = None
        if room.retracted:
            self.waiting[:0] = sorted(room.retracted, key=lambda r: r.arrival)
            self.stats.num_retracted += len(room.retracted)
            if self.grammars is not None:
                self.grammars.on_retract(room.retracted)
            self.ratio.on_retract(self.running)
        else:
            self.ratio.on_decode_step()
        for req in room.aborted:
            self._emit(req, [])
            self._retire(req)
        if not self.running:
            return None
        self.stats.num_decode_batches += 1
        return ScheduleBatch.build(*split_extends(self.running), self.cache)

    # ------------------------------------------------------------------ results
    def advance(self, batch: ScheduleBatch) -> None:
        """The batch is submitted: its tokens' K/V will be in their slots, so every request's
        ``cached_len`` moves to ``seq_len`` now (the next batch may be built before these
        results are back). Records the lengths ``process_output`` needs."""
        batch.start_lens = [r.cached_len for r in batch.reqs]
        batch.seq_lens = [r.seq_len for r in batch.reqs]
        for req in batch.reqs:
            req.cached_len, req.extend_len = req.seq_len, 0
            req.computed_len = max(req.computed_len, req.cached_len)

    def process_output(self, batch: ScheduleBatch, output: ForwardOutput) -> None:
        """Apply one forward's results (``advance`` ran at submission): append sampled tokens,
        check stops, cache prompts, retire finished requests, queue their outputs. Requests
        that finished meanwhile (a wasted overlap step, an abort) are skipped."""
        if batch.copies is not None:
            self._settle_copies(batch.copies, output)
        next_ids = output.next_token_ids.tolist()
        num_prefill = len(batch.prefill)
        already_done = {id(r) for r in batch.reqs if r.finished}
        for i, req in enumerate(batch.reqs):
            if id(req) in already_done:
                continue
            start, seq_len = batch.start_lens[i], batch.seq_lens[i]
            input_logprobs_done = False
            if i < num_prefill:
                self.stats.prefill_tokens += seq_len - start
                if batch.input_logprob_starts[i] >= 0:
                    input_logprobs_done = collect_input_logprobs(
                        req, output, i, start, batch.input_logprob_starts[i])
            else:
                self.stats.decode_tokens += 1
            if seq_len < req.total_len:
                continue  # a chunk of a longer prompt: its sample is not a token
            new_ids = []
            if req.sampling_params.max_new_tokens == 0:
                req.finish_reason = FinishReason.of_length(0)  # only filled the cache
            else:
                new_ids = [next_ids[i]]
                req.output_ids.append(next_ids[i])
                self.stats.generated_tokens += not req.probe
                req.finish_reason = self.stop.check(req)
                if req.grammar is not None:  # accept it; may finish the request or jump
                    new_ids = self.grammars.on_token(req)
                    self.stats.generated_tokens += len(new_ids) - 1
            if req.to_abort is not None and not req.finished:
                req.finish_reason = FinishReason.abort(req.to_abort)
            self._emit(req, new_ids, output, i, input_logprobs_done)
        for req in batch.prefill:  # from the next round on, other requests hit this prompt
            if not req.finished:
                self.cache.cache_unfinished(req)
        for req in batch.reqs:
            if req.finished and id(req) not in already_done:
                self._retire(req)
        # a prefill merged into running under overlap may have finished on its first token
        self.running = [r for r in self.running if not r.finished]

    def _settle_copies(self, ticket, output: ForwardOutput) -> None:
        """Apply the worker's verdict on a batch's tier copies; requests whose load it settled
        go back to the front of the queue (they match again: on the device if it worked)."""
        self.cache.ack_kv_copies(ticket, output.kv_store_ok, output.kv_load_ok)
        ready = [r for r in self.loading if r.load.done]
        if not ready:
            return
        self.loading = [r for r in self.loading if not r.load.done]
        for req in ready:
            if req.load.state == "failed":
                req.load_range = None
            req.load = None
        self.waiting[:0] = sorted(ready, key=lambda r: r.arrival)

    def _emit(self, req: Req, new_ids: list[int], output: ForwardOutput | None = None,
              i: int = 0, input_logprobs_done: bool = False) -> None:
        out = RequestOutput(req.rid, new_ids, req.finished, req.finish_reason, req.prompt_len,
                            req.cached_tokens, len(req.output_ids), req.host_cached_tokens,
                            req.queue_time)
        attach_logprobs(out, req, new_ids, output, i, input_logprobs_done)
        self._outputs.append(out)

    def _retire(self, req: Req) -> None:
        """A finished request gives its KV to the tree and leaves every queue."""
        if req.req_pool_idx is not None:
            self.cache.cache_finished(req)
        if req is self.chunked_req:
            self.chunked_req = None
        self.live.pop(req.rid, None)
        if not self.live:  # the engine stops stepping when idle: reset the estimate now
            self.ratio.on_idle()
        self.stats.count_finished(req)

    # ------------------------------------------------------------------ introspection
    def check_invariant(self) -> None:
        """Free + tree + held-by-live-requests slots == pool size (see CacheManager)."""
        self.cache.check_invariant(list(self.live.values()))

    def metrics(self) -> dict:
        """Gauges and cumulative counters, named as cluster/metrics.py expects them."""
        return scheduler_metrics(self)
