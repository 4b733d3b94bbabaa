"""A listening socket made inside another process's network namespace: the gateway in a container.

A container started with `--network none` has a loopback interface and nothing else: no route out, no DNS.
To give its harness the gateway (and only the gateway), the node opens a TCP listener on the container's
own 127.0.0.1 at the gateway's port, from the host side, and relays each connection to the gateway
(`bridge.GatewayBridge.serve_socket`). A socket belongs to the network namespace it was created in for its
whole life, so a short-lived thread enters the container's namespace (`setns` on `/proc/PID/ns/net`;
network namespaces are per thread), creates and binds the socket, and ends; the socket is then served from
the host's namespace like any other. The harness sees a plain `http://127.0.0.1:PORT`, and nothing runs
inside the image: SWE-bench images need no Python of ours.

Entering another network namespace needs CAP_SYS_ADMIN over it: a node that drives docker or rootful
podman is root already. Rootless podman puts the container in a user namespace the node does not own.
"""

from __future__ import annotations

import ctypes
import os
import socket
import threading

from polar.runtime.base import RuntimeFailure

_CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def listen_in_netns(pid: int, host: str, port: int, backlog: int = 128) -> socket.socket:
    """A TCP socket listening on host:port in the network namespace of process `pid`."""
    out: list[socket.socket | BaseException] = []

    def enter_and_listen() -> None:
        # This thread's namespace changes for good; the thread ends right after, and the socket stays.
        try:
            fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY)
            try:
                if _libc.setns(fd, _CLONE_NEWNET) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"setns into the network namespace of pid {pid}: {os.strerror(err)}")
            finally:
                os.close(fd)
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind((host, port))
                sock.listen(backlog)
                sock.setblocking(False)
            except BaseException:
                sock.close()
                raise
            out.append(sock)
        except BaseException as exc:  # handed to the caller's thread
            out.append(exc)

    thread = threading.Thread(target=enter_and_listen, name="polar-netns", daemon=True)
    thread.start()
    thread.join()
    result = out[0] if out else RuntimeFailure("the network-namespace thread ended without a result")
    if isinstance(result, BaseException):
        raise RuntimeFailure(
            f"cannot listen on {host}:{port} inside the container's network (pid {pid}): {result}"
        ) from result
    return result
