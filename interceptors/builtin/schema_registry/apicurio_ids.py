"""``GlobalIds``: an Apicurio Registry globalId turned into the id its Confluent-compatible API
knows, for records whose header carries a globalId (``apicurio.value.globalId``).

Why: Apicurio's Java serdes write the artifact version's *globalId* by default
(``apicurio.registry.use-id=globalId``, an 8-byte big-endian long in the header
``apicurio.value.globalId``), while Apicurio 2.x's Confluent-compatible API
(``/apis/ccompat/v7/schemas/ids/{id}``) numbers schemas by *contentId*, unless the registry
runs with ``registry.ccompat.legacy-id-mode.enabled=true``. The two numberings differ as soon
as one content is registered twice; looking a globalId up as a contentId names no schema, or
the wrong one.

Contract: :meth:`GlobalIds.registry_id` finds the artifact version a globalId names through
the native API beside the configured ccompat URL (``/apis/registry/v2/search/artifacts?globalId=``,
then that artifact's versions), and returns the id of the same subject version on the
Confluent-compatible API (``/subjects/{artifactId}/versions/{version}``), so the answer is right
whichever numbering that API uses. Apicurio 2.x's search by globalId finds an artifact by its
latest version only; a globalId it does not find but the registry holds
(``/ids/globalIds/{id}``) is an older version, looked for among the artifacts its content
names (an Avro record's name, a JSON Schema's title: what Apicurio takes as an artifact's
name), then among the :data:`_RECENT` most recently created artifacts of the default
group. Raises ``UnknownSchemaId`` when no version has that globalId (or none found so), or
when it lies outside the default group (which the Confluent-compatible API does not serve),
and ``RegistryUnavailable`` when the registry cannot answer. A globalId names one
immutable version, so callers may keep the answer for as long as they like (the contract
check keeps it in a :class:`~.lookup_cache.LookupCache`). The HTTP requests are bounded
as the registry client's (``registry_http.py``) and use the ``registry:`` settings'
connection, credentials and TLS.
"""

from __future__ import annotations

import json
import re
from typing import Any
from urllib.parse import quote

from .registry import RegistryStats, UnknownSchemaId
from .registry_config import RegistrySettings
from .registry_http import RegistryHttp, RegistryUnavailable

__all__ = ["GlobalIds"]

_PAGE = 500
_MAX_PAGES = 20
_RECENT = 100
"""Artifacts whose versions are looked through for an older version's globalId when its
content names none that holds it (one request each)."""
_CCOMPAT = re.compile(r"(?P<root>.+/apis)(?P<ccompat>/ccompat/v[0-9]+)/?")


class GlobalIds:
    """Apicurio globalIds to Confluent-compatible API ids (see the module docstring)."""

    def __init__(self, settings: RegistrySettings) -> None:
        match = _CCOMPAT.fullmatch(settings.url)
        if match is None:
            raise ValueError(f"registry.url: {settings.url!r} is not an Apicurio Registry's "
                             "Confluent-compatible API (http://HOST:PORT/apis/ccompat/v7)")
        self._ccompat = match["ccompat"]
        # A client rooted at /apis reaches both APIs with the same connection settings.
        self._http = RegistryHttp(settings.model_copy(update={"url": match["root"]}))

    async def registry_id(self, global_id: int) -> int:
        """The Confluent-compatible API's id of the version ``global_id`` names."""
        def unknown(where: str = "") -> UnknownSchemaId:
            return UnknownSchemaId(f"Apicurio global id {global_id} is not registered{where}")

        artifacts = await self._search(f"globalId={int(global_id)}&limit=1")
        if artifacts:  # its latest version
            artifact = artifacts[0]
            group = artifact.get("groupId") or "default"
            if group != "default":
                raise unknown(f" in the default group (it is artifact {artifact['id']} of "
                              f"group {group}, which the Confluent-compatible API does not "
                              "serve)")
            name, version = artifact["id"], await self._version(artifact["id"], global_id,
                                                                unknown)
        else:
            name, version = await self._older(global_id, unknown)
        body = await self._get(f"{self._ccompat}/subjects/{quote(name, safe='')}"
                               f"/versions/{quote(version, safe='')}", unknown)
        schema_id = body.get("id") if isinstance(body, dict) else None
        if not isinstance(schema_id, int):
            raise self._odd("subjects/.../versions", body)
        return schema_id

    async def _search(self, query: str) -> list[dict[str, Any]]:
        found = await self._get(f"/registry/v2/search/artifacts?{query}", UnknownSchemaId)
        artifacts = found.get("artifacts") if isinstance(found, dict) else None
        if not isinstance(artifacts, list) or not all(
                isinstance(a, dict) and isinstance(a.get("id"), str) for a in artifacts):
            raise self._odd("search/artifacts", found)
        return artifacts

    async def _older(self, global_id: int, unknown: Any) -> tuple[str, str]:
        """The artifact and version of ``global_id`` when it is not an artifact's latest
        version (see the module docstring)."""
        content = await self._get(f"/registry/v2/ids/globalIds/{int(global_id)}", unknown,
                                  parse=False)
        looked: set[str] = set()
        for query in (*_named(content), f"orderby=createdOn&order=desc&limit={_RECENT}"):
            for artifact in await self._search(f"group=default&{query}"):
                if artifact["id"] in looked:
                    continue
                looked.add(artifact["id"])
                try:
                    return artifact["id"], await self._version(artifact["id"], global_id,
                                                               UnknownSchemaId)
                except UnknownSchemaId:
                    continue
        raise unknown(f" as a version of the artifacts its content names or the {_RECENT} "
                      "most recently created ones of the default group")

    async def _version(self, artifact: str, global_id: int, unknown: Any) -> str:
        path = f"/registry/v2/groups/default/artifacts/{quote(artifact, safe='')}/versions"
        for page in range(_MAX_PAGES):
            body = await self._get(f"{path}?offset={page * _PAGE}&limit={_PAGE}", unknown)
            versions = body.get("versions") if isinstance(body, dict) else None
            if not isinstance(versions, list):
                raise self._odd("versions", body)
            for item in versions:
                if isinstance(item, dict) and item.get("globalId") == global_id:
                    return str(item.get("version"))
            if len(versions) < _PAGE:
                break
        raise unknown()

    async def _get(self, path: str, unknown: Any, *, parse: bool = True) -> Any:
        return await self._http.get_json(path, unknown=unknown, parse=parse)

    def _odd(self, what: str, body: Any) -> RegistryUnavailable:
        return RegistryUnavailable(f"Apicurio Registry {self._http.settings.url}: the answer "
                                   f"of {what} is not the native API's: {str(body)[:200]}")

    def stats(self) -> RegistryStats:
        """The HTTP counters of the translations (requests, errors, latency)."""
        h = self._http.counts
        return RegistryStats(requests=h.requests, errors=h.errors,
                             latency_sum_s=h.latency_sum_s, latency_count=h.latency_count)

    async def close(self) -> None:
        """Close the HTTP connections."""
        await self._http.close()


def _named(content: bytes) -> list[str]:
    """Search queries for the artifacts a schema's text names: an Avro record's name, a JSON
    Schema's title (Apicurio's artifact name for them); none for other text."""
    try:
        doc = json.loads(content)
    except ValueError:
        return []
    if not isinstance(doc, dict):
        return []
    name = doc.get("name" if doc.get("type") == "record" else "title")
    return [f"name={quote(name, safe='')}&limit={_PAGE}"] if isinstance(name, str) else []
