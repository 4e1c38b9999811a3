"""Counts every HTTP request by route and status (inferd_requests_total); a request whose response never started
(the client went away) counts as 499."""

from __future__ import annotations

from .auth import PUBLIC_PATHS

# the routes counted by their own path; any other path counts as "other" (a client must not mint label values)
KNOWN_ROUTES = ("/admin/workers", "/admin/rollout", "/admin/rollout/start", "/admin/rollout/promote",
                "/admin/rollout/abort", "/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages",
                "/v1/messages/count_tokens", "/v1/models", "/tokenize", "/detokenize", "/v1/embeddings", "/v1/files",
                "/v1/batches", *PUBLIC_PATHS)


class RequestCounter:
    def __init__(self, app, metrics):
        self.app = app
        self.metrics = metrics
        for route in KNOWN_ROUTES:  # at zero from the start: a fresh server's request panels show 0, not nothing
            metrics.requests.labels(route, "200")

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        route = path if path in KNOWN_ROUTES else ("/v1/models/{id}" if path.startswith("/v1/models/") else "other")
        status = [0]

        async def send_counted(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_counted)
        finally:
            self.metrics.requests.labels(route, str(status[0] or 499)).inc()
