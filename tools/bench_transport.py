"""Benchmark the shared-memory ring against multiprocessing.Queue and pyzmq.

Between two processes (spawn context): one-way throughput (msgs/s, MB/s, and
the CPU time both processes spend per message, every thread included) and
round-trip latency (p50/p99) for 64-byte and 1 MiB messages, printed side by
side with the ring's ratios, and the CPU an idle ring reader burns in ~1 s.

Fairness: every backend moves the same ``bytes`` object of the given size,
bounded to the same number of buffered messages (``max_buffered``: the
Queue's maxsize, zmq's high-water mark, the ring's capacity in records). The
ring is used as the actors use it: the sender ``send_nowait`` (``await send``
only when full), the reader ``recv_batch`` (the actor Mailbox's read, one
await per wakeup); the "ring recv()" column is the same ring read with one
``await recv()`` per message. The Queue and zmq run their fastest idiomatic
loops: blocking ``put``/``get`` and ``send``/``recv`` in a tight synchronous
loop (a ``recv(NOBLOCK)`` drain or ``recv(copy=False)`` was no faster for
zmq at 64 B; the Queue has no batch read). On a loaded machine msgs/s
measures each backend's share of the CPUs as much as its cost (zmq's I/O
threads compete as extra threads); CPU us/msg does not.

    python tools/bench_transport.py            # default run, under a minute
    python tools/bench_transport.py --quick    # a few seconds, for a smoke test
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
import uuid

import msgspec
import psutil
import zmq

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tools/ is not a package
from _common import progress, quiet_child, run_tool, write_output  # noqa: E402
from transport import ChannelClosed, ChannelFull, cleanup_run, create_ring, open_ring  # noqa: E402
from transport.ring import _footprint  # noqa: E402

SPAWN = multiprocessing.get_context("spawn")
SMALL, LARGE = 64, 1 << 20
BUFFERED_BYTES = 8 << 20  # at most this much payload in flight, for every backend


def max_buffered(size: int) -> int:
    """Messages of ``size`` bytes any backend may hold in flight."""
    return max(2, min(10_000, BUFFERED_BYTES // size))


def ring_bytes(size: int) -> int:
    """A ring that holds exactly ``max_buffered(size)`` records of ``size``
    bytes (msgpack bin header, record header, padding included)."""
    return max_buffered(size) * _footprint(len(msgspec.msgpack.encode(bytes(size))))


# -- ring ----------------------------------------------------------------------


class RingBackend:
    name = "shm ring"

    def __init__(self, run_dir: str, run_id: str):
        self.run_dir, self.run_id = run_dir, run_id
        self._num_rings = 0

    def make_pipe(self, size: int = SMALL):
        self._num_rings += 1
        return create_ring(self.run_dir, self.run_id, f"bench{type(self).__name__}{self._num_rings}", ring_bytes(size))

    @staticmethod
    def produce(spec, size: int, num: int, cpu_s) -> None:
        async def main():
            ring = open_ring(spec, "writer", bytes)
            payload = bytes(size)
            start = time.process_time()
            for _ in range(num):
                try:
                    ring.send_nowait(payload)
                except ChannelFull:
                    await ring.send(payload)
            ring.close()
            cpu_s.value = time.process_time() - start

        asyncio.run(main())

    @staticmethod
    def consume(spec, num: int) -> tuple[float, float]:
        """As the actors' Mailbox reads: one ``recv_batch`` per wakeup."""

        async def main():
            ring = open_ring(spec, "reader", bytes)
            left = num - len(await ring.recv_batch())  # the clock starts at the first batch
            start, start_cpu = time.perf_counter(), time.process_time()
            while left > 0:
                left -= len(await ring.recv_batch())
            elapsed, cpu_s = time.perf_counter() - start, time.process_time() - start_cpu
            ring.close()
            return elapsed, cpu_s

        return asyncio.run(main())

    @staticmethod
    def echo(ping, pong) -> None:
        async def main():
            inbox, outbox = open_ring(ping, "reader", bytes), open_ring(pong, "writer", bytes)
            try:
                while True:
                    for msg in await inbox.recv_batch():
                        await outbox.send(msg)
            except ChannelClosed:
                outbox.close()

        asyncio.run(main())

    @staticmethod
    def ping(ping, pong, size: int, num: int) -> list[float]:
        async def main():
            outbox, inbox = open_ring(ping, "writer", bytes), open_ring(pong, "reader", bytes)
            payload, times = bytes(size), []
            for _ in range(num):
                start = time.perf_counter()
                await outbox.send(payload)
                await inbox.recv()
                times.append(time.perf_counter() - start)
            outbox.close()
            return times

        return asyncio.run(main())

    @staticmethod
    def idle_reader(spec, ready) -> None:
        async def main():
            ring = open_ring(spec, "reader", bytes)
            ready.send("parked")
            await ring.recv()

        asyncio.run(main())


class RingRecvBackend(RingBackend):
    """The same ring read one ``await recv()`` per message (kept so the cost
    of the per-message coroutine stays visible next to the batch reader)."""

    name = "ring recv()"

    @staticmethod
    def consume(spec, num: int) -> tuple[float, float]:
        async def main():
            ring = open_ring(spec, "reader", bytes)
            await ring.recv()  # the clock starts at the first message, not at spawn
            start, start_cpu = time.perf_counter(), time.process_time()
            for _ in range(num - 1):
                await ring.recv()
            elapsed, cpu_s = time.perf_counter() - start, time.process_time() - start_cpu
            ring.close()
            return elapsed, cpu_s

        return asyncio.run(main())

    @staticmethod
    def echo(ping, pong) -> None:
        async def main():
            inbox, outbox = open_ring(ping, "reader", bytes), open_ring(pong, "writer", bytes)
            async for msg in inbox:
                await outbox.send(msg)
            outbox.close()

        asyncio.run(main())


# -- multiprocessing.Queue -------------------------------------------------------


class QueueBackend:
    name = "mp.Queue"

    def make_pipe(self, size: int = SMALL):
        return SPAWN.Queue(max_buffered(size))

    @staticmethod
    def produce(queue, size: int, num: int, cpu_s) -> None:
        payload = bytes(size)
        start = time.process_time()
        for _ in range(num):
            queue.put(payload)
        queue.close()
        queue.join_thread()  # the feeder thread has written everything
        cpu_s.value = time.process_time() - start

    @staticmethod
    def consume(queue, num: int) -> tuple[float, float]:
        queue.get()
        start, start_cpu = time.perf_counter(), time.process_time()
        for _ in range(num - 1):
            queue.get()
        return time.perf_counter() - start, time.process_time() - start_cpu

    @staticmethod
    def echo(ping, pong) -> None:
        while (msg := ping.get()) is not None:
            pong.put(msg)

    @staticmethod
    def ping(ping, pong, size: int, num: int) -> list[float]:
        payload, times = bytes(size), []
        for _ in range(num):
            start = time.perf_counter()
            ping.put(payload)
            pong.get()
            times.append(time.perf_counter() - start)
        ping.put(None)
        return times


# -- pyzmq ipc:// ----------------------------------------------------------------


class ZmqBackend:
    name = "zmq ipc"

    def __init__(self, run_dir: str):
        self.run_dir = run_dir
        self._num_pipes = 0

    def make_pipe(self, size: int = SMALL):
        self._num_pipes += 1
        return (f"ipc://{self.run_dir}/zmq{self._num_pipes}", max_buffered(size))

    @staticmethod
    def _socket(pipe, kind):
        address, hwm = pipe
        sock = zmq.Context.instance().socket(kind)
        sock.setsockopt(zmq.SNDHWM if kind == zmq.PUSH else zmq.RCVHWM, hwm)
        sock.setsockopt(zmq.LINGER, 5000)
        (sock.bind if kind == zmq.PULL else sock.connect)(address)
        return sock

    @staticmethod
    def produce(pipe, size: int, num: int, cpu_s) -> None:
        sock, payload = ZmqBackend._socket(pipe, zmq.PUSH), bytes(size)
        start = time.process_time()
        for _ in range(num):
            sock.send(payload)
        sock.close()  # lingers until the I/O thread has sent everything
        zmq.Context.instance().term()
        cpu_s.value = time.process_time() - start

    @staticmethod
    def consume(pipe, num: int) -> tuple[float, float]:
        sock = ZmqBackend._socket(pipe, zmq.PULL)
        sock.recv()
        start, start_cpu = time.perf_counter(), time.process_time()
        for _ in range(num - 1):
            sock.recv()
        elapsed, cpu_s = time.perf_counter() - start, time.process_time() - start_cpu
        sock.close()
        return elapsed, cpu_s

    @staticmethod
    def echo(ping, pong) -> None:
        inbox, outbox = ZmqBackend._socket(ping, zmq.PULL), ZmqBackend._socket(pong, zmq.PUSH)
        while (msg := inbox.recv()) != b"stop":
            outbox.send(msg)

    @staticmethod
    def ping(ping, pong, size: int, num: int) -> list[float]:
        outbox, inbox = ZmqBackend._socket(ping, zmq.PUSH), ZmqBackend._socket(pong, zmq.PULL)
        payload, times = bytes(size), []
        for _ in range(num):
            start = time.perf_counter()
            outbox.send(payload)
            inbox.recv()
            times.append(time.perf_counter() - start)
        outbox.send(b"stop")
        return times


# -- measurements ------------------------------------------------------------------


def make_pipe(backend, size: int):
    return backend.make_pipe(size)


def throughput(backend, size: int, num: int) -> tuple[float, float, float]:
    """(msgs/s, MB/s, CPU us/msg of both processes) from a producer process
    to this one. The consumer's CPU is counted from its first message."""
    pipe = make_pipe(backend, size)
    producer_cpu_s = SPAWN.Value(ctypes.c_double, 0.0, lock=False)
    proc = SPAWN.Process(target=quiet_child, args=(backend.produce, pipe, size, num, producer_cpu_s), daemon=True)
    proc.start()
    elapsed, consumer_cpu_s = backend.consume(pipe, num)
    proc.join()
    rate = (num - 1) / elapsed
    cpu_us = (producer_cpu_s.value + consumer_cpu_s) / num * 1e6
    return rate, rate * size / 1e6, cpu_us


def round_trip(backend, size: int, num: int) -> tuple[float, float]:
    """(p50, p99) round-trip microseconds to an echo process."""
    ping, pong = make_pipe(backend, size), make_pipe(backend, size)
    proc = SPAWN.Process(target=quiet_child, args=(backend.echo, ping, pong), daemon=True)
    proc.start()
    times = sorted(backend.ping(ping, pong, size, num)[num // 10 :])  # drop the warm-up tenth
    proc.join()
    return times[len(times) // 2] * 1e6, times[int(len(times) * 0.99)] * 1e6


def idle_reader_cpu(backend: RingBackend, window_s: float = 1.0) -> float:
    """CPU seconds a reader parked on an empty ring uses in ``window_s``."""
    spec = backend.make_pipe()
    ready, child_end = SPAWN.Pipe()
    proc = SPAWN.Process(target=quiet_child, args=(RingBackend.idle_reader, spec, child_end), daemon=True)
    proc.start()
    ready.recv()
    ready.poll(0.05)  # let it finish its brief spin and park
    watched = psutil.Process(proc.pid)
    before = watched.cpu_times()
    time.sleep(window_s)  # the measurement window itself, not a poll
    after = watched.cpu_times()

    async def wake():
        writer = open_ring(spec, "writer", bytes)
        await writer.send(b"bye")
        writer.close()

    asyncio.run(wake())
    proc.join()
    return (after.user - before.user) + (after.system - before.system)


# -- report ------------------------------------------------------------------------


def run_all(scale: float) -> tuple[dict, float]:
    run_dir = tempfile.mkdtemp(prefix="mstar-bench-")
    run_id = uuid.uuid4().hex[:12]
    backends = [RingBackend(run_dir, run_id), RingRecvBackend(run_dir, run_id), QueueBackend(), ZmqBackend(run_dir)]
    plan = [
        ("64 B", SMALL, int(300_000 * scale), int(20_000 * scale)),
        ("1 MiB", LARGE, int(2_000 * scale), int(400 * scale)),
    ]
    rows: dict[str, list[float]] = {}
    try:
        for label, size, num_tp, num_rt in plan:
            for index, backend in enumerate(backends):
                progress(f"{backend.name}: {label} throughput ({num_tp} msgs)")
                msgs, mbytes, cpu_us = throughput(backend, size, num_tp)
                progress(f"{backend.name}: {label} round trips ({num_rt})")
                p50, p99 = round_trip(backend, size, num_rt)
                for key, value in [
                    (f"{label} msgs/s", msgs),
                    (f"{label} MB/s", mbytes),
                    (f"{label} CPU us/msg", cpu_us),
                    (f"{label} round trip p50 us", p50),
                    (f"{label} round trip p99 us", p99),
                ]:
                    rows.setdefault(key, [0.0] * len(backends))[index] = value
        progress("idle ring reader CPU over 1 s")
        idle = idle_reader_cpu(backends[0])
    finally:
        cleanup_run(run_id, run_dir)
        shutil.rmtree(run_dir, ignore_errors=True)  # the rings' and zmq's files
    return rows, idle


def format_table(rows: dict, idle_cpu_s: float) -> str:
    names = ["ring batch", "ring recv()", "mp.Queue", "zmq ipc", "batch/Queue", "batch/zmq", "recv()/zmq"]
    header = f"| {'metric':<26} | " + " | ".join(f"{n:>11}" for n in names) + " |"
    lines = [header, "|" + "|".join("-" * len(cell) for cell in header.split("|")[1:-1]) + "|"]
    for key, (ring, ring_recv, queue, zmq_) in rows.items():
        lower_is_better = "us" in key

        def ratio(ours, other):
            return other / ours if lower_is_better else ours / other

        values = [f"{v:>11.4g}" for v in (ring, ring_recv, queue, zmq_)]
        ratios = [f"{r:>10.2f}x" for r in (ratio(ring, queue), ratio(ring, zmq_), ratio(ring_recv, zmq_))]
        lines.append(f"| {key:<26} | " + " | ".join(values + ratios) + " |")
    lines.append(f"\nidle ring reader: {idle_cpu_s * 1e3:.2f} ms CPU in 1 s ({idle_cpu_s * 100:.2f}% of a core)")
    lines.append("ratios: how many times better the ring is (throughput: ring/other; latency: other/ring)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tenth of the messages (smoke test)")
    parser.add_argument("--output", default=None, help="write the table to this file too")
    args = parser.parse_args()
    print(f"machine: {os.cpu_count()} CPUs, python {sys.version.split()[0]}, pid {os.getpid()}", file=sys.stderr)
    rows, idle = run_all(0.1 if args.quick else 1.0)
    table = format_table(rows, idle)
    print(table)
    write_output(table, args.output)


if __name__ == "__main__":
    run_tool(main)
