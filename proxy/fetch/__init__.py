"""The fetch path: a Fetch answer's hooked partitions run through their routes' fetch-side
hooks (:mod:`.pipeline`, each batch through them a :mod:`.source`); may import observe, routes, net and produce (its decode
offload)."""
