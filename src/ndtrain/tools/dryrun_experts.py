"""Expert parallel in a dry run: the routing assumption.

How many token rows a rank sends to each expert rank depends on the router's choices, which
fake tensors do not have: the all-to-all's split sizes are read on the host (parallel/expert.py,
once per MoE layer and micro-batch: a sync on a GPU too, and counted as one). The dry run
answers those reads with **balanced routing**: a rank's rows split as evenly as they divide over
the expert ranks, and it receives as many from each as it sends. A skewed router moves more
bytes and runs more expert rows on its busiest rank than this shows.
"""

from __future__ import annotations

ROUTING = "balanced: each rank's routed rows split evenly over the expert-parallel ranks"


def balanced_exchanges(parts, watch) -> int:
    """Makes every expert exchange in `parts` answer its split-size reads as balanced routing
    would (on the instance: the exchange's own code runs); how many it found."""
    from ndtrain.parallel.expert import ExpertExchange

    found = 0
    for part in parts:
        for module in part.modules():
            exchange = getattr(module, "exchange", None)
            if isinstance(exchange, ExpertExchange):
                module.exchange = _balanced(exchange, watch)
                found += 1
    return found


def _balanced(exchange, watch):
    def call(xs, counts, experts):
        rows, size = xs.shape[0], exchange.size
        shares = [rows // size + (1 if i < rows % size else 0) for i in range(size)]
        reads = iter(shares * 2)  # what it sends to each rank, then what it receives from each
        watch.answer = lambda: next(reads)
        try:
            return exchange(xs, counts, experts)
        finally:
            watch.answer = None

    return call
