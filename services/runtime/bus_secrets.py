"""A private directory of bus credentials: one nkey per user, the server's authorization config, env files.

`prorsa up` writes one for its embedded server (in a fresh temporary directory unless `--secrets-dir`), and
`prorsa secrets DIR` writes one for the compose cluster (docker/compose.yaml mounts it). Layout (the directory
0700, every file 0600):

  auth.conf          the `authorization` block: each user's public nkey and permissions (`auth.permissions`); no
                     secret is in it, but it says who may do what
  server.conf        what a single server loads (`-c`): `include ./auth.conf`, and a `tls` block with --tls-*
  cluster-auth.conf  the cluster's route password and its routes to the other nodes, which must carry it
                     (`cluster { include ./cluster-auth.conf }`): a secret
  <user>.nk          the user's nkey seed: its secret
  <user>.env         `export PRORSA_NATS_*=...` lines: `source` it to connect as that user
  users.json         user → role (and engine id): what was generated, so a directory can be reused

Users: one per role (`trainer`, `tracker`, `forecaster`, `allocator`, `operator`, `engine` for any engine id) and,
given engine ids, one per engine scoped to that id (its user name is the engine id). nkeys are NATS's own
challenge-response keys: the seed never leaves the client, and the server signs nothing it could leak.
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from proto import Subjects, check_token
from services.runtime.auth import (
    ROLE_NAMES,
    BusUser,
    authorization_config,
    inbox_prefix,
    permissions,
    tls_config,
)
from services.runtime.credentials import BusCredentials

ROLE_USERS = ("trainer", "tracker", "forecaster", "allocator", "operator", "engine")


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """The server's certificate and key, and the CA clients trust it by (a self-signed cert is its own CA)."""

    cert_file: str
    key_file: str
    ca_file: str = ""

    @property
    def trust(self) -> str:
        return self.ca_file or self.cert_file


@dataclass(frozen=True, slots=True)
class BusSecrets:
    path: Path
    namespace: str
    users: dict[str, dict[str, str]] = field(default_factory=dict)  # user → {"role": ..., "engine_id": ...}
    tls_ca: str = ""

    @property
    def server_config(self) -> Path:
        return self.path / "server.conf"

    def credentials(self, user: str) -> BusCredentials:
        """The credentials of `user`. Raises KeyError for a user this directory has none for."""
        if user not in self.users:
            raise KeyError(f"no credentials for bus user {user!r} in {self.path}")
        return BusCredentials(
            nkey_file=str(self.path / f"{user}.nk"), inbox_prefix=inbox_prefix(user), tls_ca=self.tls_ca
        )

    def write_env_files(self, url: str = "") -> None:
        """(Re)write every `<user>.env`, naming the server at `url` when given."""
        for user in self.users:
            _write(self.path / f"{user}.env", self.credentials(user).env_file_text(url))

    def engine_user(self, engine_id: str) -> str:
        """The user an engine connects as: its own if generated, else the any-engine user."""
        return engine_id if self.users.get(engine_id, {}).get("role") == "engine" else "engine"


def generate(
    path: str | os.PathLike[str],
    namespace: str = "prorsa",
    engine_ids: tuple[str, ...] = (),
    tls: TlsFiles | None = None,
    url: str = "",
    routes: tuple[str, ...] = (),
) -> BusSecrets:
    """Write a complete directory (see the module doc) at `path`, replacing earlier files of the same names.
    `routes` are the cluster's nodes as `host:port` (their route port). Raises ValueError for an engine id that is
    not a subject token or that clashes with a role user."""
    import nkeys  # NATS's nkeys library (nats.py's own nkey support needs it too); only generating needs it

    root = Path(path)
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    root.chmod(0o700)
    subjects = Subjects(namespace)
    users: dict[str, dict[str, str]] = {name: {"role": name} for name in ROLE_USERS}
    for engine_id in engine_ids:
        check_token(engine_id, "engine id")
        if engine_id in users:
            raise ValueError(f"engine id {engine_id!r} clashes with a bus user of that name")
        users[engine_id] = {"role": "engine", "engine_id": engine_id}
    entries = []
    for user, info in users.items():
        seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
        public = nkeys.from_seed(bytearray(seed)).public_key.decode()
        _write(root / f"{user}.nk", seed.decode() + "\n")
        role = info["role"]
        assert role in ROLE_NAMES
        grants = permissions(role, subjects, user=user, engine_id=info.get("engine_id", "*"))  # type: ignore[arg-type]
        entries.append(BusUser(grants, nkey=public))
    _write(root / "auth.conf", authorization_config(entries))
    server = ["include ./auth.conf\n"]
    if tls is not None:
        server.append(tls_config(tls.cert_file, tls.key_file, tls.ca_file))
    _write(root / "server.conf", "".join(server))
    _write(root / "cluster-auth.conf", _cluster_auth(routes))
    _write(root / "users.json", json.dumps({"namespace": namespace, "users": users}, indent=1) + "\n")
    out = BusSecrets(root, namespace, users, tls.trust if tls is not None else "")
    out.write_env_files(url)
    return out


def _cluster_auth(routes: tuple[str, ...]) -> str:
    """The route password every node asks of a node that routes to it, and the routes this node solicits: a
    nats-server sends a route URL's credentials, never the block's own, so each URL carries the password."""
    password = secrets.token_urlsafe(24)  # URL-safe: it goes into the route URLs as it is
    urls = [f"nats-route://route:{password}@{hostport}" for hostport in routes]
    block = {"authorization": {"user": "route", "password": password}, "routes": urls}
    return "".join(f"{key}: {json.dumps(value, indent=2)}\n" for key, value in block.items())


def load(path: str | os.PathLike[str], tls_ca: str = "") -> BusSecrets:
    """A directory written by `generate`. Raises FileNotFoundError when it holds none."""
    root = Path(path)
    data = json.loads((root / "users.json").read_text())
    return BusSecrets(root, data["namespace"], data["users"], tls_ca)


def _write(path: Path, text: str) -> None:
    """Write `text` to `path` readable by its owner only (0600, also when the file existed)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, text.encode())
    finally:
        os.close(fd)
