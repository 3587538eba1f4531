"""Share groups (KIP-932) beside the fetch-side hook: a ShareFetch on a hooked topic is
refused, the others pass.

Contract: ShareFetch answers do not run through fetch-side hooks. So while a hook is
configured, :func:`share_fetch_refusal` reads a ShareFetch request's topics (by id,
named from the Metadata answers the proxy has seen) and, when one of them is hooked
for this client - or is an id the proxy cannot name, which might be - returns the
proxy's own answer: the request's top-level ``error_code`` INVALID_REQUEST with an
``error_message`` naming the topics and what to do (read them with a consumer group,
through which the hook runs). Nothing of that request reaches the broker, so no
record of a hooked topic is ever handed out unhooked. A ShareFetch naming no hooked
topic is forwarded as it came; ShareGroupHeartbeat and ShareAcknowledge always are.
"""

from __future__ import annotations

import datetime
from typing import TYPE_CHECKING

from kio.schema.errors import ErrorCode
from kio.static.primitive import i32Timedelta

from kiproxy.protocol.framing import RequestHeader, encode_response_header
from kiproxy.protocol.messages import ApiKey, parse_request, response_type, serialize

if TYPE_CHECKING:
    from kiproxy.proxy.fetch.pipeline import FetchPipeline
    from kiproxy.proxy.net.client import RequestingClient

__all__ = ["share_fetch_refusal"]

_ZERO = i32Timedelta.parse(datetime.timedelta(0))


def share_fetch_refusal(pipeline: FetchPipeline, client: RequestingClient,
                        header: RequestHeader, frame: bytes) -> bytes | None:
    """The proxy's answer to a ShareFetch request naming a hooked topic, else None."""
    routes = pipeline.routes
    if routes is None or header.body_offset is None:
        return None
    request = parse_request(ApiKey.SHARE_FETCH, header.api_version, frame, header.body_offset)
    choose = client.routes(routes.table)
    hooked: list[str] = []
    for topic in request.topics:
        name = pipeline.topic_names.get(topic.topic_id)
        if name is None:
            hooked.append(f"topic id {topic.topic_id} (not yet named by a Metadata answer)")
            continue
        route = choose.select_fetch(name)
        if route is not None and routes.chain(route).consumers:
            hooked.append(repr(name))
    if not hooked:
        return None
    message = (f"kiproxy: {', '.join(hooked)} cannot be read by a share group through this "
               "proxy: a fetch-side hook runs on it, and ShareFetch answers do not run "
               "through fetch-side hooks; read it with a consumer group")
    cls = response_type(ApiKey.SHARE_FETCH, header.api_version)
    answer = cls(throttle_time=_ZERO, error_code=ErrorCode.invalid_request,
                 error_message=message, acquisition_lock_timeout=_ZERO, responses=(),
                 node_endpoints=())
    return encode_response_header(header.correlation_id, 1) + serialize(answer)
