"""kiproxy's public plugin API.

Write a subclass of :class:`ProduceRequestInterceptor`, drop its module into the
plugins directory and name it as ``module:Class`` in the config::

    from kiproxy.interceptors import ProduceRequestInterceptor, RecordBatch, RejectBatch

    class Uppercase(ProduceRequestInterceptor):
        def intercept(self, batch, ctx):
            return batch.with_records(
                r.with_value(r.value.upper()) if r.value is not None else r
                for r in batch.records
            )
"""

from kiproxy.interceptors.api import (
    ERROR_CODES,
    AcknowledgedBatch,
    ClientIdentity,
    ErrorCode,
    Header,
    InterceptContext,
    MetricSample,
    PluginFactory,
    PluginSettings,
    ProduceRequestInterceptor,
    Record,
    RecordBatch,
    RejectBatch,
    error_code,
    header_key_text,
)
from kiproxy.interceptors.consume import (
    ConsumeContext,
    ConsumedBatch,
    ConsumedBlock,
    FetchResponseInterceptor,
    RefuseFetch,
)
from kiproxy.interceptors.topics import TopicPattern, TopicSelector

__all__ = [
    "ERROR_CODES",
    "AcknowledgedBatch",
    "ClientIdentity",
    "ConsumeContext",
    "ConsumedBatch",
    "ConsumedBlock",
    "ErrorCode",
    "FetchResponseInterceptor",
    "Header",
    "InterceptContext",
    "MetricSample",
    "PluginFactory",
    "PluginSettings",
    "ProduceRequestInterceptor",
    "Record",
    "RecordBatch",
    "RefuseFetch",
    "RejectBatch",
    "TopicPattern",
    "TopicSelector",
    "error_code",
    "header_key_text",
]
