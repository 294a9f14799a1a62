"""Who a node is: the pool secret, the per-node credentials it issues, signed heartbeats and revocations.

The pool secret is known to the routers and to the operator's ``macpool node`` command only. Each node gets
``key = HMAC(pool secret, node id, issue time)`` (:func:`issue`), with which it signs its heartbeats and from
which the token the routers send it (``X-Macpool-Token``) is derived. A router derives the same key from the
secret and the signer named in the heartbeat, so it needs no list of nodes; a Mac holds its own key only, so
one leaked Mac exposes that Mac alone. Revoking a node id revokes every credential issued for it until then;
a credential issued later brings the node back. docs/security.md, "Node identity", says why this design
and what each part guards.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

from macpool.contract import NodeDoc, signed_payload

SECRET_BYTES = 32
CREDENTIAL_PREFIX = "macpool-node-1"
DEFAULT_SECRET_FILE = Path("~/.config/macpool/pool-secret")


class IdentityError(ValueError):
    """A pool secret, credential or record that cannot be used; the message says which and why."""


def _mac(key: bytes, *parts: str | bytes) -> bytes:
    """HMAC-SHA256 of ``parts``, each length-prefixed so that no two lists of parts read alike."""
    message = b"".join(
        len(raw).to_bytes(4, "big") + raw for raw in (p.encode() if isinstance(p, str) else p for p in parts)
    )
    return hmac.new(key, message, hashlib.sha256).digest()


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def check_node_id(node_id: str) -> str:
    """A node id a credential can be issued for: no whitespace (the pool's records list ids separated by
    spaces and newlines) and no ``/`` (``<mac>/<model>`` names the model nodes of one Mac, which its
    credential covers)."""
    if not node_id or any(c.isspace() for c in node_id) or "/" in node_id:
        raise IdentityError(f"node id {node_id!r}: expected a non-empty name without spaces or '/'")
    return node_id


@dataclass(frozen=True)
class NodeCredential:
    """What one node needs to prove who it is: its id, when it was issued (ms) and its key (:func:`issue`)."""

    node_id: str
    issued_ms: int
    key: bytes

    def encode(self) -> str:
        """One line, for a file or a paste: ``macpool-node-1:<node id>:<issued ms>:<key>``."""
        return f"{CREDENTIAL_PREFIX}:{self.node_id}:{self.issued_ms}:{_b64(self.key)}"

    @classmethod
    def parse(cls, text: str) -> NodeCredential:
        prefix, _, rest = text.strip().partition(":")
        node_id, _, rest = rest.rpartition(":")
        node_id, _, issued = node_id.rpartition(":")
        try:
            raw = _unb64(rest)
        except (binascii.Error, ValueError):
            raw = b""
        if prefix != CREDENTIAL_PREFIX or len(raw) != SECRET_BYTES or not issued.isdigit():
            raise IdentityError(f"not a node credential (expected {CREDENTIAL_PREFIX}:<node id>:<issued>:"
                                "<key>, as `macpool node add` prints)")
        return cls(check_node_id(node_id), int(issued), raw)

    def covers(self, node_id: str) -> bool:
        """Whether this credential speaks for ``node_id``: its own, or a model node of its Mac."""
        return covers(self.node_id, node_id)

    def sign(self, doc: NodeDoc) -> NodeDoc:
        """``doc`` signed by this credential."""
        if not self.covers(doc.node_id):
            raise IdentityError(f"the credential of {self.node_id!r} cannot sign for node {doc.node_id!r}")
        signed = doc.model_copy(update={"signer": self.node_id, "signer_issued_ms": self.issued_ms,
                                        "signature": ""})
        return signed.model_copy(update={"signature": heartbeat_signature(self.key, signed)})

    @property
    def agent_token(self) -> str:
        """The token routers send this node's agent (X-Macpool-Token): derived, so that a token seen on the
        wire does not give away the key that signs heartbeats."""
        return _b64(_mac(self.key, "agent token"))


def covers(signer: str, node_id: str) -> bool:
    return node_id == signer or node_id.startswith(signer + "/")


def heartbeat_signature(key: bytes, doc: NodeDoc) -> str:
    return _b64(_mac(key, "heartbeat", signed_payload(doc)))


@dataclass(frozen=True)
class PoolSecret:
    """The secret the routers and the operator's ``macpool node`` command share."""

    key: bytes

    @classmethod
    def generate(cls) -> PoolSecret:
        return cls(secrets.token_bytes(SECRET_BYTES))

    def encode(self) -> str:
        return f"macpool-pool-1:{_b64(self.key)}"

    @classmethod
    def parse(cls, text: str) -> PoolSecret:
        prefix, _, key = text.strip().partition(":")
        try:
            raw = _unb64(key)
        except (binascii.Error, ValueError):
            raw = b""
        if prefix != "macpool-pool-1" or len(raw) != SECRET_BYTES:
            raise IdentityError("not a pool secret (expected macpool-pool-1:<key>, as `macpool node init` "
                                "writes)")
        return cls(raw)

    def node_key(self, node_id: str, issued_ms: int) -> bytes:
        return _mac(self.key, "node key", node_id, str(issued_ms))

    def revocation_signature(self, node_id: str, before_ms: int) -> str:
        return _b64(_mac(self.key, "revocation", node_id, str(before_ms)))


def issue(secret: PoolSecret, node_id: str, issued_ms: int) -> NodeCredential:
    """A new credential of ``node_id``, issued at ``issued_ms``: all a node needs to join a pool whose
    routers hold ``secret``. Valid until the id is revoked at a later time (``macpool node revoke``)."""
    return NodeCredential(check_node_id(node_id), issued_ms, secret.node_key(node_id, issued_ms))


def credential_of(secret: PoolSecret, doc: NodeDoc) -> NodeCredential:
    """The credential ``doc`` names as its signer, as the pool secret derives it."""
    return NodeCredential(doc.signer, doc.signer_issued_ms, secret.node_key(doc.signer, doc.signer_issued_ms))


def verify_signature(secret: PoolSecret, doc: NodeDoc) -> str | None:
    """Why ``doc``'s signature does not prove it comes from ``doc.node_id``'s credential, or None."""
    if not doc.signature:
        return "unsigned heartbeat"
    if not covers(doc.signer, doc.node_id):
        return f"signed with the credential of {doc.signer!r}, which is not this node's"
    expected = heartbeat_signature(credential_of(secret, doc).key, doc)
    if not hmac.compare_digest(expected.encode(), doc.signature.encode()):
        return "bad signature: not signed with this node's credential, or altered"
    return None


# --- revocation records ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Revocation:
    """The operator's word that every credential of ``node_id`` issued before ``before_ms`` is revoked;
    signed with the pool secret, so that a Mac with write access to Redis cannot forge one. A later one
    supersedes it: routers keep the latest time they have seen."""

    node_id: str
    before_ms: int
    signature: str

    @classmethod
    def make(cls, secret: PoolSecret, node_id: str, before_ms: int) -> Revocation:
        return cls(node_id, before_ms, secret.revocation_signature(node_id, before_ms))

    def encode(self) -> str:
        return json.dumps({"before": self.before_ms, "sig": self.signature}, separators=(",", ":"))

    @classmethod
    def decode(cls, node_id: str, raw: str | bytes) -> Revocation:
        try:
            doc = json.loads(raw)
            return cls(node_id, int(doc["before"]), str(doc["sig"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise IdentityError(f"revocation record of {node_id!r}: unreadable ({type(exc).__name__})") \
                from None

    def valid(self, secret: PoolSecret) -> bool:
        expected = secret.revocation_signature(self.node_id, self.before_ms)
        return hmac.compare_digest(expected.encode(), self.signature.encode())


# --- files ----------------------------------------------------------------------------------------

def read_private(path: Path, what: str) -> str:
    """The text of a secret file, refused when anyone but its owner may read it (as ssh refuses a key)."""
    try:
        mode = path.stat().st_mode
        text = path.read_text()
    except FileNotFoundError:
        raise IdentityError(f"{what} {str(path)!r}: no such file") from None
    except OSError as exc:
        raise IdentityError(f"{what} {str(path)!r}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise IdentityError(f"{what} {str(path)!r}: not text") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise IdentityError(f"{what} {str(path)!r}: readable by others (mode {stat.S_IMODE(mode):o}); "
                            f"chmod 600 it")
    return text


def write_private(path: Path, text: str, replace: bool = False) -> None:
    """Write ``text`` to a new file only its owner can read (its folder made if missing)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if replace else os.O_EXCL)
    try:
        fd = os.open(path, flags, 0o600)
    except FileExistsError:
        raise IdentityError(f"{str(path)!r} exists already; not overwritten") from None
    with os.fdopen(fd, "w") as out:
        out.write(text if text.endswith("\n") else text + "\n")


def load_secret(path: Path) -> PoolSecret:
    text = read_private(path, "pool secret")
    try:
        return PoolSecret.parse(text)
    except IdentityError as exc:
        raise IdentityError(f"pool secret {str(path)!r}: {exc}") from None


def load_credential(path: Path) -> NodeCredential:
    text = read_private(path, "node credential")
    try:
        return NodeCredential.parse(text)
    except IdentityError as exc:
        raise IdentityError(f"node credential {str(path)!r}: {exc}") from None
