"""An image URL to its bytes: `data:` URLs decoded in place; http(s) URLs fetched (httpx) only when their host is
one of the allowed media domains (none by default: `--allowed-media-domains`), with the byte limit enforced
while the body streams in; every other scheme refused."""
from __future__ import annotations

import base64
import binascii
import urllib.parse

import httpx

from sudu.media.image import MediaError

FETCH_TIMEOUT_S = 10.0


def allowed_host(host: str, allowed: tuple[str, ...]) -> bool:
    """A host matches an allowed domain when it is that domain or a subdomain of it."""
    host = host.lower().rstrip(".")
    return any(host == d or host.endswith("." + d) for d in allowed)


def data_url_bytes(url: str, max_bytes: int) -> bytes:
    """The payload of a `data:[<type>][;base64],<data>` URL."""
    header, sep, payload = url.partition(",")
    if not sep:
        raise MediaError("a data: URL needs a comma before its payload", "undecodable")
    if len(payload) * 3 // 4 > max_bytes:
        raise MediaError(f"the image has about {len(payload) * 3 // 4} bytes; the limit is {max_bytes}",
                         "too_large", 413)
    if header.endswith(";base64"):
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise MediaError("the data: URL's payload is not valid base64", "undecodable") from None
    return urllib.parse.unquote_to_bytes(payload)


def base64_bytes(payload: str, max_bytes: int) -> bytes:
    """A bare base64 payload (Anthropic's image source)."""
    return data_url_bytes("data:;base64," + payload, max_bytes)


def fetch_url(url: str, allowed_domains: tuple[str, ...], max_bytes: int) -> bytes:
    """The bytes an image URL names, under the domain allowlist and the byte limit."""
    if url.startswith("data:"):
        return data_url_bytes(url, max_bytes)
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise MediaError(f"image URLs must be data: or http(s) URLs, not {parsed.scheme or 'a bare path'}:",
                         "forbidden_url")
    if not allowed_host(parsed.hostname, allowed_domains):
        raise MediaError(f"fetching images from {parsed.hostname} is not allowed (--allowed-media-domains)",
                         "forbidden_url", 403)
    try:
        with httpx.stream("GET", url, timeout=FETCH_TIMEOUT_S, follow_redirects=False) as response:
            if response.status_code != 200:
                raise MediaError(f"fetching the image returned HTTP {response.status_code}", "fetch_failed")
            chunks, size = [], 0
            for chunk in response.iter_bytes():
                size += len(chunk)
                if size > max_bytes:
                    raise MediaError(f"the image at {url} is over the limit of {max_bytes} bytes", "too_large", 413)
                chunks.append(chunk)
            return b"".join(chunks)
    except httpx.HTTPError as exc:
        raise MediaError(f"fetching the image failed: {exc}", "fetch_failed") from None
