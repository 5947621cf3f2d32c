"""N SGLang workers behind SGLang's router (PyPI `sglang-router`), for tests and benchmarks.

    with RouterDeployment(worker_args, num_workers=2, policy="cache_aware") as deployment:
        requests.post(f"{deployment.base_url}/v1/chat/completions", json=...)

Each worker is a `ServerProcess` (its own port, pool and radix cache); the router is
`python -m sglang_router.launch_router --worker-urls ... --policy ...`, the form that fronts
workers started separately. With `cache_aware` the router keeps an approximate radix tree of
the text it sent to each worker and routes a request to the worker holding its longest prefix,
which keeps a multi-turn session's later turns on the worker holding its (compressed) history.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import TracebackType

from sgl_ragged.testing.server import BIND_RETRIES, HOST, PortTakenError, ServerProcess, free_port

POLICIES = ("cache_aware", "round_robin", "random", "power_of_two")


def router_args(worker_urls: Sequence[str], policy: str, prometheus_port: int) -> list[str]:
    """`sglang_router.launch_router` arguments (host and port are added by ServerProcess)."""
    if policy not in POLICIES:
        raise ValueError(f"router policy {policy!r}: use one of {', '.join(POLICIES)}")
    return ["--worker-urls", *worker_urls, "--policy", policy,
            "--prometheus-host", HOST, "--prometheus-port", str(prometheus_port),
            "--log-level", "info"]


class RouterDeployment:
    """`num_workers` servers started with the same `worker_args`, then the router in front."""

    def __init__(self, worker_args: Sequence[str], *, num_workers: int, policy: str,
                 log_dir: Path, env: Mapping[str, str] | None = None,
                 startup_timeout: float = 900.0) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self.workers = [
            ServerProcess(worker_args, env=env, log_path=log_dir / f"worker{i}.log",
                          startup_timeout=startup_timeout)
            for i in range(num_workers)
        ]
        self.policy = policy
        self.log_dir = log_dir
        self.router = self._router()

    def _router(self) -> ServerProcess:
        """The router's process, on fresh ports (its own and its Prometheus port)."""
        return ServerProcess(
            router_args([w.base_url for w in self.workers], self.policy, free_port()),
            log_path=self.log_dir / "router.log", startup_timeout=300.0,
            module="sglang_router.launch_router",
        )

    @property
    def base_url(self) -> str:
        """The router's URL: what clients talk to."""
        return self.router.base_url

    def start(self) -> RouterDeployment:
        """Start the workers side by side, then the router; stop everything on failure."""
        try:
            with ThreadPoolExecutor(len(self.workers)) as pool:
                for future in [pool.submit(w.start) for w in self.workers]:
                    future.result()
            for attempt in range(BIND_RETRIES + 1):
                # Ports picked before the workers started may have gone to their sockets since:
                # a taken Prometheus port gets a new router with new ports.
                self.router = self._router()
                try:
                    self.router.start()
                    break
                except PortTakenError:
                    if attempt == BIND_RETRIES:
                        raise
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Router first (no new requests reach the workers), then every worker."""
        for process in (self.router, *self.workers):
            process.stop()

    def __enter__(self) -> RouterDeployment:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
