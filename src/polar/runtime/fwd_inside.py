"""The first process inside a sandbox's namespaces: loopback, the gateway forward, capabilities, init.

    python -I -S fwd_inside.py [--lo] [--forward HOST PORT SOCK] [--setpriv PATH] [--status-fd N]
        [--user UID GID] [--chdir DIR] -- ARGV

`--lo` brings the loopback interface up: a network namespace made by `unshare --net` starts with `lo` DOWN
(bwrap brings it up itself), so nothing could even listen on 127.0.0.1. `--forward` listens on HOST:PORT
(the sandbox's own loopback) before the command starts (no race) and splices each connection to the unix
socket SOCK that the node's bridge serves: a pathname socket crosses network namespaces because it is
found through the file system. `--setpriv` runs the command through util-linux `setpriv` with every
capability dropped except docker's default set (`KEEP_CAPS`): as root, CAP_SYS_ADMIN would let the command
unmount the private /proc or `setns` back into the host's network namespace. `--status-fd` reports on
that descriptor the signal that killed the command, because as PID 1 of a namespace this process cannot
die by a signal of its own to pass it on (the kernel ignores an init's default-action signals). As that
PID 1 it also reaps orphans and forwards SIGTERM to the command; when it exits, the kernel kills whatever
is left in the namespace. `--user` (bwrap started by a root node) becomes the sandbox's unprivileged uid
once the listener is bound, for good (no supplementary groups, no capabilities, `no_new_privs`: no setuid
binary gives them back), and only then enters `--chdir`: the session directory is that uid's, mode 0700,
which root without CAP_DAC_OVERRIDE may not enter. The forward is then served by a child that stays uid 0
without capabilities, so the bridge socket stays out of the agent's reach. Standard library only, so it runs under `-I -S` in any
Python.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import signal
import socket
import struct
import subprocess
import sys
import threading

# Docker's default capability set: what a root command keeps (file ownership, setuid, binding low ports).
KEEP_CAPS = (
    "chown,dac_override,fowner,fsetid,kill,setgid,setuid,setpcap,setfcap,"
    "net_bind_service,net_raw,sys_chroot,mknod,audit_write"
)
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1
_IFREQ = "16sH22x"  # struct ifreq: the name, then ifr_flags in the union (40 bytes on 64-bit)


def loopback_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        flags = struct.unpack(_IFREQ, fcntl.ioctl(s, _SIOCGIFFLAGS, struct.pack(_IFREQ, b"lo", 0)))[1]
        fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack(_IFREQ, b"lo", flags | _IFF_UP))


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


_PR_SET_PDEATHSIG, _PR_SET_NO_NEW_PRIVS, _PR_CAPBSET_DROP, _CAP_LAST = 1, 38, 24, 63
_LINUX_CAPABILITY_VERSION_3 = 0x20080522


def _prctl(option: int, arg: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, arg, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl({option})")


def _drop_bounding_set() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in range(_CAP_LAST + 1):  # needs CAP_SETPCAP (bwrap keeps it for this); unknown caps fail
        libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0)


def become(uid: int, gid: int) -> None:
    """Drop to `uid`/`gid` for good: every capability, the bounding set, supplementary groups."""
    _drop_bounding_set()
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)  # from root to a non-zero uid: permitted and effective sets are cleared
    _prctl(_PR_SET_NO_NEW_PRIVS, 1)


def drop_capabilities() -> None:
    """Stay uid 0 with no capability at all: enough to use root's own 0700 folder (the bridge's), nothing
    more; and no way to regain any."""
    _drop_bounding_set()
    libc = ctypes.CDLL(None, use_errno=True)
    header = (ctypes.c_uint32 * 2)(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable: empty (two 32-bit words each)
    if libc.capset(header, data) != 0:
        raise OSError(ctypes.get_errno(), "capset")
    _prctl(_PR_SET_NO_NEW_PRIVS, 1)


def forwarder_process(listener: socket.socket, unix_path: str) -> None:
    """Serve `listener` from a child process that keeps uid 0 (without capabilities) while this one drops
    to the sandbox uid: the bridge's socket stays in root's 0700 folder, which the agent cannot open, so
    its only way to the gateway is this listener. The agent cannot signal or trace a process of another
    uid; the child dies with us (PDEATHSIG) and with the sandbox's PID namespace."""
    if os.fork() != 0:
        listener.close()
        return
    try:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        drop_capabilities()
        _serve(listener, unix_path)
    finally:
        os._exit(0)


def _found(name: str) -> bool:
    if "/" in name:
        return os.path.exists(name)
    dirs = os.environ.get("PATH", os.defpath).split(os.pathsep)
    return any(os.access(os.path.join(d or ".", name), os.X_OK) for d in dirs)


def _wait(child: subprocess.Popen[bytes]) -> int:
    """The command's wait status; as PID 1, orphans reparented to us are reaped on the way."""
    if os.getpid() != 1:
        return child.wait()
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            return child.wait()
        if pid == child.pid:
            return os.waitstatus_to_exitcode(status)


def _options(args: list[str]) -> tuple[dict[str, list[str]], list[str]] | None:
    """(options, argv) from `[--lo] [--forward H P S] [--setpriv PATH] [--status-fd N] -- ARGV`."""
    arity = {"--lo": 0, "--forward": 3, "--setpriv": 1, "--status-fd": 1, "--user": 2, "--chdir": 1}
    options: dict[str, list[str]] = {}
    while args and args[0] in arity and len(args) > arity[args[0]]:
        n = arity[args[0]]
        options[args[0]], args = args[1 : 1 + n], args[1 + n :]
    if len(args) < 2 or args[0] != "--":
        return None
    return options, args[1:]


def main(args: list[str]) -> int:
    parsed = _options(args)
    if parsed is None:
        print("usage: fwd_inside.py [--lo] [--forward HOST PORT SOCK] [--setpriv PATH] "
              "[--status-fd N] [--user UID GID] [--chdir DIR] -- ARGV...", file=sys.stderr)  # fmt: skip
        return 2
    options, argv = parsed
    forward, setpriv = options.get("--forward"), options.get("--setpriv")
    status_fd = int(options["--status-fd"][0]) if "--status-fd" in options else None
    if "--lo" in options:
        loopback_up()
    if forward is not None:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((forward[0], int(forward[1])))
        listener.listen(128)
    if "--user" in options:
        if forward is not None:
            forwarder_process(listener, forward[2])
        uid, gid = (int(v) for v in options["--user"])
        become(uid, gid)
    elif forward is not None:
        threading.Thread(target=_serve, args=(listener, forward[2]), daemon=True).start()
    if "--chdir" in options:
        try:
            os.chdir(options["--chdir"][0])
        except OSError as exc:
            print(f"polar: cannot enter {options['--chdir'][0]}: {exc.strerror}", file=sys.stderr)
            return 126
    if not _found(argv[0]):
        print(f"polar: command not found: {argv[0]}", file=sys.stderr)
        return 127
    if setpriv is not None:
        keep = ",".join(f"+{cap}" for cap in KEEP_CAPS.split(","))
        argv = [
            setpriv[0],
            "--inh-caps=-all",
            "--ambient-caps=-all",
            f"--bounding-set=-all,{keep}",
            "--",
            *argv,
        ]
    started: list[subprocess.Popen[bytes]] = []

    # A SIGTERM to us (the runtime's kill reaches the whole process group) goes to the command too; set
    # before the command starts, since an init without a handler would drop it
    def forward_term(*_: object) -> None:
        for child in started:
            child.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, forward_term)
    try:
        started.append(subprocess.Popen(argv))
    except OSError as exc:
        print(f"polar: cannot execute {argv[0]}: {exc.strerror}", file=sys.stderr)
        return 127 if isinstance(exc, FileNotFoundError) else 126
    code = _wait(started[0])
    if code < 0 and status_fd is not None:
        try:
            os.write(status_fd, str(-code).encode())
        except OSError:
            pass
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    os._exit(main(sys.argv[1:]))  # daemon threads may sit in accept(); do not wait for them
