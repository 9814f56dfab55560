"""The tracker's domain metrics: live trajectories by phase, and trajectories that ended, by how.

Set from each published snapshot (the tracker's own picture, so the series and the snapshot never disagree):
  prorsa_trajectories{phase}               live trajectories per lifecycle state (queued, prefill, decode,
                                           tool_call)
  prorsa_trajectories_ended_total{status}  finished, aborted, lost (the snapshot's running totals)
"""

from __future__ import annotations

from proto import LifecycleSnapshot
from services.runtime.metrics import ServiceMetrics

LIVE_PHASES = ("queued", "prefill", "decode", "tool_call")
ENDED = {"finished": "finished_total", "aborted": "aborted_total", "lost": "lost_total"}


class TrackerMetrics:
    def __init__(self, m: ServiceMetrics) -> None:
        phases = m.gauge("prorsa_trajectories", "Live trajectories by lifecycle phase", ["phase"])
        ended = m.counter("prorsa_trajectories_ended", "Trajectories that ended, by status", ["status"])
        # Children made up front: every series exists (at 0) from the first scrape, so a dashboard never waits.
        self._phases = {p: phases.labels(phase=p) for p in LIVE_PHASES}
        self._ended = {s: ended.labels(status=s) for s in ENDED}
        self._totals = dict.fromkeys(ENDED, 0)

    def observe(self, snapshot: LifecycleSnapshot) -> None:
        for phase, gauge in self._phases.items():
            gauge.set(snapshot.counts.get(phase, 0))
        for status, attr in ENDED.items():
            total = getattr(snapshot, attr)
            if (
                total > self._totals[status]
            ):  # counters only grow; a restarted tracker replays to the same totals
                self._ended[status].inc(total - self._totals[status])
                self._totals[status] = total
