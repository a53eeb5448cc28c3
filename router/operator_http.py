"""Operator endpoints on the HTTP front (what vLLM-compatible tooling expects).

``POST /reset_prefix_cache``: every engine forgets its G1 prefix cache (vLLM's
endpoint of the same name); the warehouse keeps its blocks, so the next
request restores from G2/G3 instead of hitting G1. Operators only: the call
must carry ``Authorization: Bearer <operator key>``, the key derived from the
deployment secret (``router.cluster_ops.operator_key``; ``kvserve operator-key``
prints it for whoever holds the deployment directory). A tenant's API key is
refused (403), a missing or wrong key is a 401. An ``--insecure`` deployment
has no secret and no authentication anywhere, so there it is open, as every
gRPC operator call already is.
"""

from __future__ import annotations

import hmac
import logging
from typing import Any

from aiohttp import web

from router.errors import AuthenticationError, InvalidRequestError, RouterError

log = logging.getLogger(__name__)

RESET_PATH = "/reset_prefix_cache"


class OperatorOnlyError(RouterError):
    http_status = 403
    error_type = "permission_error"


class OpsUnavailableError(RouterError):
    http_status = 503
    error_type = "server_error"


class OperatorEndpoints:
    def __init__(self, key: str, open_: bool, ops: Any) -> None:
        self._key = key.encode()
        self._open = open_ and not key
        self._ops = ops

    def install(self, app: web.Application) -> None:
        app.router.add_post(RESET_PATH, self.reset_prefix_cache)

    def _check(self, request: web.Request) -> None:
        if self._open:
            log.warning("%s called without authentication (--insecure deployment)",
                        request.path)
            return
        if not self._key:
            raise OperatorOnlyError(f"{request.path} is an operator endpoint and this router "
                                    "has no operator key (no deployment secret)")
        given = request.headers.get("Authorization", "")
        scheme, _, key = given.strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise AuthenticationError(f"{request.path} needs the operator key: "
                                      "'Authorization: Bearer KEY'")
        if not hmac.compare_digest(key.strip().encode(), self._key):
            # A tenant's own API key lands here too: it is a valid key, not this one.
            raise OperatorOnlyError(f"{request.path} is for operators only")

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        self._check(request)
        if request.query.get("warehouse", "").lower() in ("1", "true", "yes"):
            raise InvalidRequestError("resetting the warehouse is not offered over HTTP: "
                                      "delete blocks with `kvserve store` operator calls",
                                      param="warehouse", code="unsupported")
        if self._ops is None:
            raise OpsUnavailableError("this router cannot reach its instances")
        res = await self._ops.reset_prefix_cache()
        log.info("prefix caches reset on %d instance(s); failed on %s", len(res.instances),
                 sorted(res.failed) or "none")
        return web.json_response({"reset": res.instances, "failed": res.failed},
                                 status=502 if res.failed else 200)
