"""The asyncio runtime: the server, its connections and the API-key dispatcher at the
top, over the packages config, reload, observe, isolation, routes, net, brokers,
produce and fetch (``tests/unit/test_import_graph.py`` checks their order); the CLI of ``run``."""
