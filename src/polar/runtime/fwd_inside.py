"""Run a command with a TCP port on the sandbox's loopback forwarded to a unix socket.

Started by `BwrapRuntime` inside a fresh network namespace (`python -I -S fwd_inside.py HOST PORT SOCK --
ARGV...`), where loopback is the namespace's own and nothing else exists: the listener is bound before the
command starts (no race), each connection is spliced to the unix socket that the node's bridge serves
(a pathname socket crosses network namespaces because it is found through the file system), and the
command's exit status becomes ours. Standard library only, so it runs under `-I -S` in any Python.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(1 << 16):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for sock, how in ((dst, socket.SHUT_WR), (src, socket.SHUT_RD)):
            try:
                sock.shutdown(how)
            except OSError:
                pass


def _serve(listener: socket.socket, unix_path: str) -> None:
    while True:
        client, _ = listener.accept()
        upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            upstream.connect(unix_path)
        except OSError:
            client.close()
            upstream.close()
            continue
        for a, b in ((client, upstream), (upstream, client)):
            threading.Thread(target=_pipe, args=(a, b), daemon=True).start()


def main(args: list[str]) -> int:
    host, port, unix_path, sep, *argv = args
    if sep != "--" or not argv:
        print("usage: fwd_inside.py HOST PORT SOCKET -- ARGV...", file=sys.stderr)
        return 2
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, int(port)))
    listener.listen(128)
    threading.Thread(target=_serve, args=(listener, unix_path), daemon=True).start()
    try:
        child = subprocess.Popen(argv)
    except FileNotFoundError:
        print(f"polar: command not found: {argv[0]}", file=sys.stderr)
        return 127
    # A SIGTERM to us (bwrap's own process tree is killed from outside) goes to the command too
    signal.signal(signal.SIGTERM, lambda *_: child.send_signal(signal.SIGTERM))
    code = child.wait()
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    os._exit(main(sys.argv[1:]))  # daemon threads may sit in accept(); do not wait for them
