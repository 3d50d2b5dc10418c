"""A paramiko client to one node, opened as the project's SSH rules say: the host key must be in
the inventory's known_hosts file (RejectPolicy), authentication is by key only, and each way a
connect fails is named with its fix. A failure that may pass (refused, reset, timed out) is a
TransientRemoteError, which sparkdeploy.remote.ssh.connect retries.
"""

from __future__ import annotations

import errno
import socket
from pathlib import Path
from typing import TYPE_CHECKING

import paramiko

from sparkdeploy.errors import RemoteError, TransientRemoteError

if TYPE_CHECKING:
    from sparkdeploy.remote.ssh import SshTarget

# A dead link (no FIN, no RST: a cable pulled, a node frozen) is noticed this fast: SSH keepalives
# go out every KEEPALIVE_S, and the kernel drops the TCP connection once data has waited
# LINK_LOST_S for its ACK, which ends the transport and fails the command running on it.
KEEPALIVE_S = 2
LINK_LOST_S = 10


def open_client(target: SshTarget) -> paramiko.SSHClient:
    known_hosts = Path(target.known_hosts).expanduser()
    identity_file = Path(target.identity_file).expanduser()
    client = paramiko.SSHClient()
    try:
        client.load_host_keys(str(known_hosts))
    except OSError as error:
        raise RemoteError(
            f"{target}: cannot read known_hosts {known_hosts}: {error}; point the inventory's"
            " known_hosts at a file holding the node's host key"
        ) from error
    client.set_missing_host_key_policy(paramiko.RejectPolicy())
    try:
        client.connect(
            target.host,
            port=target.port,
            username=target.user,
            key_filename=str(identity_file),
            timeout=target.connect_timeout_s,
            banner_timeout=target.connect_timeout_s,
            auth_timeout=target.connect_timeout_s,
            allow_agent=False,
            look_for_keys=False,
        )
    except (TimeoutError, ConnectionError, EOFError) as error:
        client.close()
        raise TransientRemoteError(f"{target}: cannot connect: {error!r}") from error
    except paramiko.BadHostKeyException as error:
        client.close()
        raise RemoteError(
            f"{target}: host key differs from {known_hosts}: {error}; check the node, then"
            " update known_hosts"
        ) from error
    except paramiko.AuthenticationException as error:
        client.close()
        raise RemoteError(
            f"{target}: key authentication with {identity_file} failed: {error}; install the"
            f" public key in {target.user}'s authorized_keys on the node"
        ) from error
    except paramiko.SSHException as error:
        client.close()
        if "not found in known_hosts" in str(error):
            raise RemoteError(
                f"{target}: host key not in {known_hosts}; add the node's key there"
                f" (ssh-keyscan -p {target.port} {target.host} >> {known_hosts})"
            ) from error
        raise TransientRemoteError(f"{target}: SSH handshake failed: {error}") from error
    except OSError as error:
        client.close()
        if isinstance(error, FileNotFoundError) or not identity_file.exists():
            raise RemoteError(
                f"{target}: identity_file {identity_file} cannot be read: {error}"
            ) from error
        raise TransientRemoteError(f"{target}: cannot connect: {_why_not(error)}") from error
    transport = client.get_transport()
    if transport is not None and isinstance(transport.sock, socket.socket):
        # Without it, a command's small packets wait out the peer's delayed ACK (Nagle):
        # measured on the lab, a `true` took 46 ms a round trip instead of 3.
        transport.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        transport.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, LINK_LOST_S * 1000)
    if transport is not None:
        transport.set_keepalive(KEEPALIVE_S)
    return client


def _why_not(error: OSError) -> str:
    """A failed connect in words: paramiko's NoValidConnectionsError keeps each address's
    error (refused, unreachable) inside, and its own text says neither."""
    if not isinstance(error, paramiko.ssh_exception.NoValidConnectionsError):
        return repr(error)
    causes = [
        f"{address[0]}:{address[1]}: {getattr(cause, 'strerror', None) or cause}"
        for address, cause in error.errors.items()
    ]
    refused = all(
        getattr(cause, "errno", None) == errno.ECONNREFUSED for cause in error.errors.values()
    )
    return "; ".join(causes) + (" (nothing listens there: is sshd running?)" if refused else "")
