"""Dispatching one client request: a table from API key to what the proxy does with it.

Contract:

- Produce goes through the configuration generation's produce pipeline
  (:mod:`kiproxy.proxy.produce.pipeline`). When some route has a fetch-side hook, a
  Fetch answer goes through the fetch pipeline (:mod:`kiproxy.proxy.fetch.pipeline`)
  before it reaches the client, Fetch is accepted only at the versions whose answers
  the proxy decodes, and a ShareFetch naming a hooked topic is answered by the proxy
  with an error (:mod:`kiproxy.proxy.fetch.share`). ApiVersions answers are cut to what
  the proxy can carry; responses that name broker addresses are rewritten; SASL requests
  are read as they pass so the connection learns its principal; everything
  else is forwarded as opaque bytes without being decoded.
- A request with an API key the proxy has no schema for, or whose answer would
  have to be rewritten at a version it has no schema for (never offered in
  ApiVersions, but a client can send it), is
  refused with :class:`~kiproxy.protocol.errors.UnsupportedVersion`: the
  connection closes the client with one warning, as a Kafka broker closes a
  connection that sends a request version it cannot parse.
- While a SASL exchange is under way, only ApiVersions, SaslHandshake and
  SaslAuthenticate pass (:class:`~kiproxy.protocol.errors.SaslStateError`
  otherwise), as the broker would have it.

- What needs no waiting is decided by a plain call, :meth:`RequestDispatcher.at_once`
  (a pass-through Produce request, and every request forwarded as opaque bytes), the
  same decision and the same refusals as :meth:`RequestDispatcher.dispatch`'s.

The dispatcher holds no connection: it is handed the requesting client (a
:class:`RequestingClient`) and the generation the request runs under.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from functools import partial
from typing import TYPE_CHECKING, Any

from kiproxy.protocol.errors import SaslStateError, UnsupportedVersion
from kiproxy.protocol.framing import RequestHeader
from kiproxy.protocol.messages import ApiKey, api_name
from kiproxy.proxy.brokers.addresses import needs_rewrite, rewritable, rewrite_response_frame
from kiproxy.proxy.brokers.api_versions import (
    cut_api_versions_frame,
    known_version_range,
    unsupported_api_versions_response,
)
from kiproxy.proxy.fetch.pipeline import FETCH_VERSIONS
from kiproxy.proxy.fetch.share import share_fetch_refusal
from kiproxy.proxy.net.client import RequestingClient
from kiproxy.proxy.produce.disposition import Answer, Disposition, Forward

if TYPE_CHECKING:
    from kiproxy.proxy.brokers.nodes import NodeRegistry
    from kiproxy.proxy.generation import Generation

__all__ = ["RequestDispatcher"]

_BEFORE_AUTHENTICATION = frozenset(
    {ApiKey.API_VERSIONS, ApiKey.SASL_HANDSHAKE, ApiKey.SASL_AUTHENTICATE})
"""What a Kafka broker accepts on a connection whose SASL exchange is under way."""


_Handler = Callable[["RequestDispatcher", RequestingClient, "Generation", RequestHeader, bytes],
                    Coroutine[Any, Any, Disposition]]


class RequestDispatcher:
    """Decides, per API key, what happens to one client request."""

    def __init__(self, nodes: NodeRegistry) -> None:
        self._nodes = nodes

    def dispatch(self, client: RequestingClient, generation: Generation,
                 header: RequestHeader, frame: bytes) -> Coroutine[Any, Any, Disposition]:
        """What to do with ``frame``: forward it (with a response rewriter) or answer it.

        Returns the handler's own coroutine (no frame of the dispatcher's per request);
        a request refused before any handler runs raises here, when it is called."""
        if client.sasl.awaiting_verdict and header.api_key not in _BEFORE_AUTHENTICATION:
            # The broker refuses this (ILLEGAL_SASL_STATE) and closes the connection; the
            # proxy must not run the interceptor or answer for it on the broker's behalf.
            raise SaslStateError(
                f"{api_name(header.api_key)} request before its SASL "
                f"{client.sasl.mechanism} authentication succeeded (the broker would refuse "
                "it: ILLEGAL_SASL_STATE)")
        return _handler(header.api_key, generation)(self, client, generation, header, frame)

    def at_once(self, client: RequestingClient, generation: Generation,
                header: RequestHeader, frame: bytes) -> Forward | None:
        """What to do with ``frame`` when that needs no waiting, as :meth:`dispatch` would
        decide it: a Produce request the pipeline forwards as it came (no route, no tally;
        only its acks are read), and a request forwarded as opaque bytes (every API
        without a handler of its own, and Fetch and ShareFetch with no fetch-side hook),
        raising what such a request is refused with. ``None`` for everything else: the
        caller awaits :meth:`dispatch`.

        A plain call where the common pass-through would otherwise cost a coroutine."""
        if client.sasl.awaiting_verdict:
            return None
        key = header.api_key
        if key == ApiKey.PRODUCE:
            return generation.produce.forward_as_received(header, frame, self._nodes.seen)
        if _handler(key, generation) is RequestDispatcher._other:
            return self._opaque(generation, header, frame)
        return None

    def rewriter(self, generation: Generation,
                 header: RequestHeader) -> Callable[[bytes], bytes] | None:
        """What the answer to ``header`` needs before it reaches the client, if anything."""
        if header.api_key == ApiKey.API_VERSIONS:
            fetch = generation.fetch
            return partial(cut_api_versions_frame, header.api_version,
                           produce_max=generation.produce.max_version,
                           fetch_range=(FETCH_VERSIONS[0], fetch.max_version)
                           if fetch.hooks else None)
        if needs_rewrite(header.api_key, header.api_version):
            observe = (generation.produce.learn_topic_ids
                       if header.api_key == ApiKey.METADATA else None)
            return partial(rewrite_response_frame, header.api_key, header.api_version,
                           seen=self._nodes.seen, observe=observe)
        return None

    # ------------------------------------------------------------------ handlers

    def _produce(self, client: RequestingClient, generation: Generation,
                 header: RequestHeader, frame: bytes) -> Coroutine[Any, Any, Disposition]:
        # The pipeline's own coroutine, awaited by dispatch(): no frame of its own.
        return generation.produce.handle(client, header, frame, self._nodes.seen)

    async def _fetch(self, client: RequestingClient, generation: Generation,
                     header: RequestHeader, frame: bytes) -> Disposition:
        fetch = generation.fetch
        low, high = FETCH_VERSIONS[0], fetch.max_version
        if not low <= header.api_version <= high:
            raise UnsupportedVersion(
                f"Fetch request v{header.api_version} refused: a fetch-side hook is "
                f"configured and the proxy decodes Fetch v{low}-v{high} answers (use a "
                "version offered in ApiVersions)")
        return Forward(frame, on_response=self.rewriter(generation, header),
                       transform=partial(fetch.rewrite, client, header.api_version))

    async def _share_fetch(self, client: RequestingClient, generation: Generation,
                           header: RequestHeader, frame: bytes) -> Disposition:
        refusal = share_fetch_refusal(generation.fetch, client, header, frame)
        if refusal is not None:
            return Answer(refusal)
        return self._opaque(generation, header, frame)

    async def _api_versions(self, client: RequestingClient, generation: Generation,
                            header: RequestHeader, frame: bytes) -> Disposition:
        known = known_version_range(ApiKey.API_VERSIONS)
        if known is not None and header.api_version > known[1]:
            return Answer(unsupported_api_versions_response(header.correlation_id))
        return Forward(frame, on_response=self.rewriter(generation, header))

    async def _sasl_handshake(self, client: RequestingClient, generation: Generation,
                              header: RequestHeader, frame: bytes) -> Disposition:
        if header.body_offset is not None:
            if header.api_version == 0:
                # v0 is followed by raw SASL tokens outside Kafka framing (clients older
                # than Kafka 1.0); the proxy carries only framed SaslAuthenticate.
                raise UnsupportedVersion(
                    "SaslHandshake v0 (raw SASL tokens without Kafka framing) is not "
                    "carried by the proxy; use a client that sends SaslHandshake v1 and "
                    "SaslAuthenticate (Kafka 1.0+ clients do)")
            client.sasl.on_handshake(header.api_version, frame, header.body_offset)
        return Forward(frame, on_response=self.rewriter(generation, header))

    async def _sasl_authenticate(self, client: RequestingClient, generation: Generation,
                                 header: RequestHeader, frame: bytes) -> Disposition:
        if header.body_offset is None:
            return Forward(frame)
        sasl_round = client.sasl.on_authenticate(header.api_version, frame, header.body_offset)
        return Forward(frame, on_response=partial(
            client.sasl_answered, sasl_round, header.api_version, header.header_version == 2))

    async def _other(self, client: RequestingClient, generation: Generation,
                     header: RequestHeader, frame: bytes) -> Disposition:
        return self._opaque(generation, header, frame)

    def _opaque(self, generation: Generation, header: RequestHeader, frame: bytes) -> Forward:
        """``frame`` forwarded as opaque bytes, with what its answer needs rewritten."""
        if known_version_range(header.api_key) is None:
            # Never offered (ApiVersions lists only the keys the proxy knows): a broker
            # closes the connection for it, which would read as the broker failing.
            raise UnsupportedVersion(
                f"a request with API key {header.api_key} refused: the proxy has no schema "
                "for that API (none of Kafka's, or one between brokers), and ApiVersions "
                "never offered it")
        if not rewritable(header.api_key, header.api_version):
            # Checked before forwarding: the broker would act on the request and its
            # answer could then be neither rewritten nor passed on (it names brokers).
            raise UnsupportedVersion(unrewritable_message(header))
        return Forward(frame, on_response=self.rewriter(generation, header))


_HANDLERS: dict[int, _Handler] = {
    ApiKey.PRODUCE: RequestDispatcher._produce,
    ApiKey.FETCH: RequestDispatcher._fetch,
    ApiKey.SHARE_FETCH: RequestDispatcher._share_fetch,
    ApiKey.API_VERSIONS: RequestDispatcher._api_versions,
    ApiKey.SASL_HANDSHAKE: RequestDispatcher._sasl_handshake,
    ApiKey.SASL_AUTHENTICATE: RequestDispatcher._sasl_authenticate,
}
"""API key -> handler; every other key is :meth:`RequestDispatcher._other`."""

_HOOKED = frozenset({ApiKey.FETCH, ApiKey.SHARE_FETCH})
"""Keys whose handler is theirs only while a fetch-side hook is configured."""


def _handler(key: int, generation: Generation) -> _Handler:
    """The handler of ``key`` under ``generation``: Fetch and ShareFetch are forwarded as
    opaque bytes (:meth:`RequestDispatcher._other`) when no fetch-side hook is configured."""
    if key in _HOOKED and not generation.fetch.hooks:
        return RequestDispatcher._other
    return _HANDLERS.get(key, RequestDispatcher._other)


def unrewritable_message(header: RequestHeader) -> str:
    """Why a request whose answer the proxy could not rewrite is refused."""
    name = api_name(header.api_key)
    known = known_version_range(header.api_key)
    reads = f"; it reads {name} v{known[0]}-v{known[1]}" if known is not None else ""
    return (f"{name} request v{header.api_version} refused: the proxy has no schema for "
            f"that version, so the broker addresses in the answer could not be "
            f"rewritten (use a version offered in ApiVersions{reads})")
