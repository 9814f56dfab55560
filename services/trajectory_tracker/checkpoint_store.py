"""Where the tracker keeps its checkpoints: one object in a JetStream object store. The I/O half of checkpoint.py.

Why an object store and not a KV bucket. A checkpoint holds every live trajectory and up to 100,000 recently ended
ids: ~80 kB compressed for 10,000 live trajectories, megabytes in the worst case, beyond NATS's 1 MB default max
payload. The object store already chunks (128 kB), checks a SHA-256 digest on read, and replaces an object safely:
the new chunks first, then the metadata message that points at them (a roll-up), then the old chunks are purged;
so a tracker killed mid-write leaves the previous checkpoint readable. On a KV bucket all of that would be
home-made. The bucket holds one object, `LATEST`; its stream ages messages out after the EVENTS stream's max age,
which also removes chunks orphaned by a tracker killed mid-write.

Who: only the tracker role may use the bucket (`services/runtime/auth.py`); its name is `Subjects.tracker_checkpoint_bucket`.
"""

from __future__ import annotations

from nats.js import JetStreamContext
from nats.js.api import ObjectStoreConfig, StorageType
from nats.js.errors import (
    BadObjectMetaError,
    BadRequestError,
    BucketNotFoundError,
    DigestMismatchError,
    ObjectNotFoundError,
)
from nats.js.object_store import ObjectStore

from services.runtime.bus import DEFAULT_EVENTS_MAX_AGE_S
from services.trajectory_tracker.checkpoint import CheckpointError

LATEST = "LATEST"


class CheckpointStore:
    """`open()` once, then `load()` / `save(data)`. nats errors (server away) propagate to the caller."""

    def __init__(
        self, js: JetStreamContext, bucket: str, max_age_s: float = DEFAULT_EVENTS_MAX_AGE_S
    ) -> None:
        self.js = js
        self.bucket = bucket
        self.max_age_s = max_age_s
        self._store: ObjectStore | None = None

    async def open(self) -> None:
        """Bind the bucket, creating it when missing (a concurrent creation by another tracker is fine)."""
        try:
            self._store = await self.js.object_store(self.bucket)
            return
        except BucketNotFoundError:
            pass
        config = ObjectStoreConfig(
            description="trajectory tracker checkpoints", ttl=self.max_age_s, storage=StorageType.FILE
        )
        try:
            self._store = await self.js.create_object_store(self.bucket, config=config)
        except (
            BadRequestError
        ):  # created meanwhile (with another config it stays as it is: not ours to change)
            self._store = await self.js.object_store(self.bucket)

    async def load(self) -> bytes | None:
        """The latest checkpoint's bytes, None when there is none. Raises CheckpointError("corrupt") when the
        object does not read back whole (digest or metadata wrong)."""
        assert self._store is not None, "open() first"
        try:
            result = await self._store.get(LATEST)
        except ObjectNotFoundError:
            return None
        except (DigestMismatchError, BadObjectMetaError) as exc:
            raise CheckpointError("corrupt", f"object store: {exc!r}") from exc
        return bytes(result.data or b"")

    async def save(self, data: bytes) -> None:
        assert self._store is not None, "open() first"
        await self._store.put(LATEST, data)
