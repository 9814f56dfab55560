"""One rollout engine: pulls generation work for its role, runs it on a backend (vLLM or simulated), hands KV
from prefill to decode, and switches role on command without losing a request. See agent.py."""
