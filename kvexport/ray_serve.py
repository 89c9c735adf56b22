"""Ray Serve replicas of one artifact: `kvexport serve ARTIFACT --ray --replicas N`, or this module's
`application()` in your own Ray Serve deployment.

Each replica is a Ray actor that loads the artifact once and owns one engine and one continuous-
batching scheduler; its HTTP ingress is the same FastAPI app as `kvexport serve` (the same OpenAI
routes, errors and /metrics, per replica). Ray Serve's proxy and router spread requests over the
replicas; Ray Serve's controller replaces a replica that dies. Nothing here schedules across
machines: placement is Ray's, from the hints below.

Placement: every replica asks for `num_cpus` CPUs (default: the engine's threads) and, with
`one_per_node` (the default), Ray Serve's `max_replicas_per_node=1` puts at most one replica on each
Ray node. Start one Ray node per machine, or one per NUMA node under `numactl` (docs/serving.md),
and each replica gets a machine or a NUMA node to itself. `resources` adds custom Ray resources a
replica needs (e.g. {"kvexport": 1} declared only on the nodes meant to serve).

Every response carries the headers `x-kvexport-replica` and `x-kvexport-node`: the Ray Serve replica
id and the Ray node id of the replica that answered.

    from ray import serve
    from kvexport.ray_serve import application
    serve.run(application("out/bench.kvx", replicas=2), name="kvexport", route_prefix="/")
"""
from __future__ import annotations

from typing import Any

from kvexport.errors import InputError

REPLICA_HEADER = "x-kvexport-replica"
NODE_HEADER = "x-kvexport-node"
APP_NAME = "kvexport"


def _serve() -> Any:
    try:
        from ray import serve
    except ImportError as e:
        raise InputError("Ray Serve replicas need Ray Serve: pip install 'kvexport[ray]'") from e
    return serve


class _ReplicaHeader:
    """Pure ASGI middleware (streams pass through): names the replica and its node in every response."""

    def __init__(self, app: Any, replica: str, node: str):
        self.app = app
        self.headers = [(REPLICA_HEADER.encode(), replica.encode()), (NODE_HEADER.encode(), node.encode())]

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def named_send(message: Any) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *self.headers]}
            await send(message)

        await self.app(scope, receive, named_send)


def application(artifact: str, *, replicas: int = 2, max_batch: int = 8, max_queue: int = 64,
                prefill_chunk: int = 64, prefill_budget: int | None = None, threads: int | None = None,
                model_name: str | None = None,
                load_options: dict[str, Any] | None = None, num_cpus: float | None = None,
                one_per_node: bool = True, resources: dict[str, float] | None = None,
                health_check_period_s: float = 2.0) -> Any:
    """A Ray Serve Application (pass it to `serve.run`): `replicas` replicas of the artifact.

    Each replica holds max_batch cache rows and queues up to max_queue more requests; Ray Serve's
    router sends a replica at most max_batch + max_queue requests at a time and keeps the rest in
    its own queue. The artifact path must name the same artifact on every node that may host a
    replica (a shared file system, or the same copy on each)."""
    from pathlib import Path

    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise InputError(f"replicas must be an integer >= 1, got {replicas!r}")
    if max_batch < 1 or max_queue < 0:
        raise InputError(f"max_batch must be >= 1 and max_queue >= 0, got {max_batch} and {max_queue}")
    if threads is not None and threads < 1:
        raise InputError(f"threads must be >= 1, got {threads}")
    path = Path(artifact)
    if not (path / "manifest.json").is_file():
        raise InputError(f"{artifact} is not an artifact folder (no manifest.json); build one with kvexport build")
    serve = _serve()
    name = model_name or path.name.removesuffix(".kvx")
    options: dict[str, Any] = {
        "num_replicas": replicas,
        "max_ongoing_requests": max_batch + max_queue,
        "ray_actor_options": {"num_cpus": num_cpus if num_cpus is not None else (threads or 1),
                              **({"resources": dict(resources)} if resources else {})},
        "health_check_period_s": health_check_period_s,
    }
    if one_per_node:
        options["max_replicas_per_node"] = 1

    @serve.deployment(name="KvexportReplica", **options)
    @serve.ingress()
    class KvexportReplica:
        """One engine and one scheduler; the OpenAI routes of `kvexport serve`."""

        def __init__(self) -> None:
            import ray

            import kvexport
            from kvexport.chat import engine_template
            from kvexport.runtime.scheduler import Scheduler

            self.engine = kvexport.load(str(path.resolve()), **({"threads": threads} if threads else {}),
                                        **(load_options or {}))
            self.template = engine_template(self.engine)
            self.scheduler = Scheduler(self.engine, max_batch=max_batch, max_queue=max_queue,
                                       prefill_chunk=prefill_chunk, prefill_budget=prefill_budget)
            self.replica = serve.get_replica_context().replica_id.unique_id
            self.node = ray.get_runtime_context().get_node_id()

        def __serve_build_asgi_app__(self) -> Any:
            from kvexport.server import create_app

            app = create_app(self.scheduler, model_name=name, chat_template=self.template)
            app.add_middleware(_ReplicaHeader, replica=self.replica, node=self.node)
            return app

        def check_health(self) -> None:
            """Ray Serve calls this every health_check_period_s: a scheduler stopped by an engine
            failure makes the replica unhealthy, and Ray Serve replaces it."""
            if self.scheduler._fatal is not None:
                raise RuntimeError(f"the scheduler stopped after an engine failure: {self.scheduler._fatal}")

    return KvexportReplica.bind()


def serve_ray(artifact: str, *, address: str | None = None, host: str = "127.0.0.1", port: int = 8000,
              **kw: Any) -> int:
    """`kvexport serve --ray`: connect to the Ray cluster at `address` (None: start a local one), run
    the application behind Ray Serve's HTTP proxy on host:port, block until Ctrl-C / SIGTERM, then
    delete the application."""
    import signal
    import threading

    serve = _serve()
    app = application(artifact, **kw)  # bad arguments fail here, before Ray starts
    import ray

    ray.init(address=address)
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(app, name=APP_NAME, route_prefix="/")
        print(f"kvexport: {kw.get('replicas', 2)} Ray Serve replicas of {artifact} on http://{host}:{port}/v1",
              flush=True)
        stop = threading.Event()
        previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            stop.wait()
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
        serve.delete(APP_NAME)  # each replica's scheduler drains its running requests (graceful shutdown)
        serve.shutdown()
    finally:
        ray.shutdown()
    return 0
