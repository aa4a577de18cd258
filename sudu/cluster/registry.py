"""The live request routers of this process, per Serve application. Serve builds a router inside each
DeploymentHandle and ships the router's module by value (cloudpickle), so the router module cannot
hold this itself: its globals would be copies. The ingress finds its router here to read the route
of each request and the replicas' reports (engine.py). The prefill application's name lives here too, so
that serve.py and engine.py share it without importing each other."""
from __future__ import annotations

from typing import Any

PREFILL_APP_NAME = "sudu-prefill"  # the Serve application of the prefill replicas (--pd P:D)

_routers: dict[str, Any] = {}


def register(app_name: str, router: Any) -> None:
    _routers[app_name] = router


def router_for(app_name: str) -> Any | None:
    return _routers.get(app_name)
