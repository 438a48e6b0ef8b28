"""The scheduler: what runs each step, and where every token's KV lives (CPU only, no Ray).

Read in this order; the core first:

- ``request.py``       ``Req`` (the length vocabulary), ``FinishReason``, ``RequestOutput``
- ``memory_pool.py``   the request-to-token table and the KV slot allocator
- ``radix_key.py``     ``RadixKey``: the token sequence the tree is keyed by, packed once
- ``radix_cache.py``   the prefix tree of cached slots (``eviction_policy.py``: eviction order)
- ``cache_manager.py`` every hand-over of slots between allocator, tree and requests
- ``token_ratio.py``   ``new_token_ratio``, the over-commit estimate
- ``policy.py``        waiting-queue policies and in-batch prefix sharing
- ``prefill_adder.py`` admission of one prefill batch under the KV / prefill / chunk budgets
- ``decode.py``        room for a decode step: retraction
- ``stop.py``          finish checks (length, EOS, stop ids, stop strings and regexes)
- ``batch.py``         ``ScheduleBatch`` and the ``ForwardBatch`` sent to the worker
- ``logprobs.py``      logprobs from a forward's output to a request and its outputs
- ``scheduler.py``     the loop: ``add_request``, ``abort``, ``step`` = ``schedule`` + forward +
  ``process_output``
- ``overlap.py``       overlap scheduling: batch N+1 built and submitted while batch N runs
- ``stats.py``         the counters, and what the scheduler exports as metrics
- ``config.py``        ``SchedulerConfig`` (SGLang's argument names and defaults)

Then the two features that plug into it:

- constrained decoding: ``constrained.py`` (the scheduler's side: grammar queue, batch masks,
  accepting tokens, jump-forward), ``grammar.py`` (the kinds, parsing, checks),
  ``grammar_check.py`` (rules that can never finish), ``grammar_compile.py`` (xgrammar
  compilation off the loop), ``grammar_state.py`` (one request's matcher and mask row)
- the hierarchical cache: ``hicache.py`` (the tree over device and host tiers),
  ``hicache_copies.py`` (the copies between tiers and how they settle), ``hicache_storage.py``
  (the interface of an external third tier; the tree does not use it yet)
"""
