"""The over-commit ledger: ``new_token_ratio``, the share of their remaining ``max_new_tokens``
that running requests are expected to still need.

Admission reserves ``remaining max_new_tokens x ratio`` slots per running request. Most requests
stop well before their limit, so the ratio starts optimistic-but-careful (0.7), decays linearly
over 600 decode steps towards 0.14 of that start (0.098; admitting more as long as nothing goes
wrong), and jumps back up when decode runs out of slots and has to retract requests. The start
scales with ``--schedule-conservativeness``, and no estimate exceeds 1 (reserving more than a
request's whole ``max_new_tokens`` would only keep requests that fit waiting), as in SGLang.
"""

from __future__ import annotations

INIT_RATIO = 0.7
MIN_RATIO_FACTOR = 0.14
DECAY_STEPS = 600
RETRACT_DECODE_STEPS = 20  # after a retraction, leave each request room for this many steps
CLIP_MAX_NEW_TOKENS = 4096  # caps one request's max_new_tokens in every estimate


class NewTokenRatio:
    def __init__(self, conservativeness: float = 1.0):
        self.init = min(INIT_RATIO * conservativeness, 1.0)
        self.min = self.init * MIN_RATIO_FACTOR
        self.decay = (self.init - self.min) / DECAY_STEPS
        self.value = self.init

    def on_decode_step(self) -> None:
        """One decode step went through without trouble: relax a little."""
        self.value = max(self.value - self.decay, self.min)

    def on_retract(self, running) -> None:
        """Decode ran out of slots: re-estimate from the requests still running.

        ``(tokens decoded so far + RETRACT_DECODE_STEPS per request) / (sum of max_new_tokens
        + 1)``, capped at 1: what they have actually used plus headroom, as a share of what
        they could use.
        """
        decoded = sum(len(r.output_ids) for r in running)
        budget = sum(r.sampling_params.max_new_tokens for r in running)
        estimate = (decoded + RETRACT_DECODE_STEPS * len(running)) / (budget + 1)
        self.value = min(1.0, estimate)

    def on_idle(self) -> None:
        """Nothing is running: the next burst starts from the initial estimate."""
        self.value = self.init
