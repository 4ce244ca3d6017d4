"""Prometheus text-format metrics, without a client library.

The server needs a handful of counters, gauges and one histogram; writing the exposition format (version
0.0.4: `# HELP`, `# TYPE`, `name{label="v"} value`) by hand keeps the dependency list short. Metrics are
updated from two threads (the event loop and the engine loop), so every mutation takes the registry lock;
`render()` takes it too, so a scrape sees one consistent state.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable

STEP_TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(names: tuple[str, ...], values: tuple[str, ...], extra: str = "") -> str:
    parts = [f'{n}="{_escape(v)}"' for n, v in zip(names, values)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if math.isnan(value):
        return "NaN"
    return repr(int(value)) if float(value).is_integer() and abs(value) < 1 << 53 else repr(float(value))


class _Metric:
    kind = ""

    def __init__(self, registry: Registry, name: str, help_: str, labels: Iterable[str] = ()):
        self.name, self.help, self.label_names = name, help_, tuple(labels)
        self._lock = registry.lock
        # A metric without labels reads 0 from the start (a scrape that finds it missing cannot tell "zero"
        # from "not exported").
        self._values: dict[tuple[str, ...], float] = {} if self.label_names else {(): 0.0}
        registry.metrics.append(self)

    def _key(self, labels: dict[str, str]) -> tuple[str, ...]:
        if set(labels) != set(self.label_names):
            raise ValueError(f"{self.name} takes labels {self.label_names}, got {sorted(labels)}")
        return tuple(str(labels[n]) for n in self.label_names)

    def get(self, **labels: str) -> float:
        with self._lock:
            return self._values.get(self._key(labels), 0.0)

    def lines(self) -> list[str]:
        return [f"{self.name}{_labels(self.label_names, k)} {_number(v)}" for k, v in sorted(self._values.items())]


class Counter(_Metric):
    kind = "counter"

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        if amount < 0:
            raise ValueError(f"counter {self.name} cannot decrease (inc by {amount})")
        with self._lock:
            key = self._key(labels)
            self._values[key] = self._values.get(key, 0.0) + amount

    def set_total(self, total: float, **labels: str) -> None:
        """Mirror a monotonic total kept elsewhere (the engine's token counters)."""
        with self._lock:
            key = self._key(labels)
            self._values[key] = max(self._values.get(key, 0.0), float(total))


class Gauge(_Metric):
    kind = "gauge"

    def set(self, value: float, **labels: str) -> None:
        with self._lock:
            self._values[self._key(labels)] = float(value)


class Histogram(_Metric):
    kind = "histogram"

    def __init__(self, registry: Registry, name: str, help_: str, buckets: Iterable[float]):
        super().__init__(registry, name, help_)
        self.buckets = tuple(sorted(buckets))
        self._counts = [0] * len(self.buckets)
        self._sum = 0.0
        self._count = 0

    def observe(self, value: float) -> None:
        with self._lock:
            for i, upper in enumerate(self.buckets):
                if value <= upper:
                    self._counts[i] += 1
            self._sum += value
            self._count += 1

    @property
    def count(self) -> int:
        with self._lock:
            return self._count

    def lines(self) -> list[str]:
        out = [f'{self.name}_bucket{{le="{_number(u)}"}} {c}' for u, c in zip(self.buckets, self._counts)]
        out.append(f'{self.name}_bucket{{le="+Inf"}} {self._count}')
        out.append(f"{self.name}_sum {_number(self._sum)}")
        out.append(f"{self.name}_count {self._count}")
        return out


class Registry:
    def __init__(self):
        self.lock = threading.RLock()
        self.metrics: list[_Metric] = []

    def render(self) -> str:
        with self.lock:
            out: list[str] = []
            for m in self.metrics:
                out.append(f"# HELP {m.name} {m.help}")
                out.append(f"# TYPE {m.name} {m.kind}")
                out.extend(m.lines())
            return "\n".join(out) + "\n"


class ServerMetrics:
    """Every metric the server exports. Names follow Prometheus conventions (`_total` counters, base units)."""

    def __init__(self):
        r = self.registry = Registry()
        self.http_requests = Counter(r, "detinfer_http_requests_total", "HTTP requests answered, by route and "
                                     "status code.", ("path", "status"))
        self.finished = Counter(r, "detinfer_request_outputs_total", "Completion choices ended, by finish "
                                "reason (stop, length, abort).", ("finish_reason",))
        self.aborted = Counter(r, "detinfer_requests_aborted_total", "Engine requests aborted before finishing "
                               "(client disconnected, or shutdown).")
        self.rejected = Counter(r, "detinfer_requests_rejected_total", "Generation requests refused before "
                                "reaching the engine, by reason.", ("reason",))
        self.prompt_tokens = Counter(r, "detinfer_prompt_tokens_total", "Prompt (and recomputed) tokens fed "
                                     "through the model; prefix-cache hits are not counted.")
        self.prefix_query = Counter(r, "detinfer_prefix_cache_query_tokens_total", "Prompt tokens looked up "
                                    "in the prefix cache.")
        self.prefix_hit = Counter(r, "detinfer_prefix_cache_hit_tokens_total", "Prompt tokens found in the "
                                  "prefix cache.")
        self.preemptions = Counter(r, "detinfer_preemptions_total", "Sequences preempted (KV freed, to be "
                                   "recomputed).")
        self.generation_tokens = Counter(r, "detinfer_generation_tokens_total", "Tokens the engine generated.")
        self.steps = Counter(r, "detinfer_engine_steps_total", "Engine steps run.")
        self.pending = Gauge(r, "detinfer_requests_pending", "Requests accepted by the server and not finished "
                             "(queued for the engine, waiting or running).")
        self.running = Gauge(r, "detinfer_requests_running", "Requests the engine is running.")
        self.waiting = Gauge(r, "detinfer_requests_waiting", "Requests queued in the engine (the queue depth).")
        self.kv_used = Gauge(r, "detinfer_kv_cache_blocks_used", "KV-cache blocks held by unfinished "
                             "sequences.")
        self.kv_cached = Gauge(r, "detinfer_kv_cache_blocks_cached", "Free KV-cache blocks still holding "
                               "reusable prefix-cache content.")
        self.kv_total = Gauge(r, "detinfer_kv_cache_blocks_total", "KV-cache blocks in the pool.")
        self.kv_usage = Gauge(r, "detinfer_kv_cache_usage_ratio", "Fraction of KV-cache blocks in use (0..1).")
        self.last_step = Gauge(r, "detinfer_engine_last_step_seconds", "Wall time of the latest engine step.")
        self.step_time = Histogram(r, "detinfer_engine_step_seconds", "Wall time of engine steps.",
                                   STEP_TIME_BUCKETS)
        self.engine_alive = Gauge(r, "detinfer_engine_alive", "1 while the engine loop is healthy, else 0.")

    def update_engine_stats(self, stats: dict) -> None:
        """Copy an engine stats snapshot (see AsyncEngine.stats) into the gauges and mirrored counters."""
        self.running.set(stats.get("num_running", 0))
        self.waiting.set(stats.get("num_waiting", 0))
        used, total = stats.get("kv_blocks_used", 0), stats.get("kv_blocks_total", 0)
        self.kv_used.set(used)
        self.kv_cached.set(stats.get("kv_blocks_cached", 0))
        self.kv_total.set(total)
        self.kv_usage.set(used / total if total else 0.0)
        self.prompt_tokens.set_total(stats.get("prompt_tokens", 0))
        self.generation_tokens.set_total(stats.get("generation_tokens", 0))
        self.prefix_query.set_total(stats.get("prefix_cache_query_tokens", 0))
        self.prefix_hit.set_total(stats.get("prefix_cache_hit_tokens", 0))
        self.preemptions.set_total(stats.get("num_preemptions", 0))

    def render(self) -> str:
        return self.registry.render()


class HTTPRequestCounter:
    """Pure ASGI middleware counting answered HTTP requests by route and status. (Not Starlette's
    BaseHTTPMiddleware: it wraps streaming responses in a way that interferes with disconnect handling.)
    Paths outside `routes` are counted as "other", so scanners cannot blow up the label set."""

    def __init__(self, app, metrics: ServerMetrics, routes: tuple[str, ...]):
        self.app, self.metrics, self.routes = app, metrics, routes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = [500]

        async def send_status(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            path = scope.get("path", "")
            path = next((r for r in self.routes if r == path or r.endswith("}") and path.startswith(r[:r.index("{")])),
                        "other")
            self.metrics.http_requests.inc(path=path, status=str(status[0]))


def parse_metrics(text: str) -> dict[str, float]:
    """`{"name{labels}": value}` from exposition text; used by tests and the benchmark to read /metrics."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out
