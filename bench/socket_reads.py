"""What one read of a socket costs at asyncio's read size and at polar's, side by side.

    .venv/bin/python bench/socket_reads.py                  # 2 kB, 7 kB and 60 kB messages, 5 rounds
    .venv/bin/python bench/socket_reads.py --sizes 7000 --rounds 9

asyncio's socket transport (CPython 3.11) reads with `sock.recv(256 KiB)`: CPython allocates a bytes object
of that size for every read and shrinks it to what arrived. polar's servers and its upstream client read at
most `polar.http_server.READ_SIZE` (64 KiB) instead (`small_reads`). This bench sends a message over a
socketpair and reads it back whole, N times, with each read size in turn (rounds interleaved), in a process
set up as the gateway's are (`polar.memory.fix_thresholds`: glibc's mmap threshold fixed at 128 KiB), and
prints microseconds per message, medians over rounds.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from polar import memory  # noqa: E402
from polar.http_server import READ_SIZE  # noqa: E402

ASYNCIO_READ = 256 * 1024  # asyncio.selector_events._SelectorSocketTransport.max_size


def per_message(size: int, read: int, n: int) -> float:
    """Microseconds to send a `size`-byte message and read it back whole with reads of at most `read`."""
    a, b = socket.socketpair()
    try:
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
        b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        data = b"x" * size
        t = time.perf_counter()
        for _ in range(n):
            a.sendall(data)
            got = 0
            while got < size:
                got += len(b.recv(read))
        return (time.perf_counter() - t) / n * 1e6
    finally:
        a.close()
        b.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[2000, 7000, 60000], help="message bytes")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--messages", type=int, default=10000, help="per round and side")
    args = ap.parse_args()
    configured = memory.fix_thresholds()
    print(f"glibc malloc configured as the gateway's: {configured}")
    reads = {"asyncio (256 KiB)": ASYNCIO_READ, f"polar ({READ_SIZE // 1024} KiB)": READ_SIZE}
    print("| message | read size | us per message | ratio |")
    print("|---:|---|---:|---:|")
    for size in args.sizes:
        got: dict[str, list[float]] = {name: [] for name in reads}
        for r in range(args.rounds):
            order = list(reads.items())
            if r % 2:
                order.reverse()
            for name, read in order:
                got[name].append(per_message(size, read, args.messages))
        base = statistics.median(got["asyncio (256 KiB)"])
        for name in reads:
            med = statistics.median(got[name])
            print(f"| {size:,} B | {name} | {med:.2f} | {med / base:.2f}x |")


if __name__ == "__main__":
    main()
