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
from .logprobs import forget_input_logprobs
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


def make_room_for_decode(running: list[Req], cache: CacheManager,
                         stalled_chunk: Req | None = None) -> Retraction:
    """Ensure the next decode step of ``running`` fits, retracting requests if needed.

    ``stalled_chunk`` is the prompt mid-chunk, if any. Decode runs only when it got no piece
    this round, so it makes no progress while it holds its computed chunks locked; it goes
    first: releasing it costs nothing now (its chunks stay in the tree, merely evictable,
    and are reused when it comes back unless decode needed their slots, or it asked for
    input logprobs, which are computed again from its logprob start), and it is the
    only way out when a single request is left running (with mixed chunk, decodes ride along
    with every chunk and can eat the room the chunked prompt was admitted with).

    Then running requests, in order of fewest output tokens (least work lost), then longest
    prompt (most memory back), until the rest have room for ``RETRACT_DECODE_STEPS`` steps
    each, so the next retraction is not one step away. At least one request keeps running;
    if even that one cannot get a slot when it holds the pool alone, it is aborted.

    Mutates: ``running`` (victims removed), the cache (victims' slots freed); retracted
    requests are reset to hold no slots. The caller queues them (and forgets the chunked
    request) and finishes aborted ones.
    """
    result = Retraction()
    if cache.available_and_evictable() >= decode_slots_needed(running, cache):
        return result
    if stalled_chunk is not None:
        _retract(stalled_chunk, cache, result)
    victims = sorted(running, key=lambda r: (len(r.output_ids), -r.prompt_len), reverse=True)
    while len(running) > 1 and (
            not result.retracted or cache.available_and_evictable()
            < decode_slots_needed(running, cache, RETRACT_DECODE_STEPS)):
        req = victims.pop()
        running.remove(req)
        _retract(req, cache, result)
    if running and cache.available_and_evictable() < decode_slots_needed(running, cache):
        req = running.pop()
        need = _slots_alone(req, cache)
        if need <= cache.pool_size:
            # Something outside the running set still holds slots (a host-tier load in
            # flight): wait at the front of the queue rather than fail a request that fits.
            _retract(req, cache, result)
        else:
            req.finish_reason = FinishReason.abort(
                f"out of KV memory: this request's next decode step needs {need} KV slots "
                f"({req.total_len} tokens so far) and the whole pool holds "
                f"{cache.pool_size}; raise --max-total-tokens or lower max_new_tokens")
            result.aborted.append(req)
    return result


def _retract(req: Req, cache: CacheManager, result: Retraction) -> None:
    """Free ``req``'s slots (nothing inserted; its prefix in the tree is just unlocked) and
    reset it to come back through the waiting queue."""
    cache.release(req)
    forget_input_logprobs(req)
    req.num_retractions += 1
    result.retracted.append(req)


def _slots_alone(req: Req, cache: CacheManager) -> int:
    """Slots ``req`` holds plus those its next decode step takes: what the pool must have
    for it with nothing else in it."""
    return cache.slots_needed(0, req.cached_len) + decode_slots_needed([req], cache)
