"""HubError: a request answered with an error, worded as the hub words it; and the errors the
fault switches inject, a 429 with the real hub's rate-limit headers."""

from __future__ import annotations

from collections.abc import Mapping

# The quota a 429 announces, per bucket ("api" for /api/, "resolvers" for /resolve/) over a
# 5-minute window, in the real hub's header form (https://huggingface.co/docs/hub/rate-limits).
RATE_LIMIT_QUOTA = 1000
RATE_LIMIT_WINDOW_S = 300


class HubError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        error_code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_code = error_code
        self.headers = dict(headers or {})


def injected_error(status: int, retry_after_s: int | None, bucket: str) -> HubError:
    headers = {} if retry_after_s is None else {"Retry-After": str(retry_after_s)}
    if status == 429:
        headers["RateLimit"] = f'"{bucket}";r=0;t={retry_after_s}'
        headers["RateLimit-Policy"] = (
            f'"fixed window";"{bucket}";q={RATE_LIMIT_QUOTA};w={RATE_LIMIT_WINDOW_S}'
        )
        return HubError(
            429,
            f"lab hub: rate limit reached (injected); retry after {retry_after_s} s",
            headers=headers,
        )
    return HubError(status, f"lab hub: injected failure ({status})", headers=headers)
