"""Authentication of the ZeroMQ control plane: CURVE keys per role, and the coordinator's gatekeeper.

The coordinator's socket is a CURVE server. A peer can connect only with a key pair of this
launch: the engines' pair (engine endpoints) or the clients' pair (the HTTP server, tools).
libzmq asks the coordinator's :class:`ZapHandler` about every new connection (ZAP, ZeroMQ RFC
27) before a single message of it is read; a key it does not know never gets a frame
through, and the role of a known key becomes the ``User-Id`` of every message that
connection delivers, so an engine key cannot submit requests and a client key cannot
register as an engine. CURVE also encrypts the traffic.

The handoff channel between a prefill worker and its decode engine uses the same key material
(:meth:`ControlPlaneKeys.secure_engine_link`): only a holder of the engine key pair gets a
frame through.

Keys are generated at launch (:meth:`ControlPlaneKeys.generate`) and handed to the processes
that need them in a key file (JSON, z85 keys, mode 0600 in a private directory), named by the
``MEGATRON_CONTROL_PLANE_KEYS`` environment variable; each process gets only its role's pair
and the coordinator's public key (:meth:`ControlPlaneKeys.for_role`). Inside one process the
coordinator, its clients and engines share :func:`launch_keys` without any file.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import stat
import threading

import zmq
from zmq.utils import z85

from megatron.core.errors import MegatronConfigError

KEYS_ENV = "MEGATRON_CONTROL_PLANE_KEYS"
ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # where libzmq sends a context's authentication requests
ZAP_DOMAIN = b"megatron"


class Role(enum.StrEnum):
    """Who a connection to the coordinator is (the User-Id of its messages)."""

    ENGINE = "engine"
    CLIENT = "client"


class ControlPlaneKeyError(MegatronConfigError):
    """A key file that is missing, not private, or does not hold the keys a role needs."""


@dataclasses.dataclass(frozen=True)
class ControlPlaneKeys:
    """CURVE keys (z85-encoded bytes) of one launch; a process holds only those of its role.

    ``coordinator_public`` is always there; the coordinator holds ``coordinator_secret`` and the
    public keys of both roles; an engine or client holds its role's pair.
    """

    coordinator_public: bytes
    coordinator_secret: bytes | None = None
    engine_public: bytes | None = None
    engine_secret: bytes | None = None
    client_public: bytes | None = None
    client_secret: bytes | None = None

    @classmethod
    def generate(cls) -> ControlPlaneKeys:
        """Fresh keys for every role."""
        coordinator, engine, client = zmq.curve_keypair(), zmq.curve_keypair(), zmq.curve_keypair()
        return cls(*coordinator, *engine, *client)

    def for_role(self, role: Role | str) -> ControlPlaneKeys:
        """What a process of ``role`` needs: the coordinator's public key and the role's pair."""
        role = Role(role)
        public, secret = self.pair(role)
        return ControlPlaneKeys(
            self.coordinator_public, **{f"{role.value}_public": public, f"{role.value}_secret": secret}
        )

    def pair(self, role: Role | str) -> tuple[bytes, bytes]:
        """``(public, secret)`` of ``role``; raises :class:`ControlPlaneKeyError` when not held."""
        role = Role(role)
        public, secret = getattr(self, f"{role.value}_public"), getattr(self, f"{role.value}_secret")
        if public is None or secret is None:
            raise ControlPlaneKeyError(f"these control-plane keys hold no {role.value} key pair")
        return public, secret

    def role_of(self, client_public_key: bytes) -> Role | None:
        """The role whose public key is ``client_public_key`` (32 raw bytes), or None."""
        for role in Role:
            public = getattr(self, f"{role.value}_public")
            if public is not None and z85.decode(public) == client_public_key:
                return role
        return None

    # -- sockets -------------------------------------------------------------------------

    def secure_server(self, socket: zmq.Socket) -> None:
        """Make ``socket`` (before it binds) the CURVE server of this launch; needs a :class:`ZapHandler`
        in the socket's context, or no connection is let in (the domain is enforced)."""
        if self.coordinator_secret is None:
            raise ControlPlaneKeyError("these control-plane keys hold no coordinator secret key")
        socket.curve_server = True
        socket.curve_publickey = self.coordinator_public
        socket.curve_secretkey = self.coordinator_secret
        socket.zap_domain = ZAP_DOMAIN
        socket.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)

    def secure_peer(self, socket: zmq.Socket, role: Role | str) -> None:
        """Make ``socket`` (before it connects) a CURVE client of the coordinator as ``role``."""
        public, secret = self.pair(role)
        socket.curve_serverkey = self.coordinator_public
        socket.curve_publickey = public
        socket.curve_secretkey = secret

    def secure_engine_link(self, socket: zmq.Socket, *, server: bool) -> None:
        """Make ``socket`` one end of a CURVE link between two engines of this launch (the
        handoff channel between a prefill worker and its decode engine): both ends hold the
        engine key pair, and the server's key is the engine public key. The server end (before
        it binds) needs a :class:`ZapHandler` accepting :attr:`Role.ENGINE` in its context."""
        public, secret = self.pair(Role.ENGINE)
        socket.curve_publickey = public
        socket.curve_secretkey = secret
        if server:
            socket.curve_server = True
            socket.zap_domain = ZAP_DOMAIN
            socket.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
        else:
            socket.curve_serverkey = public

    # -- files ---------------------------------------------------------------------------

    def save(self, path: str) -> str:
        """Write the keys to a new file only its owner can read (mode 0600); returns ``path``."""
        data = {k: v.decode("ascii") for k, v in dataclasses.asdict(self).items() if v is not None}
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f)
        return path

    @classmethod
    def load(cls, path: str) -> ControlPlaneKeys:
        """Read a key file written by :meth:`save`; refuses one that others than its owner may read."""
        try:
            mode = os.stat(path).st_mode
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, ValueError) as exc:
            raise ControlPlaneKeyError(f"cannot read the control-plane key file {path}: {exc}") from exc
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ControlPlaneKeyError(
                f"the control-plane key file {path} is readable by other users (mode {stat.S_IMODE(mode):o}); "
                "it must be 0600"
            )
        fields = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(data, dict) or "coordinator_public" not in data or not set(data) <= fields:
            raise ControlPlaneKeyError(
                f"the control-plane key file {path} must be a JSON map holding coordinator_public and only keys "
                f"among {sorted(fields)}"
            )
        return cls(**{k: str(v).encode("ascii") for k, v in data.items()})


_launch_keys: ControlPlaneKeys | None = None
_launch_keys_lock = threading.Lock()


def launch_keys() -> ControlPlaneKeys:
    """The keys of this launch: the file ``$MEGATRON_CONTROL_PLANE_KEYS`` names, else keys
    generated once for this process (shared by every coordinator, client and engine in it)."""
    global _launch_keys
    with _launch_keys_lock:
        if _launch_keys is None:
            path = os.environ.get(KEYS_ENV)
            _launch_keys = ControlPlaneKeys.load(path) if path else ControlPlaneKeys.generate()
        return _launch_keys


class ZapHandler:
    """Answers the authentication requests of one ZeroMQ context (see the module doc).

    Bind it before the socket it guards binds; poll :attr:`socket` and call :meth:`handle`
    when it is readable (the coordinator does this in its loop, so no thread is added).
    ``roles``: the roles let in (a key of another role is denied like an unknown one).
    """

    def __init__(self, context: zmq.Context, keys: ControlPlaneKeys, roles: frozenset[Role] = frozenset(Role)):
        self.keys = keys
        self.roles = roles
        self.denied = 0
        self.socket = context.socket(zmq.REP)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(ZAP_ENDPOINT)

    def handle(self) -> None:
        """Answer one request: 200 with the role as User-Id for a known CURVE key, else 400."""
        request = self.socket.recv_multipart()
        version, request_id = (request + [b"", b""])[:2]
        mechanism = request[5] if len(request) > 5 else b""
        role = self.keys.role_of(request[6]) if mechanism == b"CURVE" and len(request) == 7 else None
        if role not in self.roles:
            self.denied += 1
            self.socket.send_multipart([version, request_id, b"400", b"unknown key", b"", b""])
        else:
            self.socket.send_multipart([version, request_id, b"200", b"OK", role.value.encode(), b""])

    def close(self) -> None:
        self.socket.close(linger=0)
