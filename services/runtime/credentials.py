"""Where a bus client's credentials come from, and the nats.py connect options they make.

Every connection of Prorsa (services, the client SDK, `prorsa status`, `prorsa up`) goes through
`bus.connect`, which takes a `BusCredentials` (default: `BusCredentials.from_env()`). The environment:

  PRORSA_NATS_NKEY          nkey seed file of this user (`<user>.nk` from `prorsa up` / `prorsa secrets`)
  PRORSA_NATS_USER          user name (user/password servers; also names the default inbox prefix)
  PRORSA_NATS_PASSWORD      its password
  PRORSA_NATS_INBOX_PREFIX  the user's inbox prefix, `_INBOX.<user>` (default: from PRORSA_NATS_USER, else
                            `_INBOX`); a server with Prorsa's permissions refuses any other inbox
  PRORSA_NATS_TLS_CA        CA bundle that signs the server's certificate (enables TLS)
  PRORSA_NATS_TLS_CERT      client certificate, for a server that verifies clients (with PRORSA_NATS_TLS_KEY)
  PRORSA_NATS_TLS_KEY       its private key

`prorsa up` writes one `<user>.env` file of these per user (`source` it to act as that user). No variable set:
an anonymous connection, as the open embedded server of the tests accepts.
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

ENV = {
    "nkey_file": "PRORSA_NATS_NKEY",
    "user": "PRORSA_NATS_USER",
    "password": "PRORSA_NATS_PASSWORD",
    "inbox_prefix": "PRORSA_NATS_INBOX_PREFIX",
    "tls_ca": "PRORSA_NATS_TLS_CA",
    "tls_cert": "PRORSA_NATS_TLS_CERT",
    "tls_key": "PRORSA_NATS_TLS_KEY",
}


class CredentialsError(ValueError):
    """Credentials that cannot work (a missing seed file, a certificate without its key, ...)."""


@dataclass(frozen=True, slots=True)
class BusCredentials:
    nkey_file: str = ""
    user: str = ""
    password: str = ""
    inbox_prefix: str = ""
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> BusCredentials:
        env = os.environ if env is None else env
        return cls(**{name: env.get(var, "") for name, var in ENV.items()})

    def to_env(self) -> dict[str, str]:
        """The variables that give a child process these credentials (unset fields are left out)."""
        return {ENV[f.name]: getattr(self, f.name) for f in fields(self) if getattr(self, f.name)}

    def env_file_text(self, url: str = "") -> str:
        """`export` lines for a shell (`source` the file); the password, if any, is in it: keep it 0600."""
        env = ({"PRORSA_NATS_URL": url} if url else {}) | self.to_env()
        return "".join(f"export {k}={_shell_quote(v)}\n" for k, v in env.items())

    def merged(self, other: BusCredentials) -> BusCredentials:
        """These credentials with every field `other` sets replacing ours (command-line options over env)."""
        return BusCredentials(
            **{f.name: getattr(other, f.name) or getattr(self, f.name) for f in fields(self)}
        )

    @property
    def anonymous(self) -> bool:
        return not (self.nkey_file or self.user)

    def connect_options(self) -> dict[str, Any]:
        """Keyword arguments for `nats.connect`. Raises CredentialsError for credentials that cannot work."""
        opts: dict[str, Any] = {}
        if self.nkey_file:
            if not os.path.isfile(self.nkey_file):
                raise CredentialsError(f"nkey seed file {self.nkey_file!r} does not exist")
            opts["nkeys_seed"] = self.nkey_file
        elif self.user:
            opts["user"] = self.user
            opts["password"] = self.password
        elif self.password:
            raise CredentialsError("PRORSA_NATS_PASSWORD is set without PRORSA_NATS_USER")
        prefix = self.inbox_prefix or (f"_INBOX.{self.user}" if self.user else "")
        if prefix:
            opts["inbox_prefix"] = prefix
        tls = self.tls_context()
        if tls is not None:
            opts["tls"] = tls
        return opts

    def tls_context(self) -> ssl.SSLContext | None:
        """A client TLS context trusting `tls_ca` (and presenting `tls_cert`), or None without TLS settings."""
        if not (self.tls_ca or self.tls_cert or self.tls_key):
            return None
        if bool(self.tls_cert) != bool(self.tls_key):
            raise CredentialsError("a TLS client certificate needs its key (PRORSA_NATS_TLS_CERT and _KEY)")
        for path in (self.tls_ca, self.tls_cert, self.tls_key):
            if path and not os.path.isfile(path):
                raise CredentialsError(f"TLS file {path!r} does not exist")
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.tls_ca or None)
        if self.tls_cert:
            ctx.load_cert_chain(self.tls_cert, self.tls_key)
        return ctx


def add_credential_arguments(p: Any) -> None:
    """`--nkey`, `--inbox-prefix`, `--tls-ca` on an argparse parser (each overrides its variable)."""
    g = p.add_argument_group("bus credentials (default: the PRORSA_NATS_* environment)")
    g.add_argument("--nkey", default=None, help="nkey seed file ($PRORSA_NATS_NKEY)")
    g.add_argument(
        "--inbox-prefix", default=None, help="inbox prefix _INBOX.<user> ($PRORSA_NATS_INBOX_PREFIX)"
    )
    g.add_argument("--tls-ca", default=None, help="CA of the server's TLS certificate ($PRORSA_NATS_TLS_CA)")


def credentials_from_args(args: Any, env: Mapping[str, str] | None = None) -> BusCredentials:
    """The environment's credentials with the command line's options over them."""
    given = BusCredentials(
        nkey_file=getattr(args, "nkey", None) or "",
        inbox_prefix=getattr(args, "inbox_prefix", None) or "",
        tls_ca=getattr(args, "tls_ca", None) or "",
    )
    return BusCredentials.from_env(env).merged(given)


def _shell_quote(value: str) -> str:
    return "'" + value.replace("'", "'\"'\"'") + "'"
