"""The adaptive allocator policies (registered by name in `services.allocator.registry`).

| spec       | module        | decides from                                                        |
|------------|---------------|---------------------------------------------------------------------|
| `reactive` | reactive.py   | observed queues and KV use crossing thresholds, one flip per cooldown |
| `dynamo`   | dynamo.py     | predicted request count, ISL, OSL → ⌈demand / per-engine throughput⌉ |
| `prorsa`   | prorsa.py     | a closed queueing model of the turn (turn_model.py) → least time per turn |
| `oracle`   | prorsa.py     | hindsight search by forking the simulator (prorsa.sim.hindsight; simulator only) |

Each takes `key=value` arguments after its name (e.g. `prorsa:margin=0.05`) and the engines'
performance profile (`make_policy(spec, n, profile=...)`).
"""

from services.allocator.policies.dynamo import DynamoPolicy
from services.allocator.policies.prorsa import ProrsaPolicy
from services.allocator.policies.reactive import ReactivePolicy

__all__ = ["DynamoPolicy", "ProrsaPolicy", "ReactivePolicy"]
