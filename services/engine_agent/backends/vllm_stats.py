"""Load and counters of one vLLM engine, collected by a stat logger plugged into its `AsyncLLM`.

vLLM reports `SchedulerStats` (batch, queue, KV use, prefix-cache queries/hits) and `IterationStats` (tokens
prompted and generated) with every batch of engine outputs; a custom `StatLoggerBase` receives them in this
process, on the event loop, so reading the latest values costs nothing. They are as of the engine's last step: an
idle engine reports nothing more, so running/waiting are taken as zero when the frontend has no unfinished request.

Data parallelism. `AsyncLLM` with `data_parallel_size` > 1 runs one scheduler per rank and calls one logger per
rank (`engine_index`); each rank's latest load is kept apart and the snapshot sums them (running, waiting) or
averages them (KV use: every rank has the same number of blocks, and the capacity vLLM reports is their sum), so
no rank's figures overwrite another's. `per_rank` keeps them as they are.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class VllmEngineStats:
    """A snapshot of one engine's load and cumulative counters."""

    running: int  # sequences in the running batch
    waiting: int  # accepted, not running (queued, waiting for KV from a remote engine, no batch slot)
    unfinished: int  # requests the frontend still streams (authoritative, unlike the two above)
    kv_usage: float  # fraction of KV blocks in use, 0..1 (blocks only cached for reuse count as free)
    kv_capacity_tokens: int
    max_batch: int  # max_num_seqs
    prefix_query_tokens: int  # cumulative prompt tokens looked up in the local prefix cache
    prefix_hit_tokens: int  # cumulative of those found there
    kv_pulled_tokens: int  # cumulative prompt tokens loaded through the KV connector (remote prefills)
    prompt_tokens: int  # cumulative prompt tokens computed
    generation_tokens: int  # cumulative output tokens
    preemptions: int  # cumulative
    stats_age_s: float | None  # since the engine last reported; None before its first report
    start_s: float | None  # how long the engine took to start
    per_rank: tuple[RankLoad, ...] = ()  # each data-parallel rank's latest load, by rank


@dataclass(frozen=True, slots=True)
class RankLoad:
    """One data-parallel rank's load as of its last step."""

    rank: int
    running: int
    waiting: int
    kv_usage: float  # fraction of this rank's KV blocks in use, 0..1


class EngineStatsBox:
    """Latest values and running totals, written by the stat logger and read by `VllmEngine.stats()`."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.ranks: dict[int, RankLoad] = {}  # engine_idx -> latest load
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        self.kv_pulled_tokens = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.preemptions = 0
        self.updated_monotonic_s: float | None = None  # wall: the age of vLLM's stats, compared with no stamp

    def record(self, scheduler_stats: Any, iteration_stats: Any, engine_idx: int = 0) -> None:
        """One rank's stats (`engine_idx`: its data-parallel rank)."""
        if scheduler_stats is not None:
            waiting = int(scheduler_stats.num_waiting_reqs) + int(
                getattr(scheduler_stats, "num_skipped_waiting_reqs", 0)
            )
            self.ranks[engine_idx] = RankLoad(
                engine_idx,
                int(scheduler_stats.num_running_reqs),
                waiting,
                float(scheduler_stats.kv_cache_usage),
            )
            prefix = scheduler_stats.prefix_cache_stats
            if prefix is not None:
                self.prefix_query_tokens += int(prefix.queries)
                self.prefix_hit_tokens += int(prefix.hits)
            connector = getattr(scheduler_stats, "connector_prefix_cache_stats", None)
            if connector is not None:
                self.kv_pulled_tokens += int(connector.hits)
            self.updated_monotonic_s = time.monotonic()
        if iteration_stats is not None:
            self.prompt_tokens += int(iteration_stats.num_prompt_tokens)
            self.generation_tokens += int(iteration_stats.num_generation_tokens)
            self.preemptions += int(iteration_stats.num_preempted_reqs)

    def snapshot(
        self,
        unfinished: int,
        kv_capacity_tokens: int,
        max_batch: int,
        start_s: float | None,
        dp_size: int = 1,
    ) -> VllmEngineStats:
        """The engine's load: ranks summed (KV use averaged over `dp_size` ranks, a rank not heard from yet
        counting as empty)."""
        idle = unfinished == 0
        age = None if self.updated_monotonic_s is None else time.monotonic() - self.updated_monotonic_s
        ranks = tuple(self.ranks[r] for r in sorted(self.ranks))
        kv_usage = sum(r.kv_usage for r in ranks) / max(dp_size, len(ranks), 1)
        return VllmEngineStats(
            running=0 if idle else sum(r.running for r in ranks),
            waiting=0 if idle else sum(r.waiting for r in ranks),
            unfinished=unfinished,
            kv_usage=kv_usage,
            kv_capacity_tokens=kv_capacity_tokens,
            max_batch=max_batch,
            prefix_query_tokens=self.prefix_query_tokens,
            prefix_hit_tokens=self.prefix_hit_tokens,
            kv_pulled_tokens=self.kv_pulled_tokens,
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens,
            preemptions=self.preemptions,
            stats_age_s=age,
            start_s=start_s,
            per_rank=ranks,
        )


def make_stat_logger_factory(box: EngineStatsBox) -> Callable[[Any, int], Any]:
    """A per-engine stat-logger factory for `AsyncLLM.from_engine_args(stat_loggers=[...])` feeding `box`."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class _BoxStatLogger(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self.engine_index = engine_index

        def record(
            self,
            scheduler_stats: Any,
            iteration_stats: Any,
            mm_cache_stats: Any = None,
            engine_idx: int = 0,
        ) -> None:
            # vLLM builds one logger per data-parallel rank; the rank is its `engine_index` (and `engine_idx`).
            box.record(scheduler_stats, iteration_stats, self.engine_index)

        def log_engine_initialized(self) -> None:
            pass

    def factory(vllm_config: Any, engine_index: int = 0) -> Any:
        return _BoxStatLogger(vllm_config, engine_index)

    return factory
