"""ServerState: what the app's routes share (the engine once loaded, the limits' pool, metrics, the drain and
failure flags). Its own module below app.py and the route modules, which all read it."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from sudu.server.engine_protocol import ServingEngine
from sudu.server.limits import PreparePool
from sudu.server.media_input import MediaPolicy
from sudu.server.metrics import ServerMetrics


@dataclass
class ServerState:
    engine: ServingEngine | None
    served_model_name: str | None
    api_key: str | None
    shutdown_timeout_s: float
    metrics: ServerMetrics
    pool: PreparePool
    media: MediaPolicy = field(default_factory=MediaPolicy)  # where images may come from, how large
    load_engine: Callable[[], ServingEngine] | None = None
    on_load_error: Callable[[BaseException], None] | None = None
    on_engine_failure: Callable[[str], None] | None = None
    # /health's answer once the engine is ready, where the engine has more to say than 200 `ok` (a cluster's
    # replicas): (status code, body)
    health: Callable[[], Awaitable[tuple[int, dict]]] | None = None
    load_error: str | None = None
    engine_failure: str | None = None  # why the engine cannot continue, once it cannot
    draining: bool = False
    drained: asyncio.Event | None = None
    tasks: list[asyncio.Task] = field(default_factory=list)
    started_at: int = field(default_factory=lambda: int(time.time()))

    @property
    def model_id(self) -> str:
        return self.served_model_name or self.engine.model_name
