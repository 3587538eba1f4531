"""PySpark jobs: replay an interceptor over a topic's history, and audit reports.

``kiproxy replay`` (:mod:`pipelines.replay`) and ``kiproxy report``
(:mod:`pipelines.report`), wired up by :mod:`pipelines.cli`. The pieces, in the
order a replay uses them: :mod:`pipelines.session` (Java check, SparkSession,
shipping plugins), :mod:`pipelines.offsets` (what to read),
:mod:`pipelines.fetch_client` (stored batches over the Kafka protocol),
:mod:`pipelines.sources` (readers), :mod:`pipelines.apply` (the interceptor, with
the proxy's rules), :mod:`pipelines.tally` (counts), :mod:`pipelines.charts` and
:mod:`pipelines.html_pages` (the reports), :mod:`pipelines.progress` (the console bar).
Nothing here is imported by ``kiproxy run``.
"""
