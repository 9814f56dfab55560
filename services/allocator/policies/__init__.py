"""The adaptive allocator policies, registered by name in `services.allocator.policy`'s registry on import.

| spec       | module        | decides from                                                        |
|------------|---------------|---------------------------------------------------------------------|
| `reactive` | reactive.py   | observed queues and KV use crossing thresholds, one flip per cooldown |
| `dynamo`   | dynamo.py     | predicted request count, ISL, OSL → ⌈demand / per-engine throughput⌉ |
| `prorsa`   | prorsa.py     | a closed queueing model of the turn (turn_model.py) → least time per turn |
| `oracle`   | prorsa.py     | hindsight search by forking the simulator (prorsa.sim.hindsight; simulator only) |

Each takes `key=value` arguments after its name (e.g. `prorsa:margin=0.05`) and the engines'
performance profile (`make_policy(spec, n, profile=...)`).
"""

from services.allocator.policies.dynamo import DynamoPolicy, make_dynamo
from services.allocator.policies.prorsa import ProrsaPolicy, make_oracle, make_prorsa
from services.allocator.policies.reactive import ReactivePolicy, make_reactive
from services.allocator.policy import register_policy

register_policy("reactive", make_reactive, uses_profile=True)
register_policy("dynamo", make_dynamo, uses_profile=True)
register_policy("prorsa", make_prorsa, uses_profile=True)
register_policy("oracle", make_oracle, uses_profile=True)

__all__ = ["DynamoPolicy", "ProrsaPolicy", "ReactivePolicy"]
