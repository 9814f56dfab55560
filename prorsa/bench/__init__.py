"""Benchmarks: decision latency of the allocator, throughput of the tracker and forecaster, synthetic event streams."""
