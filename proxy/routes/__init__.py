"""Which chain of interceptors a batch goes through (the compiled route table, the
interceptors loaded per route, running a chain); may import config, observe and
isolation."""
