"""API-key check for the /v1 routes: `Authorization: Bearer <key>`, compared in constant time."""
from __future__ import annotations

import secrets

from fastapi import Request

from sudu.server.errors import APIError


def api_key_dependency(api_key: str | None):
    async def check(request: Request) -> None:
        if not api_key:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(401, "Missing or invalid API key (send 'Authorization: Bearer <key>')",
                           type="authentication_error", code="invalid_api_key")

    return check
