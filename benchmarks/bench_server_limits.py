"""What a refused oversized request costs the server: wall time to the answer and the server
process's resident memory (RSS) after each one.

Starts `deltaserve serve` (the embedded model on the CPU unless --model/--device say otherwise)
in a subprocess, waits for /health, then sends each bad request `--repeat` times and prints, per
kind: the status codes, the median and max seconds to the answer, the server's RSS growth
over the first answer (warm-up) and over all of them, read from /proc/PID/status (a server
that returns the memory of refused requests shows no growth after the first), and the longest
pause of another client's token stream while such requests keep coming (against the same
stream's longest pause alone). Linux only.

    .venv/bin/python benchmarks/bench_server_limits.py [--repeat 10] [-- serve flags...]

Kinds: an 8 MB completion prompt, an 8 MB chat message, 3 million stop_token_ids (6 MB of
JSON), a 60 MB body with a Content-Length, and a 60 MB chunked body (no Content-Length).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx


def rss_mb(pid: int) -> float:
    """The resident set size of process `pid` in MiB (VmRSS)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def chunks(data: bytes, size: int = 1 << 20) -> Iterator[bytes]:
    for start in range(0, len(data), size):
        yield data[start:start + size]


def bad_requests() -> dict[str, dict]:
    """kind -> httpx request arguments; bodies encoded here, so the timing is the server's."""
    eight_mb = "a" * (8 * 1024 * 1024)

    def post(url: str, body: dict | bytes, **more) -> dict:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        return {"url": url, "content": content,
                "headers": {"Content-Type": "application/json"}, **more}

    sixty_mb = {"prompt": "b" * (60 * 1024 * 1024)}
    stop_ids = b'{"prompt": "Hi", "max_tokens": 1, "stop_token_ids": [' + \
        b",".join([b"1"] * 3_000_000) + b"]}"
    return {
        "8MB prompt": post("/v1/completions", {"prompt": eight_mb, "max_tokens": 1}),
        "8MB chat message": post("/v1/chat/completions", {
            "messages": [{"role": "user", "content": eight_mb}], "max_tokens": 1}),
        "3M stop_token_ids": post("/v1/completions", stop_ids),
        "60MB body": post("/v1/completions", sixty_mb),
        "60MB chunked body": post("/v1/completions", sixty_mb, chunked=True),
    }


def measure(client: httpx.Client, pid: int, request: dict, repeat: int) -> dict:
    request = dict(request)
    chunked = request.pop("chunked", False)
    statuses, seconds, rss = [], [], [rss_mb(pid)]
    for _ in range(repeat):
        args = dict(request)
        if chunked:  # a generator body goes out with Transfer-Encoding: chunked
            args["content"] = chunks(args["content"])
        start = time.perf_counter()
        try:
            statuses.append(client.post(**args).status_code)
        except httpx.TransportError as e:  # the server closed while the client still sent
            statuses.append(type(e).__name__)
        seconds.append(time.perf_counter() - start)
        time.sleep(0.2)  # let the server finish freeing before reading its RSS
        rss.append(rss_mb(pid))
    return {"statuses": sorted(set(map(str, statuses))),
            "median_s": round(statistics.median(seconds), 3),
            "max_s": round(max(seconds), 3),
            "rss_start_mb": round(rss[0], 1),
            "rss_growth_first_mb": round(rss[1] - rss[0], 1),
            "rss_growth_all_mb": round(rss[-1] - rss[0], 1),
            "rss_growth_after_first_mb": round(rss[-1] - rss[1], 1)}


def stream_gap_s(base: str, request: dict | None, max_tokens: int = 48) -> float:
    """The longest pause (s) between two events of a greedy streamed completion while
    `request` (None: nothing) is sent again and again on another connection: how long a bad
    request stalls the other clients."""
    stamps: list[float] = []

    def stream() -> None:
        body = {"prompt": "Count: 1, 2, 3,", "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=base, timeout=120) as c, \
                c.stream("POST", "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    stamps.append(time.perf_counter())

    reader = threading.Thread(target=stream)
    reader.start()
    with httpx.Client(base_url=base, timeout=120) as c:
        while reader.is_alive():
            if request is None:
                time.sleep(0.05)
                continue
            args = dict(request)
            if args.pop("chunked", False):
                args["content"] = chunks(args["content"])
            try:
                c.post(**args)
            except httpx.TransportError:
                pass
    reader.join()
    gaps = [b - a for a, b in zip(stamps[1:-1], stamps[2:])]  # after the first token
    return round(max(gaps), 3) if gaps else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--startup-timeout", type=float, default=300)
    parser.add_argument("serve_flags", nargs="*", help="extra `deltaserve serve` flags")
    args = parser.parse_args()
    port = free_port()
    flags = args.serve_flags or ["--device", "cpu"]
    server = subprocess.Popen([sys.executable, "-m", "deltaserve.server.cli", "--log-level",
                               "WARNING", "serve", "--port", str(port), *flags],
                              env={**os.environ})
    base = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(base_url=base, timeout=120) as client:
            deadline = time.monotonic() + args.startup_timeout
            while True:
                assert server.poll() is None, "the server exited during startup"
                try:
                    if client.get("/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, "the server did not start"
                time.sleep(0.5)
            ok = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
            assert ok.status_code == 200, ok.text
            results = {"server": {"flags": flags, "rss_mb": round(rss_mb(server.pid), 1)}}
            results["stream gap, alone"] = {"max_gap_s": stream_gap_s(base, None)}
            for kind, request in bad_requests().items():
                results[kind] = measure(client, server.pid, request, args.repeat)
                results[kind]["stream_max_gap_s"] = stream_gap_s(base, request)
                print(f"{kind:20s} {json.dumps(results[kind])}", flush=True)
            ok = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
            results["served after"] = ok.status_code
            print(json.dumps(results, indent=1))
    finally:
        server.terminate()
        server.wait(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
