"""The asyncio runtime: listeners, connections, routing, the produce pipeline and the CLI."""
