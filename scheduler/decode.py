"""Making room for a decode step: retraction when the running requests outgrow the KV pool.

Admission over-commits on purpose (see ``token_ratio.py``), so a decode step can find fewer
free slots than running requests. Unlocked cache goes first (allocation evicts it); if that is
not enough, requests are retracted: their own slots are freed, nothing is inserted into the
tree, and they wait at the front of the queue to be prefilled again from ``prompt + output so
far``, which (greedy) continues exactly where they stopped.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .cache_manager import CacheManager
from .request import FinishReason, Req
from .token_ratio import RETRACT_DECODE_STEPS


def decode_slots_needed(reqs: list[Req], cache: CacheManager, steps: int = 1) -> int:
    """Slots ``reqs`` need for ``steps`` more decode steps (fewer if they stop sooner), plus
    the tokens a jump-forward appended beyond the one a decode step feeds (they are computed
    as an extend in the next step; see constrained.py)."""
    return sum(cache.slots_needed(r.cached_len, max(min(steps, r.remaining_new_tokens()), 1)
                                  + max(r.total_len - r.cached_len - 1, 0))
               for r in reqs)


@dataclass
class Retraction:
    retracted: list[Req] = field(default_factory=list)
    aborted: list[Req] = field(default_factory=list)


def make_room_for_decode(running: list[Req], cache: CacheManager) -> Retraction:
    """Ensure the next decode step of ``running`` fits, retracting requests if needed.

    Victims go in order of fewest output tokens (least work lost), then longest prompt (most
    memory back), until the rest have room for ``RETRACT_DECODE_STEPS`` steps each, so the next
    retraction is not one step away. At least one request keeps running; if even that one
    cannot get a slot, the pool cannot hold it at all and it is aborted.

    Mutates: ``running`` (victims removed), the cache (victims' slots freed); retracted
    requests are reset to hold no slots. The caller queues them and finishes aborted ones.
    """
    result = Retraction()
    if cache.available_and_evictable() >= decode_slots_needed(running, cache):
        return result
    victims = sorted(running, key=lambda r: (len(r.output_ids), -r.prompt_len), reverse=True)
    while len(running) > 1 and (
            not result.retracted or cache.available_and_evictable()
            < decode_slots_needed(running, cache, RETRACT_DECODE_STEPS)):
        req = victims.pop()
        running.remove(req)
        cache.release(req)
        req.num_retractions += 1
        result.retracted.append(req)
    if cache.available_and_evictable() < decode_slots_needed(running, cache):
        req = running.pop()
        req.finish_reason = FinishReason.abort(
            f"out of KV memory: the pool of {cache.pool_size} tokens cannot hold this request's "
            f"next token (its sequence has {req.total_len} tokens); raise --max-total-tokens or "
            f"lower max_new_tokens")
        result.aborted.append(req)
    return result
