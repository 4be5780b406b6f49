"""Helpers shared by the tests (fixtures are in ``conftest.py``): paths, a runner for real gloo
processes, a DataLoader-worker simulator, sample payloads and the handler tests' model and data.

    from tests.support import run_distributed

    def check_sum(rank, world_size, scale):      # module level: the processes import it by name
        t = torch.tensor([rank * scale]); dist.all_reduce(t); return t.item()

    assert run_distributed(check_sum, 3, 2.0) == [6.0, 6.0, 6.0]

``run_distributed``: each process gets torchrun's variables (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` on a free port) and no ``SLURM_*`` ones, so code
that reads the launch environment behaves as under ``torchrun``. With ``init_group=True``
(default) a gloo group is ready when the function starts; with ``False`` the function
initialises it itself.

``run_forked(fn, arg_tuples)`` runs ``fn(*args)`` in one forked process per tuple (no group, no
spawn: the children start at once and inherit what the test built); results in order.

``S3Proxy(upstream)`` forwards HTTP to an S3 endpoint (moto) from a thread and counts the GETs
and body bytes per object, so a test sees how often each shard was fetched; it can also be slow
(latency per request, a bandwidth cap) for benchmarks.

``picture(width, height, seed)`` is a smooth RGB picture with edges and grain (uint8, (H, W, 3))
and ``encoded(pixels, format, **options)`` its bytes in an image format, for the decoder tests.

``simulated(ds, workers, monkeypatch)`` is what ``DataLoader(ds, num_workers=workers)`` yields
(workers one after the other instead of interleaved): the dataset discovers its worker through
:func:`nnh_data.topology.worker_info`, which the ``WORKER``/``NUM_WORKERS`` environment
variables override. Fast enough for large test grids; a few tests run real workers and check
they agree.
"""

from __future__ import annotations

import http.client
import io
import multiprocessing
import os
import pickle
import queue
import socket
import struct
import sys
import tarfile
import tempfile
import threading
import time
import traceback
import urllib.parse
from collections import Counter
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from PIL import Image
from torch import nn
from torch.utils.data import TensorDataset

from nnh_train.ddp_init import _destroy_at_exit as destroy_group

__all__ = [
    "DATA",
    "ROOT",
    "SCRIPTS",
    "DistributedRunError",
    "Fault",
    "Net",
    "S3Proxy",
    "Unrebuildable",
    "data",
    "encoded",
    "free_port",
    "numbered_samples",
    "picture",
    "processes_mentioning",
    "run_distributed",
    "run_forked",
    "sample_bytes",
    "simulated",
    "write_tar",
]

ROOT = Path(__file__).resolve().parents[1]  # the repository
SCRIPTS = ROOT / "tests" / "scripts"  # programs the tests start as processes
DATA = ROOT / "tests" / "data"  # files the tests compare against


class DistributedRunError(AssertionError):
    """A rank raised or died (its rank and traceback are in the message), or the ranks hung."""


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def processes_mentioning(text: str, timeout: float = 30.0) -> list[str]:
    """The command lines of the processes whose command line contains ``text`` (a test's own
    folder), once none is left or after ``timeout`` seconds (read from /proc: forked DataLoader
    workers show their rank's command line)."""
    deadline = time.monotonic() + timeout
    while True:
        found = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and int(entry.name) != os.getpid():
                try:
                    line = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                except OSError:  # ended meanwhile
                    continue
                found += [f"{entry.name}: {line}"] if text in line else []
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 60.0,
    init_group: bool = True,
    env: Mapping[str, str] | None = None,
) -> list[Any]:
    """``fn(rank, world_size, *args)`` on ``world_size`` spawned processes; results by rank.

    Args:
        timeout: seconds for the whole run; the group's collective timeout is half of it, so a
            stuck collective fails inside its rank (with a named error) before the run is killed.
        init_group: start a gloo group (env://) before calling ``fn``.
        env: extra environment variables for every process.

    Raises:
        DistributedRunError: a rank raised or died, or some ranks were still running at timeout.
    """
    setup = (fn, world_size, args, free_port(), init_group, timeout / 2, dict(env or {}))
    with tempfile.TemporaryDirectory(prefix="nnh-dist-") as folder:
        context = mp.start_processes(
            _rank_main, args=(*setup, folder), nprocs=world_size, join=False, start_method="spawn"
        )
        try:
            _join(context, timeout)
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
        return [_load(folder, rank) for rank in range(world_size)]


def _join(context: mp.ProcessContext, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    try:
        while not context.join(timeout=max(0.0, deadline - time.monotonic()), grace_period=5):
            if time.monotonic() >= deadline:
                alive = [r for r, p in enumerate(context.processes) if p.is_alive()]
                raise DistributedRunError(f"ranks {alive} still running after {timeout} s (hang?)")
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as exc:
        raise DistributedRunError(f"rank {exc.error_index} failed: {exc}") from None


def _rank_main(
    rank: int, fn: Callable[..., Any], world_size: int, args: tuple[Any, ...], port: int,
    init_group: bool, group_timeout: float, env: dict[str, str], folder: str,
) -> None:
    for name in [n for n in os.environ if n.startswith(("SLURM_", "TORCHELASTIC_"))]:
        del os.environ[name]
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
    )
    os.environ.update(env)
    if init_group:
        dist.init_process_group("gloo", timeout=timedelta(seconds=group_timeout))
    try:
        result = fn(rank, world_size, *args)
    finally:
        destroy_group()  # and wait for gloo's threads, as ddp_init does at exit
    with open(os.path.join(folder, f"{rank}.pkl"), "wb") as fh:
        pickle.dump(result, fh)


def _load(folder: str, rank: int) -> Any:
    path = os.path.join(folder, f"{rank}.pkl")
    if not os.path.exists(path):
        raise DistributedRunError(f"rank {rank} exited without a result (os._exit or sys.exit?)")
    with open(path, "rb") as fh:
        return pickle.load(fh)


def run_forked(
    fn: Callable[..., Any], arg_tuples: list[tuple], timeout: float = 90.0
) -> list[Any]:
    """``fn(*args)`` in one forked process per item of ``arg_tuples``; results in order.

    Raises:
        DistributedRunError: a process raised (its number and traceback are in the message)
            or was still running after ``timeout`` seconds.
    """
    fork = multiprocessing.get_context("fork")
    results = fork.Queue()
    processes = [fork.Process(target=_forked_main, args=(fn, i, args, results))
                 for i, args in enumerate(arg_tuples)]  # fmt: skip
    for process in processes:
        process.start()
    out: dict[int, Any] = {}
    try:
        deadline = time.monotonic() + timeout
        while len(out) < len(processes):
            try:
                number, value, error = results.get(timeout=0.5)
            except queue.Empty:
                _check_running(processes, out, time.monotonic() > deadline, timeout)
                continue
            if error is not None:
                raise DistributedRunError(f"process {number} failed:\n{error}")
            out[number] = value
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
            process.join()
    return [out[i] for i in range(len(processes))]


def _check_running(processes: list, done: dict, late: bool, timeout: float) -> None:
    waiting = [i for i in range(len(processes)) if i not in done]
    dead = {i: processes[i].exitcode for i in waiting if processes[i].exitcode not in (None, 0)}
    if dead:
        raise DistributedRunError(f"processes died without a result (exit codes {dead})")
    if late:
        raise DistributedRunError(f"processes {waiting} still running after {timeout} s (hang?)")


def _forked_main(fn: Callable[..., Any], number: int, args: tuple, results) -> None:
    try:
        results.put((number, fn(*args), None))
    except BaseException:  # reported to the test, which names the process
        results.put((number, None, traceback.format_exc()))


def simulated(ds, workers: int, monkeypatch) -> list:
    """Items of ``ds`` as ``workers`` DataLoader workers (0: the main process) yield them."""
    if workers == 0:
        return list(ds)
    out = []
    for k in range(workers):
        with monkeypatch.context() as patch:
            patch.setenv("WORKER", str(k))
            patch.setenv("NUM_WORKERS", str(workers))
            out += list(ds)
    return out


def sample_bytes(g: int, size: int) -> bytes:
    """The deterministic ``bin`` payload of sample ``g``."""
    return (g.to_bytes(8, "little") * (size // 8 + 1))[:size]


def write_tar(path: Path, samples: list[dict], *, pax: bool) -> None:
    """Write samples as tar members ``key.field`` (fields sorted, like webdataset)."""
    form = tarfile.PAX_FORMAT if pax else tarfile.USTAR_FORMAT
    with tarfile.open(path, "w", format=form) as tar:
        for sample in samples:
            for field in sorted(k for k in sample if k != "__key__"):
                info = tarfile.TarInfo(f"{sample['__key__']}.{field}")
                info.size = len(sample[field])
                info.mtime = time.time() if pax else 0
                tar.addfile(info, io.BytesIO(sample[field]))


def picture(width: int, height: int, seed: int = 0) -> np.ndarray:
    """A (height, width, 3) uint8 picture: colour gradients, a few discs and fine grain."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width] / max(width, height)
    base = np.stack([np.sin(6 * x + c) * np.cos(5 * y - c) for c in (0.0, 1.0, 2.0)], -1)
    pixels = 128 + 90 * base
    for cx, cy, r, c in rng.uniform(0, 1, (6, 4)):
        disc = (x - cx) ** 2 + (y - cy) ** 2 < (0.2 * r) ** 2
        pixels[disc] = 255 * rng.uniform(0, 1, 3) * c
    pixels += rng.normal(0, 3, (height, width, 1))
    return np.clip(pixels, 0, 255).astype(np.uint8)


def encoded(pixels: np.ndarray, format: str = "JPEG", mode: str = "RGB", **options: Any) -> bytes:
    """``pixels`` in ``mode`` (RGB, L, CMYK, RGBA, P) encoded as ``format`` (quality 90 JPEG)."""
    if format == "JPEG":
        options.setdefault("quality", 90)
    out = io.BytesIO()
    Image.fromarray(pixels).convert(mode).save(out, format, **options)
    return out.getvalue()


def numbered_samples(first: int, count: int, size: int) -> list[dict]:
    """Samples ``first`` to ``first + count - 1`` as the fixtures number them."""
    return [
        {"__key__": f"{g:08d}", "cls": str(g).encode(), "bin": sample_bytes(g, size)}
        for g in range(first, first + count)
    ]


class Unrebuildable(Exception):
    """Pickles, but does not unpickle (its __init__ wants two arguments): an error that cannot
    cross to another process as itself."""

    def __init__(self, a: int, b: int) -> None:
        super().__init__(f"unrebuildable {a}/{b}")


class Net(nn.Module):
    """A 2-layer MLP with dropout, so that an exact resume also needs the generator states."""

    def __init__(self, hidden: int = 8, dropout: float = 0.2) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(4, hidden), nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, 1)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def data(n: int, seed: int = 0) -> TensorDataset:
    """``n`` samples of 4 features and a noisy sum of them as the target."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=generator)
    return TensorDataset(x, x.sum(1, keepdim=True) + 0.1 * torch.randn(n, 1, generator=generator))


_HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-connection", "te", "trailer",
                         "transfer-encoding", "upgrade", "expect", "content-length"})  # fmt: skip
_CHUNK = 64 << 10
_ERROR_BODY = ('<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
               "<Message>injected by the test proxy</Message><RequestId>nnh-fault</RequestId>"
               "</Error>")  # fmt: skip


@dataclass(frozen=True)
class Fault:
    """What :class:`S3Proxy` does to a request instead of forwarding it plainly; build one with
    the class methods. ``after``: body bytes relayed before the reset, truncation or stall."""

    kind: str  # "error", "reset", "truncate" or "stall"
    status: int = 0
    code: str = ""
    after: int = 0
    seconds: float = 0.0

    @classmethod
    def error(cls, status: int = 500, code: str = "InternalError") -> Fault:
        """An S3 error response (not forwarded): 500 InternalError by default."""
        return cls("error", status=status, code=code)

    @classmethod
    def slow_down(cls) -> Fault:
        """S3's throttling answer: 503 SlowDown."""
        return cls.error(503, "SlowDown")

    @classmethod
    def reset(cls, after: int = 0) -> Fault:
        """The connection reset (RST) after ``after`` body bytes."""
        return cls("reset", after=after)

    @classmethod
    def truncate(cls, after: int = 0) -> Fault:
        """The connection closed cleanly after ``after`` body bytes, short of Content-Length."""
        return cls("truncate", after=after)

    @classmethod
    def stall(cls, seconds: float, after: int = 0) -> Fault:
        """No byte for ``seconds`` after ``after`` body bytes, then the rest."""
        return cls("stall", after=after, seconds=seconds)


@dataclass
class _Rule:
    fault: Fault
    path: str
    method: str | None
    requests: frozenset[int] | None
    until: float = float("inf")  # time.monotonic() after which the rule no longer applies
    seen: int = 0

    def applies(self, method: str, path: str) -> bool:
        """Count a matching request; True when this one is among ``requests`` (and in time)."""
        if self.path not in path or self.method not in (None, method):
            return False
        self.seen += 1
        in_time = time.monotonic() < self.until
        return in_time and (self.requests is None or self.seen in self.requests)


class _QuietServer(ThreadingHTTPServer):
    """A client that hangs up mid-request (the faults do it on purpose) is not an error."""

    def handle_error(self, request, client_address) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class S3Proxy:
    """Forwards every request to ``upstream`` (an S3 endpoint such as moto on loopback) from a
    thread of this process; counts GET requests and body bytes sent per object path, and can
    add ``latency_s`` per request and cap the bandwidth at ``bytes_per_s`` (a slow object store
    for benchmarks). A context manager; ``close()`` stops it.

    The cap is shared by all connections (one link to the store). Counters are keyed by the
    URL path without its query ("/bucket/key"); forked processes that talk to ``endpoint`` are
    counted here, in the process that made the proxy.

        with S3Proxy(moto_s3.endpoint) as proxy:
            fs = s3fs.S3FileSystem(**proxy.storage_options)
            fs.cat_file("bucket/key")
            assert proxy.gets["/bucket/key"] == 1

    Faults are injected by request count, so a test is deterministic: :meth:`inject` a
    :class:`Fault` for the ``requests``-th (1-based) requests whose path contains ``path``;
    ``log`` lists every request as ``(method, path, fault kind or "ok")``::

        proxy.inject(Fault.slow_down(), path="shard-000001", requests=[1, 2, 3])
        proxy.inject(Fault.error(500), path="shard-000004")  # every GET of it: always fails
        proxy.inject(Fault.slow_down(), seconds=12)  # every GET for 12 s: a burst
    """

    def __init__(
        self, upstream: str, *, latency_s: float = 0.0, bytes_per_s: float | None = None
    ) -> None:
        if bytes_per_s is not None and bytes_per_s <= 0:
            raise ValueError(f"bytes_per_s must be positive or None, but given {bytes_per_s}")
        parts = urllib.parse.urlsplit(upstream)
        self.upstream = (parts.hostname, parts.port or 80)
        self.latency_s, self.bytes_per_s = latency_s, bytes_per_s
        self.gets: Counter[str] = Counter()
        self.get_bytes: Counter[str] = Counter()
        self.log: list[tuple[str, str, str]] = []
        self._rules: list[_Rule] = []
        self._lock = threading.Lock()
        self._closing = threading.Event()  # ends stalls
        self._free_at = 0.0  # when the capped link is free again
        self._server = _QuietServer(("127.0.0.1", 0), _proxy_handler(self))
        self._server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def storage_options(self) -> dict:
        return {"key": "test", "secret": "test", "client_kwargs": {"endpoint_url": self.endpoint}}

    def inject(
        self,
        fault: Fault,
        *,
        path: str = "",
        requests: Collection[int] | None = None,
        method: str | None = "GET",
        seconds: float | None = None,
    ) -> None:
        """Apply ``fault`` to the ``requests``-th requests (1-based; None: every one) of
        ``method`` (None: any) whose path contains ``path``, counted from now, and for
        ``seconds`` from now (None: for ever; a burst of throttling, say). A request takes
        the fault of the first rule that applies; every matching rule counts it."""
        numbers = None if requests is None else frozenset(requests)
        until = float("inf") if seconds is None else time.monotonic() + seconds
        with self._lock:
            self._rules.append(_Rule(fault, path, method, numbers, until))

    def reset(self) -> None:
        """Zero the counters and the log, and drop the injected faults."""
        with self._lock:
            self.gets.clear()
            self.get_bytes.clear()
            self.log.clear()
            self._rules.clear()

    def close(self) -> None:
        self._closing.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def __enter__(self) -> S3Proxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _count(self, counter: Counter[str], path: str, n: int) -> None:
        with self._lock:
            counter[path] += n

    def _fault_for(self, method: str, path: str) -> Fault | None:
        """The fault of this request (counted by every rule it matches), logged."""
        with self._lock:
            faults = [rule.fault for rule in self._rules if rule.applies(method, path)]
            fault = faults[0] if faults else None
            self.log.append((method, path, fault.kind if fault else "ok"))
            if method == "GET":
                self.gets[path] += 1
        return fault

    def _throttle(self, n: int) -> None:
        """Wait until ``n`` more bytes fit under the cap (a schedule shared by all threads)."""
        if self.bytes_per_s is None:
            return
        with self._lock:
            start = max(time.monotonic(), self._free_at)
            self._free_at = start + n / self.bytes_per_s
            wait = self._free_at - time.monotonic()
        if wait > 0:
            time.sleep(wait)


def _proxy_handler(proxy: S3Proxy) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as clients expect of S3
        # Headers and body go out as separate writes: with Nagle's algorithm on, a response
        # would wait ~40 ms for the client's delayed ACK, more than any latency modelled.
        disable_nagle_algorithm = True

        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            self._forward()

        do_HEAD = do_PUT = do_POST = do_DELETE = do_GET

        def _forward(self) -> None:
            path = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path)
            fault = proxy._fault_for(self.command, path)
            body = self._request_body()
            if proxy.latency_s:
                time.sleep(proxy.latency_s)
            if fault is not None and fault.kind == "error":
                self._send_error(fault)
                return
            upstream = http.client.HTTPConnection(*proxy.upstream, timeout=60)
            try:
                upstream.putrequest(
                    self.command, self.path, skip_host=True, skip_accept_encoding=True
                )
                for name, value in self.headers.items():  # Host too: it is signed
                    if name.lower() not in _HOP_BY_HOP:
                        upstream.putheader(name, value)
                if body or self.command in ("PUT", "POST"):
                    upstream.putheader("Content-Length", str(len(body)))
                upstream.endheaders(body)
                self._relay(upstream.getresponse(), path, fault)
            finally:
                upstream.close()

        def _request_body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                chunks = []
                while size := int(self.rfile.readline().split(b";")[0], 16):
                    chunks.append(self.rfile.read(size))
                    self.rfile.readline()
                while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                    pass  # trailers
                return b"".join(chunks)
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def _send_error(self, fault: Fault) -> None:
            body = b"" if self.command == "HEAD" else _ERROR_BODY.format(code=fault.code).encode()
            self.send_response_only(fault.status)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _relay(self, response: http.client.HTTPResponse, path: str, fault: Fault | None):
            length = response.getheader("Content-Length")
            body = None
            if length is None and self.command != "HEAD":
                body = response.read()  # chunked or until close: send it with a length
                length = str(len(body))
            self.send_response_only(response.status, response.reason)
            for name, value in response.getheaders():
                if name.lower() not in _HOP_BY_HOP:
                    self.send_header(name, value)
            if length is not None:
                self.send_header("Content-Length", length)
            self.end_headers()
            if self.command == "HEAD":
                return
            counted = proxy.get_bytes if self.command == "GET" else None
            try:
                self._stream(response, body, counted, path, fault)
            except (BrokenPipeError, ConnectionResetError):
                self.close_connection = True  # the client stopped reading: fine

        def _stream(self, response, body, counted, path, fault: Fault | None) -> None:
            chunks = [body] if body is not None else iter(lambda: response.read(_CHUNK), b"")
            sent = 0
            for chunk in chunks:
                if fault is not None and sent + len(chunk) >= fault.after:
                    head = fault.after - sent
                    self._send(chunk[:head], counted, path)
                    sent += head
                    if self._break(fault):
                        return
                    chunk, fault = chunk[head:], None
                self._send(chunk, counted, path)
                sent += len(chunk)

        def _send(self, chunk: bytes, counted, path: str) -> None:
            """Counted before it is written: a client that has the bytes sees them counted
            (counted after, a loaded machine let the test read the counter first)."""
            proxy._throttle(len(chunk))
            if counted is not None:
                proxy._count(counted, path, len(chunk))
            try:
                self.wfile.write(chunk)
            except OSError:
                if counted is not None:
                    proxy._count(counted, path, -len(chunk))  # not sent after all
                raise

        def _break(self, fault: Fault) -> bool:
            """Apply a mid-body fault; True when the response ends here."""
            if fault.kind == "stall":
                proxy._closing.wait(fault.seconds)
                return False
            self.close_connection = True
            if fault.kind == "reset":  # RST instead of FIN: SO_LINGER on, zero seconds
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                           struct.pack("ii", 1, 0))  # fmt: skip
                self.connection.close()
            return True

    return Handler
