"""`sudu serve`: the OpenAI-compatible server. Flags here; the app lives in server/app.py (imported only
when the command runs, so `sudu --help` stays fast)."""
from __future__ import annotations

import argparse
import os
import sys
import threading

from sudu.config import DEFAULT_MODEL, add_engine_args, engine_config_from_args
from sudu.media.limits import DEFAULT_MAX_IMAGE_BYTES, DEFAULT_MAX_IMAGE_PIXELS, DEFAULT_MAX_IMAGES, ImageLimits
from sudu.server.limits import ServerLimits


def register_cli(subparsers) -> None:
    p = subparsers.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a model over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, "
        "/v1/models, /health, /metrics). The HTTP server starts at once and /health answers 503 until the "
        "model is loaded (a catalog model is downloaded first, with progress).",
    )
    p.add_argument("model_pos", nargs="?", metavar="MODEL", default=None,
                   help=f"catalog name, .gguf path or Hugging Face-style directory (default: {DEFAULT_MODEL})")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to bind (default: 8000)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer <key>' on /v1 routes (default: $SUDU_API_KEY, else open)")
    p.add_argument("--max-queue-len", type=int, default=256,
                   help="requests queued in the engine before new ones get 429 + Retry-After (default: 256); "
                   "--max-queue-wait bounds the queue by predicted wait as well")
    p.add_argument("--served-model-name", default=None,
                   help="model id announced on /v1/models and expected in requests (default: the model's name)")
    p.add_argument("--drain-timeout", "--shutdown-timeout", dest="shutdown_timeout", metavar="SECONDS", type=float,
                   default=30.0,
                   help="on SIGINT/SIGTERM the server stops admitting (503 + Retry-After, /health 503) and gives "
                   "in-flight requests this many seconds to finish before they are failed; then it exits 0 "
                   "(default: 30)")
    p.add_argument("--engine-stall-timeout", type=float, default=300.0,
                   help="seconds one engine step may take before the engine counts as failed (503, exit 1; "
                   "default: 300)")
    p.add_argument("--max-request-bytes", type=int, default=ServerLimits.max_request_bytes,
                   help="larger request bodies get 413 before they are read (default: 4 MiB)")
    p.add_argument("--prepare-workers", type=int, default=ServerLimits.prepare_workers,
                   help="threads that render chat templates and tokenize, off the event loop (default: 2)")
    p.add_argument("--prepare-queue", type=int, default=ServerLimits.prepare_queue,
                   help="requests waiting for such a thread before new ones get 429 (default: 64)")
    p.add_argument("--allowed-media-domains", default="", metavar="DOMAINS",
                   help="comma-separated hosts (and their subdomains) image URLs may be fetched from; default: none, "
                   "images come as data: URLs only")
    p.add_argument("--max-image-bytes", type=int, default=DEFAULT_MAX_IMAGE_BYTES,
                   help=f"larger images get 413 (default: {DEFAULT_MAX_IMAGE_BYTES >> 20} MiB)")
    p.add_argument("--max-image-pixels", type=int, default=DEFAULT_MAX_IMAGE_PIXELS,
                   help=f"images with more pixels (width x height) get 413 (default: {DEFAULT_MAX_IMAGE_PIXELS})")
    p.add_argument("--max-images-per-request", type=int, default=DEFAULT_MAX_IMAGES,
                   help=f"requests with more images get 400 (default: {DEFAULT_MAX_IMAGES})")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--record-trace", default=None, metavar="FILE",
                   help="write a trace of the traffic for `sudu bench replay`: per request its arrival, lengths and "
                   "block hash ids (no text); sessions inferred from shared prefixes (docs/bench.md)")
    p.add_argument("--record-text", action="store_true", help="with --record-trace: also write each rendered prompt")
    add_engine_args(p)
    from sudu.cluster.serve import add_cluster_args  # imports no Ray: that happens when --replicas runs

    add_cluster_args(p)
    p.set_defaults(disk_cache_size="auto")  # a server keeps its context cache on disk; tests and the API opt in
    p.set_defaults(func=run_serve)


def media_policy(args: argparse.Namespace):
    """--allowed-media-domains and the image limits as the server's MediaPolicy."""
    from sudu.server.media_input import MediaPolicy

    if min(args.max_image_bytes, args.max_image_pixels, args.max_images_per_request) < 1:
        raise ValueError("--max-image-bytes, --max-image-pixels and --max-images-per-request must be >= 1")
    domains = tuple(d.strip().lower().rstrip(".") for d in args.allowed_media_domains.split(",") if d.strip())
    return MediaPolicy(domains, ImageLimits(args.max_image_bytes, args.max_image_pixels, args.max_images_per_request))


def run_serve(args: argparse.Namespace) -> int:
    import logging

    from sudu.errors import EngineFailedError
    from sudu.server.app import LOAD_THREAD, build_app, make_server

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)-9s %(name)s: %(message)s")
    overrides = {"model": args.model_pos} if args.model_pos else {}
    config = engine_config_from_args(args, **overrides)
    if args.max_queue_len < 1:
        raise ValueError("--max-queue-len must be >= 1")
    if args.record_text and not args.record_trace:
        raise ValueError("--record-text needs --record-trace FILE")
    if args.record_trace:
        try:
            open(args.record_trace, "a").close()
        except OSError as exc:
            raise ValueError(f"cannot write --record-trace {args.record_trace}: {exc.strerror}") from None
    api_key = args.api_key or os.environ.get("SUDU_API_KEY") or None
    load_failure: list[BaseException] = []
    cluster = None
    if args.replicas is not None or args.pd is not None:  # replicas on Ray Serve: sudu/cluster/
        from sudu.cluster.serve import Cluster

        cluster = Cluster(args, config)

    def load_engine():
        from sudu.engine.async_engine import AsyncLLMEngine

        if cluster is not None:
            return record(cluster.load())

        return record(AsyncLLMEngine(config, max_queue_len=args.max_queue_len, stall_timeout_s=args.engine_stall_timeout))

    def record(engine):
        if not args.record_trace:
            return engine
        from sudu.server.trace_recorder import TraceRecorder

        return TraceRecorder(engine, args.record_trace, record_text=args.record_text)

    def on_load_error(exc: BaseException) -> None:
        load_failure.append(exc)
        server.should_exit = True

    def on_engine_failure(reason: str) -> None:
        # the process exits non-zero so that a supervisor (systemd Restart=on-failure, Docker
        # --restart on-failure, Kubernetes, Ray) starts a fresh one: docs/server.md
        load_failure.append(EngineFailedError(f"the engine failed ({reason}); exiting for a restart"))
        server.should_exit = True

    limits = ServerLimits(max_request_bytes=args.max_request_bytes, prepare_workers=args.prepare_workers,
                          prepare_queue=args.prepare_queue)
    media = media_policy(args)
    app = build_app(load_engine=load_engine, served_model_name=args.served_model_name, api_key=api_key,
                    shutdown_timeout_s=args.shutdown_timeout, limits=limits, media=media, on_load_error=on_load_error,
                    on_engine_failure=on_engine_failure)
    if cluster is not None:
        cluster.install(app)
    server = make_server(app, args.host, args.port, log_level=args.log_level)
    print(f"sudu: serving on http://{args.host}:{args.port} (loading {config.model}; /health is 503 until ready)",
          flush=True)
    try:
        server.run()
    finally:
        if cluster is not None:
            cluster.stop()
    if load_failure:
        raise load_failure[0]
    if any(t.name == LOAD_THREAD and t.is_alive() for t in threading.enumerate()):
        # Stopped (SIGINT/SIGTERM) while the model was still loading. The load thread may be inside
        # PyTorch's C++ code, whose static destructors at a normal interpreter exit then abort the process
        # ("terminate called without an active exception", exit 134): end here instead.
        print("sudu: stopped before the model finished loading", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(0)
    return 0
