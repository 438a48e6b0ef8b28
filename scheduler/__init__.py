"""The scheduler: what runs each step, and where every token's KV lives (CPU only, no Ray).

Read in this order:

- ``request.py``       ``Req`` (the length vocabulary), ``FinishReason``, ``RequestOutput``
- ``memory_pool.py``   the request-to-token table and the KV slot allocator
- ``radix_cache.py``   the prefix tree of cached slots (``eviction_policy.py``: eviction order)
- ``cache_manager.py`` every hand-over of slots between allocator, tree and requests
- ``token_ratio.py``   ``new_token_ratio``, the over-commit estimate
- ``policy.py``        waiting-queue policies and in-batch prefix sharing
- ``prefill_adder.py`` admission of one prefill batch under the KV / prefill / chunk budgets
- ``decode.py``        room for a decode step: retraction
- ``stop.py``          finish checks (length, EOS, stop ids, stop strings)
- ``batch.py``         ``ScheduleBatch`` and the ``ForwardBatch`` sent to the worker
- ``scheduler.py``     the loop: ``add_request``, ``abort``, ``step`` = ``schedule`` + forward +
  ``process_output``
- ``config.py``        ``SchedulerConfig`` (SGLang's argument names and defaults)
"""
