"""PySpark jobs: replay an interceptor over a topic's history, and audit reports."""
