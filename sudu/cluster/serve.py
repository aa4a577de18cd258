"""`sudu serve --replicas N`: Ray (a local instance, or the cluster at --ray-address), the engine
deployment with its router, and the ingress app's engine (ClusterEngine) and /health.

The ingress is the `sudu serve` process itself: the same app, uvicorn server, drain and flags as a
single engine; only the engine behind the app differs. Serve's own HTTP proxy is not started."""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os

from fastapi import FastAPI

from sudu.cluster.registry import PREFILL_APP_NAME
from sudu.config import EngineConfig

log = logging.getLogger(__name__)

APP_NAME = "sudu"
DEPLOYMENT_NAME = "engine"
ROUTING_STATS_PERIOD_S = 1.0  # how often each replica reports its cache summary to the router
HEALTH_TIMEOUT_S = 5.0
# Ray Serve's documented high-throughput mode (Ray >= 2.55): handle -> replica calls over gRPC instead of
# Ray actor tasks, replica methods and the handle's router on the main event loops: it cuts the hop's cost
# per call and per streamed item (docs/cluster.md). Serve reads it when it is imported, so it is set before that; a value the user set
# wins. A cluster joined with --ray-address gets it where its nodes were started (`ray start`).
# gRPC messages (a request's arguments, a streamed output) may exceed gRPC's 4 MiB default (a long prompt's
# logprobs): their limit is raised to 1 GiB. The mode's direct ingress (each ingress replica serving HTTP
# and gRPC on ports of its own, with a 35 s minimum drain) is off: sudu's ingress is its own app.
# Ray starts its workers at nice 15. A replica's engine threads then yield the core to every wakeup of the
# ingress and Ray's own processes at nice 0, and its parallel steps wait for the descheduled thread: workers
# run at nice 0 (the raylet reads this when it starts: a local instance here; `ray start` on a cluster).
# Every wakeup of another process on a core the engine computes on preempts one of its threads. Serve's
# replicas and handles export their cached metrics every 100 ms by default and its controller runs its
# loop every 100 ms: once a second and every 0.5 s are enough for metrics and for reacting to a dead
# replica, and wake the machine less often (measured in docs/cluster.md).
RAY_ENV = {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH": str(1 << 30),
           "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0", "RAY_worker_niceness": "0",
           "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000", "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5"}


def add_cluster_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("replicas on Ray Serve (pip install 'sudu[ray]'; docs/cluster.md)")
    g.add_argument("--replicas", type=int, default=None,
                   help="serve with N engine replicas on Ray Serve (default: one engine in this process, no Ray)")
    g.add_argument("--ray-address", default=None,
                   help="join this Ray cluster (e.g. 10.0.0.1:6379, or 'auto'); default: start a local Ray "
                   "instance and stop it with the server")
    g.add_argument("--replica-cpus", type=float, default=None,
                   help="CPUs reserved per replica; also its torch threads unless --num-threads is set "
                   "(default: this machine's cores / replicas)")
    g.add_argument("--routing", choices=["cache_aware", "round_robin"], default="cache_aware",
                   help="cache_aware: the replica with the longest cached prefix, unless it is overloaded "
                   "(default); round_robin: ignore caches")
    g.add_argument("--pd", default=None, metavar="P:D",
                   help="prefill/decode split: P prefill replicas run each prompt and hand its KV blocks to one of "
                   "D decode replicas through Ray's object store (instead of --replicas)")
    g.add_argument("--routing-imbalance", type=int, default=4,
                   help="the load guard: when the best-cached replica has more than this many requests in "
                   "flight beyond the least loaded one, the least loaded gets the request (default: 4)")


def parse_pd(text: str) -> tuple[int, int]:
    """'P:D' -> (prefill replicas, decode replicas), each >= 1."""
    try:
        p, d = (int(x) for x in text.split(":"))
    except ValueError:
        raise ValueError(f"--pd takes P:D (prefill and decode replica counts, e.g. 1:1), not {text!r}") from None
    if p < 1 or d < 1:
        raise ValueError(f"--pd {text}: both counts must be >= 1")
    return p, d


class Cluster:
    """The Ray side of one `sudu serve --replicas N`: Ray joined or started when it is made, the
    deployment started by `load` (in the app's loading thread, so /health answers 503 while replicas
    load), all stopped by `stop`."""

    def __init__(self, args: argparse.Namespace, config: EngineConfig):
        self.num_prefill = 0
        if args.pd is not None:
            if args.replicas is not None:
                raise ValueError("--pd P:D replaces --replicas; give one of them")
            self.num_prefill, args.replicas = parse_pd(args.pd)
        if args.replicas < 1:
            raise ValueError("--replicas must be >= 1")
        self.args = args
        total = args.replicas + self.num_prefill
        cpus = args.replica_cpus or max(1.0, float((os.cpu_count() or 1) // total))
        self.replica_cpus = cpus
        self.config = dataclasses.replace(config, num_threads=config.num_threads or max(1, int(cpus)))
        self.started_ray = False
        self.engine = None
        for key, value in RAY_ENV.items():
            os.environ.setdefault(key, value)
        self._init_ray()

    def _init_ray(self) -> None:
        """Here, in the thread that runs the server: a local Ray instance's processes are started with
        a parent-death signal tied to the starting thread, so starting them in the short-lived loading
        thread would kill them when it ends."""
        import ray

        if ray.is_initialized():
            return
        if self.args.ray_address:
            ray.init(address=self.args.ray_address, include_dashboard=False, log_to_driver=False)
        else:
            ray.init(num_cpus=max(os.cpu_count() or 1, int((self.args.replicas + self.num_prefill) * self.replica_cpus)),
                     include_dashboard=False, log_to_driver=False)
            self.started_ray = True

    def load(self):
        from ray import serve
        from ray.serve.config import RequestRouterConfig

        from sudu.cluster.engine import ClusterEngine
        from sudu.cluster.replica import EngineReplica

        args = self.args
        serve.start(proxy_location="Disabled")
        max_ongoing = self.config.max_num_seqs + args.max_queue_len

        def deploy(app: str, num_replicas: int):
            deployment = serve.deployment(EngineReplica).options(
                name=DEPLOYMENT_NAME, num_replicas=num_replicas, max_ongoing_requests=max_ongoing,
                ray_actor_options={"num_cpus": self.replica_cpus},
                health_check_period_s=2.0, health_check_timeout_s=max(30.0, args.engine_stall_timeout),
                graceful_shutdown_timeout_s=args.shutdown_timeout,
                # the ingress's access log records every request; a replica's own would cost each call a record
                logging_config={"enable_access_log": False},
                request_router_config=RequestRouterConfig(
                    request_router_class="sudu.cluster.router.CacheAwareRouter",
                    request_router_kwargs={"policy": args.routing, "imbalance_threshold": args.routing_imbalance},
                    request_routing_stats_period_s=ROUTING_STATS_PERIOD_S),
            )
            serve.run(deployment.bind(self.config, args.max_queue_len, args.engine_stall_timeout),
                      name=app, route_prefix=None)

        def setup_call(app: str, method: str):
            """One call from this loading thread, which has no event loop: through a handle whose router
            runs on a loop of its own (the request path's handles are made in the server's loop), its
            result through Ray's object store (a tokenizer can be megabytes)."""
            from ray.serve.handle import DeploymentHandle

            handle = DeploymentHandle(DEPLOYMENT_NAME, app)
            handle._init(_run_router_in_separate_loop=True)
            return getattr(handle.options(_by_reference=True), method).remote().result(timeout_s=60)

        if self.num_prefill:  # the prefill replicas: an application of their own, the same replica class
            deploy(PREFILL_APP_NAME, self.num_prefill)
            try:  # a model the handoff cannot carry fails here, with the replica's reason
                setup_call(PREFILL_APP_NAME, "check_handoff")
            except Exception as exc:  # noqa: BLE001 -- Ray wraps the replica's error; keep its message only
                raise ValueError(str(getattr(exc, "cause", None) or exc).strip().splitlines()[-1]) from None
        deploy(APP_NAME, args.replicas)
        info = setup_call(APP_NAME, "describe")
        self.engine = ClusterEngine(APP_NAME, DEPLOYMENT_NAME, info, self.config.block_size, args.replicas,
                                    max_in_flight=args.replicas * max_ongoing,
                                    prefill_app=PREFILL_APP_NAME if self.num_prefill else None,
                                    num_prefill=self.num_prefill)
        if info["niceness"] > 0:
            log.warning("the replicas run at nice %d, so every other process on their cores preempts their engine "
                        "threads; start the Ray nodes with RAY_worker_niceness=0 (docs/cluster.md)", info["niceness"])
        log.info("%s of %s on Ray Serve (%.1f CPUs, %d threads each; routing %s)",
                 f"{self.num_prefill} prefill + {args.replicas} decode replicas" if self.num_prefill else f"{args.replicas} replicas",
                 info["model_name"], self.replica_cpus, self.config.num_threads, args.routing)
        return self.engine

    def install(self, app: FastAPI) -> None:
        """The ingress's additions to the app: per-replica series on /metrics (metrics.py) and /health
        with the replicas."""
        from sudu.cluster.metrics import ReplicaCollector

        state = app.state.sudu
        state.metrics.registry.register(ReplicaCollector(lambda: self.engine))
        state.health = self._replica_health

    async def _replica_health(self) -> tuple[int, dict]:
        """/health with the replicas: 200 `ok` when all are running, 200 `degraded` (still serving) while
        some are missing, 503 `unavailable` when none is. Before the replicas are up, after a failure and
        while shutting down, the app's own /health answers (it asks this only once the engine is ready).
        A hook, not an HTTP middleware: Starlette's BaseHTTPMiddleware would wrap every response of the
        app, each streamed chunk included."""
        try:
            replicas = await asyncio.wait_for(asyncio.to_thread(self.engine.replicas), HEALTH_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 -- the controller did not answer: say so, keep serving
            return 200, {"status": "degraded", "error": f"Ray Serve status unavailable: {exc!r}"}
        if replicas["running"] == 0:
            return 503, {"status": "unavailable", "replicas": replicas}
        return 200, {"status": "ok" if replicas["running"] >= replicas["target"] else "degraded", "replicas": replicas}

    def stop(self) -> None:
        import ray
        from ray import serve

        if not ray.is_initialized():
            return
        try:
            if self.started_ray:
                serve.shutdown()
            else:
                serve.delete(APP_NAME)
                if self.num_prefill:
                    serve.delete(PREFILL_APP_NAME)
        finally:
            if self.started_ray:
                ray.shutdown()
