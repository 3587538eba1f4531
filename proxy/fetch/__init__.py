"""The fetch path: a Fetch answer's hooked partitions run through their routes' fetch-side
hooks (:mod:`.pipeline`; each batch on its way, :mod:`.source`); may import observe,
routes, net and produce (its decode offload)."""
