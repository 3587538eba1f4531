"""The produce path: the pipeline, the per-partition step, the response merge, the
decode offload and the request's disposition (forward or answer); may import config,
observe, isolation, routes, net and brokers."""
