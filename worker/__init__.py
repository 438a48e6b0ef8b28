"""The model side of a rank: turn a ``ForwardBatch`` into next tokens (plain torch, no Ray).

Read in this order:

- ``model_config.py``    the HF ``config.json`` normalised once into a frozen ``ModelConfig``
- ``parallel.py``        tensor parallelism: the one place that knows how tensors are split
- ``layers.py``          a decoder layer's building blocks (``layer_ops.py``: the elementwise
  work as a pluggable strategy, torch or fused Triton)
- ``models/``            one file per architecture (``llama.py``; ``qwen2.py`` reuses it),
  and the registry from ``architectures`` to a class
- ``loader.py``          strict safetensors loading into the (sharded) parameters
- ``forward_batch.py``   the plain batch the scheduler sends, and what comes back
- ``attention.py``       attention over token-granular KV slots, behind a backend registry
  (``cascade_attention.py``: a shared prefix read once; ``kv_stage.py``: gathered K/V kept
  between CPU decode steps)
- ``sampling_params.py`` per-request sampling parameters (SGLang's names), checked once
- ``sampler.py``         batched sampling (``vocab_mask.py``: grammar masks applied first)
- ``model_runner.py``    ``ModelRunner``: one rank's model, KV buffers and sampler
- ``host_pool.py``       the host-memory KV tier of the hierarchical cache
  (``host_copy.py``: host values onto the device without waiting for it)
- ``make_model.py``, ``train_demo.py``: the project's own models (random, and the trained
  demo model in ``demo_model/``)
"""
