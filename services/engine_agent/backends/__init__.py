"""Engine backends behind `services.engine_agent.backend.Backend`: `sim_backend` (performance model) and
`vllm_backend` (real vLLM, imported lazily so the simulated path never imports vllm)."""
