"""The upstream cluster: broker nodes and their listeners, upstream connections and
their failures, discovery, address rewriting and ApiVersions; may import config,
observe and net."""
