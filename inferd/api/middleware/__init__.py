"""The API process's ASGI middleware, one job per piece, composed in inferd/api/app.py's build_app (outermost
first): request_context (receipt time, request id, connection aborter), request_counter (requests by route and
status), auth (the key's tenant; 401), loopback (no keys: loopback Host names only; 403), body (the body's size
limit and lone surrogates; 413, 400). Pure ASGI: no per-request task, streaming untouched."""
