"""API-key check for the /v1 routes: `Authorization: Bearer <key>` or, as Anthropic's clients send it,
`x-api-key: <key>`, compared in constant time."""
from __future__ import annotations

import secrets

from fastapi import Request

from sudu.server.errors import APIError


def api_key_dependency(api_key: str | None):
    async def check(request: Request) -> None:
        if not api_key:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        bearer = scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(), api_key.encode())
        x_api_key = request.headers.get("x-api-key")
        if not bearer and not (x_api_key is not None and secrets.compare_digest(x_api_key.strip().encode(),
                                                                                api_key.encode())):
            raise APIError(401, "Missing or invalid API key (send 'Authorization: Bearer <key>' or 'x-api-key: <key>')",
                           type="authentication_error", code="invalid_api_key")

    return check
