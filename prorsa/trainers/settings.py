"""Prorsa's settings inside a trainer's own config: verl's `actor_rollout_ref.rollout.custom.prorsa` (a free-form
dict verl's RolloutConfig keeps for backends), e.g. on verl's command line

    actor_rollout_ref.rollout.name=prorsa \\
    +actor_rollout_ref.rollout.custom.prorsa.weights_root=/shared/ckpt \\
    +actor_rollout_ref.rollout.custom.prorsa.task=coding

Every key is optional; what is not set comes from the environment a `trainer.env` of `prorsa up` sets
(PRORSA_NATS_URL, PRORSA_NATS_*, PRORSA_NAMESPACE, PRORSA_TIME_SCALE, PRORSA_WEIGHTS_ROOT). An unknown key is an
error that names it (a typo would otherwise silently fall back to the environment).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from prorsa.trainers.connection import Connection
from services.runtime.credentials import BusCredentials


@dataclass(frozen=True)
class ProrsaSettings:
    nats_url: str = ""  # default: $PRORSA_NATS_URL
    namespace: str = ""  # default: $PRORSA_NAMESPACE, else "prorsa"
    nkey_file: str = ""  # the trainer's nkey seed file (default: $PRORSA_NATS_NKEY)
    inbox_prefix: str = ""  # its inbox prefix (default: $PRORSA_NATS_INBOX_PREFIX)
    time_scale: float = 0.0  # the cluster's clock scale (default: $PRORSA_TIME_SCALE, else 1)
    task: str = ""  # the task named on every trajectory (the forecaster keys its priors by it)
    weights_root: str = ""  # where new checkpoints are written, a directory every engine reads and accepts
    update_timeout_s: float = 300.0  # how long a weight update waits for every engine to serve it

    def connection(self) -> Connection:
        """The cluster these settings name, completed from the environment. Raises NoClusterError without a URL."""
        base = Connection.from_env(self.nats_url or None)
        creds = base.credentials.merged(
            BusCredentials(nkey_file=self.nkey_file, inbox_prefix=self.inbox_prefix)
        )
        return replace(
            base,
            credentials=creds,
            namespace=self.namespace or base.namespace,
            time_scale=self.time_scale or base.time_scale,
        )

    def weights_dir(self) -> str:
        """The weights root, else $PRORSA_WEIGHTS_ROOT. Raises ValueError when neither is set."""
        root = self.weights_root or os.environ.get("PRORSA_WEIGHTS_ROOT", "")
        if not root:
            raise ValueError(
                "no weights root: set actor_rollout_ref.rollout.custom.prorsa.weights_root (or PRORSA_WEIGHTS_ROOT) "
                "to a directory the engines read and accept (their --weights-root)"
            )
        return root


def settings_from(values: Mapping[str, Any] | None) -> ProrsaSettings:
    """`ProrsaSettings` from a mapping. Raises ValueError naming unknown keys."""
    values = dict(values or {})
    known = {f.name for f in fields(ProrsaSettings)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown Prorsa settings {unknown}; known: {sorted(known)}")
    return ProrsaSettings(**values)


def prorsa_settings(rollout_config: Any) -> ProrsaSettings:
    """The settings in a verl rollout config (`custom.prorsa`; DictConfig, dict or RolloutConfig dataclass).
    Raises ValueError for a section that is not a mapping or names unknown keys."""
    custom = getattr(rollout_config, "custom", None)
    if custom is None and isinstance(rollout_config, Mapping):
        custom = rollout_config.get("custom")
    section = custom.get("prorsa") if custom is not None else None
    if section is not None and not isinstance(section, Mapping):  # an OmegaConf DictConfig is a Mapping
        raise ValueError(f"rollout.custom.prorsa must be a mapping of settings, got {section!r}")
    return settings_from(section)
