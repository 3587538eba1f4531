"""The metrics listener and who may use its admin actions: ``/metrics``, the health
checks, ``/config`` and ``POST /reload`` over HTTP; may import config and observe."""
