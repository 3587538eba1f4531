# cython: language_level=3
"""Compiled record codec: the per-record loops of Kafka's magic-2 record batch.

The batch header, CRC-32C and compression live in :mod:`protocol.records`; this
module only turns a records block (already decompressed) into ``Record`` values
and back, because that loop runs once per record and dominates the cost.

All varints are zigzag-encoded (Kafka's ``varint``/``varlong``). Every length
read from the wire is checked against the bytes that remain before it is used.
"""

cimport cython
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.mem cimport PyMem_Free, PyMem_Malloc, PyMem_Realloc
from cpython.tuple cimport PyTuple_New, PyTuple_SET_ITEM
from cpython.ref cimport Py_INCREF
from cpython.unicode cimport PyUnicode_DecodeUTF8
from libc.stdint cimport int32_t, int64_t, uint32_t, uint64_t
from libc.string cimport memcpy

from kiproxy.protocol.errors import CorruptBatch

cdef extern from "Python.h":
    const char* PyUnicode_AsUTF8AndSize(object s, Py_ssize_t* size) except NULL


cdef object _as_bytes(object value, str what):
    if value is None or type(value) is bytes:
        return value
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    raise TypeError(f"{what} must be bytes or None, not {type(value).__name__}")


# Cython would prepend a signature of its own making to these docstrings, and renders
# Record's keyword-only arguments wrongly ("Record(key=None, *, value=None, ...)"); the
# docstrings state the signatures themselves.
@cython.embedsignature(False)
cdef class Header:
    """Header(key, value): one record header (KIP-82), a UTF-8 key and a nullable byte value.

    Keys may repeat within a record and their order is kept end to end.
    """

    cdef readonly str key
    """The header key (never null)."""
    cdef readonly object value
    """The header value, or ``None`` for a null value."""

    def __init__(self, key, value):
        if type(key) is not str:
            raise TypeError(f"header key must be str, not {type(key).__name__}")
        self.key = key
        self.value = _as_bytes(value, "header value")

    def __eq__(self, other):
        if type(other) is not Header:
            return NotImplemented
        cdef Header o = <Header>other
        return self.key == o.key and self.value == o.value

    def __hash__(self):
        return hash((self.key, self.value))

    def __repr__(self):
        return f"Header(key={self.key!r}, value={self.value!r})"

    def __reduce__(self):
        return (Header, (self.key, self.value))

    def __iter__(self):
        yield self.key
        yield self.value


cdef inline Header _new_header(str key, object value):
    cdef Header h = Header.__new__(Header)
    h.key = key
    h.value = value
    return h


@cython.embedsignature(False)
cdef class Record:
    """Record(*, key=None, value=None, headers=(), timestamp=0, offset_delta=0)

    One Kafka record: key, value, headers, timestamp (ms) and offset delta.
    Every argument is keyword-only, as in ``Record(key=b"k", value=b"v")``, like
    the fields of ``RecordBatch``. Immutable; use the ``with_*`` methods to
    derive a changed copy.
    """

    cdef readonly object key
    """The record key, or ``None``."""
    cdef readonly object value
    """The record value, or ``None`` (a tombstone)."""
    cdef readonly tuple headers
    """The headers, in wire order; keys may repeat."""
    cdef readonly int64_t timestamp
    """The record timestamp in milliseconds since the epoch."""
    cdef readonly int32_t offset_delta
    """The record's offset relative to its batch's base offset."""

    def __init__(self, *positional, key=None, value=None, headers=(), int64_t timestamp=0,
                 int32_t offset_delta=0):
        if positional:  # Cython's own message would name __init__, not Record
            raise TypeError(
                f"Record() takes keyword arguments only ({len(positional)} positional given): "
                "Record(key=..., value=..., headers=..., timestamp=..., offset_delta=...)")
        self.key = _as_bytes(key, "record key")
        self.value = _as_bytes(value, "record value")
        self.headers = _as_headers(headers)
        self.timestamp = timestamp
        self.offset_delta = offset_delta

    cdef Record _copy(self):
        cdef Record r = Record.__new__(Record)
        r.key = self.key
        r.value = self.value
        r.headers = self.headers
        r.timestamp = self.timestamp
        r.offset_delta = self.offset_delta
        return r

    def with_key(self, key):
        """A copy of this record with another key."""
        cdef Record r = self._copy()
        r.key = _as_bytes(key, "record key")
        return r

    def with_value(self, value):
        """A copy of this record with another value."""
        cdef Record r = self._copy()
        r.value = _as_bytes(value, "record value")
        return r

    def with_headers(self, headers):
        """A copy of this record with these headers (an iterable of ``Header``)."""
        cdef Record r = self._copy()
        r.headers = _as_headers(headers)
        return r

    def with_header(self, str key, value):
        """A copy of this record with one header appended after the existing ones."""
        cdef Record r = self._copy()
        r.headers = self.headers + (Header(key, value),)
        return r

    def with_timestamp(self, int64_t timestamp):
        """A copy of this record with another timestamp (ms since the epoch)."""
        cdef Record r = self._copy()
        r.timestamp = timestamp
        return r

    def with_offset_delta(self, int32_t offset_delta):
        """A copy of this record with another offset delta."""
        cdef Record r = self._copy()
        r.offset_delta = offset_delta
        return r

    def header_values(self, str key):
        """The values of every header named ``key``, in order."""
        return [h.value for h in self.headers if (<Header>h).key == key]

    def __eq__(self, other):
        if type(other) is not Record:
            return NotImplemented
        cdef Record o = <Record>other
        return (self.timestamp == o.timestamp and self.offset_delta == o.offset_delta
                and self.key == o.key and self.value == o.value and self.headers == o.headers)

    def __hash__(self):
        return hash((self.key, self.value, self.headers, self.timestamp, self.offset_delta))

    def __repr__(self):
        return (f"Record(key={self.key!r}, value={self.value!r}, headers={self.headers!r}, "
                f"timestamp={self.timestamp}, offset_delta={self.offset_delta})")

    def __reduce__(self):
        return (_record_from_state,
                (self.key, self.value, self.headers, self.timestamp, self.offset_delta))


def _record_from_state(key, value, headers, timestamp, offset_delta):
    return Record(key=key, value=value, headers=headers, timestamp=timestamp,
                  offset_delta=offset_delta)


cdef tuple _as_headers(object headers):
    cdef list out = []
    for h in headers:
        if type(h) is Header:
            out.append(h)
        elif isinstance(h, tuple) and len(h) == 2:
            out.append(Header(h[0], h[1]))
        else:
            raise TypeError(f"headers must be Header values or (str, bytes | None) pairs, got {h!r}")
    return tuple(out)


# ---------------------------------------------------------------- decoding

cdef struct Cursor:
    const unsigned char* data
    Py_ssize_t pos
    Py_ssize_t end


cdef int _fail(str message) except -1:
    raise CorruptBatch(message)


cdef inline int64_t _read_varlong(Cursor* c, const char* field, Py_ssize_t record_no) except? -1:
    cdef uint64_t result = 0
    cdef int shift = 0
    cdef unsigned char b
    cdef Py_ssize_t start = c.pos
    while True:
        if c.pos >= c.end:
            _fail(f"record {record_no}: {field.decode()} varint truncated at byte {start}")
        b = c.data[c.pos]
        c.pos += 1
        result |= (<uint64_t>(b & 0x7F)) << shift
        if not (b & 0x80):
            break
        shift += 7
        if shift > 63:
            _fail(f"record {record_no}: {field.decode()} varint at byte {start} is longer than 10 bytes")
    return <int64_t>((result >> 1) ^ (~(result & 1) + 1))


cdef inline int32_t _read_varint(Cursor* c, const char* field, Py_ssize_t record_no) except? -1:
    cdef uint32_t result = 0
    cdef int shift = 0
    cdef unsigned char b
    cdef Py_ssize_t start = c.pos
    while True:
        if c.pos >= c.end:
            _fail(f"record {record_no}: {field.decode()} varint truncated at byte {start}")
        b = c.data[c.pos]
        c.pos += 1
        if shift == 28 and (b & 0xF0):
            _fail(f"record {record_no}: {field.decode()} varint at byte {start} overflows 32 bits")
        result |= (<uint32_t>(b & 0x7F)) << shift
        if not (b & 0x80):
            break
        shift += 7
    return <int32_t>((result >> 1) ^ (~(result & 1) + 1))


cdef inline object _read_bytes(Cursor* c, const char* field, Py_ssize_t record_no):
    cdef Py_ssize_t start = c.pos
    cdef int32_t n = _read_varint(c, field, record_no)
    if n == -1:
        return None
    if n < -1:
        _fail(f"record {record_no}: {field.decode()} length {n} at byte {start} is negative")
    if n > c.end - c.pos:
        _fail(f"record {record_no}: {field.decode()} length {n} at byte {start} "
              f"exceeds the {c.end - c.pos} bytes left")
    cdef object out = PyBytes_FromStringAndSize(<const char*>c.data + c.pos, n)
    c.pos += n
    return out


def decode_records(bytes data, Py_ssize_t start, Py_ssize_t end, Py_ssize_t count,
                   int64_t base_timestamp):
    """Decode ``count`` records from ``data[start:end]`` into a tuple of ``Record``.

    The block must hold exactly ``count`` records; anything else raises
    :class:`protocol.errors.CorruptBatch` naming the record and byte offset.
    """
    if start < 0 or end > PyBytes_GET_SIZE(data) or start > end:
        raise ValueError("records block bounds are outside the buffer")
    if count < 0:
        _fail(f"record count {count} is negative")
    # Each record takes at least 7 bytes, so a count beyond that is a lie we must
    # not allocate for.
    if count > (end - start) // 7 + 1:
        _fail(f"record count {count} cannot fit in {end - start} bytes of records")
    cdef Cursor c
    c.data = <const unsigned char*>PyBytes_AS_STRING(data)
    c.pos = start
    c.end = end
    cdef tuple out = PyTuple_New(count)
    cdef Py_ssize_t i, j, record_end, record_start, nh, hstart
    cdef int32_t length, klen
    cdef Record r
    cdef list headers
    cdef str hkey
    cdef tuple htuple
    cdef Header h
    for i in range(count):
        record_start = c.pos
        length = _read_varint(&c, b"record length", i)
        if length < 0 or length > c.end - c.pos:
            _fail(f"record {i}: length {length} at byte {record_start} "
                  f"does not fit the {c.end - c.pos} bytes left")
        record_end = c.pos + length
        c.end = record_end
        if c.pos >= c.end:
            _fail(f"record {i}: attributes missing at byte {c.pos}")
        c.pos += 1  # record attributes: unused in magic 2
        r = Record.__new__(Record)
        r.timestamp = base_timestamp + _read_varlong(&c, b"timestamp delta", i)
        r.offset_delta = _read_varint(&c, b"offset delta", i)
        r.key = _read_bytes(&c, b"key", i)
        r.value = _read_bytes(&c, b"value", i)
        hstart = c.pos
        nh = _read_varint(&c, b"header count", i)
        if nh < 0 or nh > c.end - c.pos:
            _fail(f"record {i}: header count {nh} at byte {hstart} is impossible")
        if nh == 0:
            r.headers = ()
        else:
            htuple = PyTuple_New(nh)
            for j in range(nh):
                hstart = c.pos
                klen = _read_varint(&c, b"header key length", i)
                if klen < 0 or klen > c.end - c.pos:
                    _fail(f"record {i}: header {j} key length {klen} at byte {hstart} is impossible")
                try:
                    hkey = PyUnicode_DecodeUTF8(<const char*>c.data + c.pos, klen, NULL)
                except UnicodeDecodeError:
                    _fail(f"record {i}: header {j} key at byte {c.pos} is not valid UTF-8")
                c.pos += klen
                h = _new_header(hkey, _read_bytes(&c, b"header value", i))
                Py_INCREF(h)
                PyTuple_SET_ITEM(htuple, j, h)
            r.headers = htuple
        if c.pos != record_end:
            _fail(f"record {i}: declared length {length} at byte {record_start} "
                  f"but its fields end at byte {c.pos}")
        c.end = end
        Py_INCREF(r)
        PyTuple_SET_ITEM(out, i, r)
    if c.pos != end:
        _fail(f"{end - c.pos} bytes left over after the batch's {count} records (byte {c.pos})")
    return out


# ---------------------------------------------------------------- encoding

cdef struct Buffer:
    char* data
    Py_ssize_t size
    Py_ssize_t cap


cdef int _reserve(Buffer* b, Py_ssize_t extra) except -1:
    cdef Py_ssize_t need = b.size + extra
    cdef Py_ssize_t cap
    cdef char* grown
    if need <= b.cap:
        return 0
    cap = b.cap * 2
    if cap < need:
        cap = need
    grown = <char*>PyMem_Realloc(b.data, cap)
    if grown == NULL:
        raise MemoryError()
    b.data = grown
    b.cap = cap
    return 0


cdef inline Py_ssize_t _varint_size(uint64_t zz) noexcept:
    cdef Py_ssize_t n = 1
    while zz >= 0x80:
        zz >>= 7
        n += 1
    return n


cdef inline uint64_t _zigzag64(int64_t v) noexcept:
    return (<uint64_t>v << 1) ^ <uint64_t>(v >> 63)


cdef inline void _put_uvarint(Buffer* b, uint64_t zz) noexcept:
    while zz >= 0x80:
        b.data[b.size] = <char>((zz & 0x7F) | 0x80)
        b.size += 1
        zz >>= 7
    b.data[b.size] = <char>zz
    b.size += 1


cdef inline Py_ssize_t _bytes_len(object v) noexcept:
    return -1 if v is None else PyBytes_GET_SIZE(v)


cdef inline void _put_bytes(Buffer* b, object v) noexcept:
    cdef Py_ssize_t n
    if v is None:
        _put_uvarint(b, 1)  # zigzag(-1)
        return
    n = PyBytes_GET_SIZE(v)
    _put_uvarint(b, _zigzag64(n))
    memcpy(b.data + b.size, PyBytes_AS_STRING(v), n)
    b.size += n


def encode_records(tuple records, int64_t base_timestamp, bint renumber):
    """Encode ``records`` as a magic-2 records block.

    Timestamps are written as deltas from ``base_timestamp``. With ``renumber``
    the offset deltas are written as 0..n-1, which is what a producer must send.
    Returns ``(block, max_timestamp)``; ``max_timestamp`` is ``None`` for no records.
    """
    cdef Buffer b
    b.cap = 64 + 64 * len(records)
    b.size = 0
    b.data = <char*>PyMem_Malloc(b.cap)
    if b.data == NULL:
        raise MemoryError()
    cdef Py_ssize_t i = 0, body, klen, vlen, nh, j
    cdef Py_ssize_t hk_len, hv_len
    cdef int64_t ts_delta, max_ts = 0
    cdef int32_t off
    cdef Record r
    cdef Header h
    cdef const char* hk
    try:
        for item in records:
            if type(item) is not Record:
                raise TypeError(f"record {i} is a {type(item).__name__}, not a Record")
            r = <Record>item
            ts_delta = r.timestamp - base_timestamp
            if i == 0 or r.timestamp > max_ts:
                max_ts = r.timestamp
            off = <int32_t>i if renumber else r.offset_delta
            klen = _bytes_len(r.key)
            vlen = _bytes_len(r.value)
            nh = len(r.headers)
            body = (1 + _varint_size(_zigzag64(ts_delta)) + _varint_size(_zigzag64(off))
                    + _varint_size(_zigzag64(klen)) + (klen if klen > 0 else 0)
                    + _varint_size(_zigzag64(vlen)) + (vlen if vlen > 0 else 0)
                    + _varint_size(_zigzag64(nh)))
            for h in r.headers:
                PyUnicode_AsUTF8AndSize(h.key, &hk_len)
                hv_len = _bytes_len(h.value)
                body += (_varint_size(_zigzag64(hk_len)) + hk_len
                         + _varint_size(_zigzag64(hv_len)) + (hv_len if hv_len > 0 else 0))
            if body > 0x7FFFFFFF:
                raise ValueError(f"record {i} is larger than 2 GiB")
            _reserve(&b, body + 5)
            _put_uvarint(&b, _zigzag64(body))
            b.data[b.size] = 0
            b.size += 1
            _put_uvarint(&b, _zigzag64(ts_delta))
            _put_uvarint(&b, _zigzag64(off))
            _put_bytes(&b, r.key)
            _put_bytes(&b, r.value)
            _put_uvarint(&b, _zigzag64(nh))
            for h in r.headers:
                hk = PyUnicode_AsUTF8AndSize(h.key, &hk_len)
                _put_uvarint(&b, _zigzag64(hk_len))
                memcpy(b.data + b.size, hk, hk_len)
                b.size += hk_len
                _put_bytes(&b, h.value)
            i += 1
        return PyBytes_FromStringAndSize(b.data, b.size), (max_ts if i else None)
    finally:
        PyMem_Free(b.data)
