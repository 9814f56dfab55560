"""RL trainers' own orchestration on Prorsa: verl and AReaL drive the cluster through their extension points.

- `connection`: `Connection`, the picklable description of a cluster that connects once per process and event loop
  (what travels into verl's Ray actors and AReaL's rollout thread).
- `verl`: `ProrsaLLMClient`, verl's `llm_client`/`server_manager` (imports no verl); `verl_agent_loop`:
  `ProrsaAgentLoop`, the registry entry that finishes every trajectory, and `ProrsaAgentLoopManager`, which hands
  verl's trainer that client; `verl_replica`: `ProrsaReplica`, `rollout.name=prorsa`, whose weight update writes a
  checkpoint and waits for every engine to serve it.
- `areal`: `ProrsaInferenceEngine`, an AReaL `InferenceEngine` that AReaL's `WorkflowExecutor` drives.
- `checkpoint`: new weights as a model directory the engines load; `settings`: Prorsa's keys in a trainer config.

The verl and AReaL modules import their framework and run in the trainers' environment (`make trainers`,
docs/trainers.md); `connection`, `verl`, `checkpoint` and `settings` need only the client SDK.
"""
