"""Benchmarks: the record codec and the proxy end to end."""
