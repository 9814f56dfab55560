"""The one error family of `prorsa.workload`: bad input from the user (a spec, a trace file, a parameter)."""

from __future__ import annotations


class WorkloadError(ValueError):
    """A workload spec or trace file that cannot be used; the message names the spec, or the file and line."""
