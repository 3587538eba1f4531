# cython: language_level=3
"""Compiled record codec: the per-record loops of Kafka's magic-2 record batch.

The batch header, CRC-32C and compression live in :mod:`protocol.records`; this
module only turns a records block (already decompressed) into ``Record`` values
and back, because that loop runs once per record and dominates the cost.

All varints are zigzag-encoded (Kafka's ``varint``/``varlong``). Every length
read from the wire is checked against the bytes that remain before it is used.

Decoding validates every record completely (lengths, varints) but builds a
record's key, value and headers only when they are first read: a
decoded ``Record`` holds the records block and where its fields lie. An
interceptor that returns the batch untouched never pays for them, and encoding
copies a field nobody read straight from the block it came from.
"""

cimport cython

from cpython.bytearray cimport PyByteArray_FromStringAndSize
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from cpython.tuple cimport PyTuple_New, PyTuple_SET_ITEM
from cpython.ref cimport Py_INCREF
from cpython.unicode cimport PyUnicode_DecodeUTF8
from libc.stdint cimport int32_t, int64_t, uint32_t, uint64_t
from libc.string cimport memcmp, memcpy

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
@cython.no_gc
@cython.freelist(64)
cdef class Header:
    """Header(key, value): one record header (KIP-82), a text key and a nullable byte value.

    Keys may repeat within a record and their order is kept end to end. A key is UTF-8
    on the wire; brokers store whatever bytes a client sent, and the bytes of a stored
    key that are not UTF-8 are read as lone surrogates (``surrogateescape``, as
    :func:`os.fsdecode` reads file names) and written back as those same bytes.
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


cdef enum:
    _LAZY_KEY = 1
    _LAZY_VALUE = 2
    _LAZY_HEADERS = 4


# Records hold only bytes, str, ints and tuples of Header: they cannot form a cycle,
# so they stay out of the cyclic GC (whose gen-0 runs their allocations would trigger).
@cython.embedsignature(False)
@cython.no_gc
@cython.freelist(256)
cdef class Record:
    """Record(*, key=None, value=None, headers=(), timestamp=0, offset_delta=0)

    One Kafka record: key, value, headers, timestamp (ms) and offset delta.
    Every argument is keyword-only, as in ``Record(key=b"k", value=b"v")``, like
    the fields of ``RecordBatch``. Immutable; use the ``with_*`` methods to
    derive a changed copy.
    """

    cdef object _key
    cdef object _value
    cdef tuple _headers
    cdef readonly int64_t timestamp
    """The record timestamp in milliseconds since the epoch."""
    cdef readonly int32_t offset_delta
    """The record's offset relative to its batch's base offset."""
    # A decoded record's fields not built yet (_LAZY_* bits) lie in _block:
    cdef int _lazy
    cdef bytes _block
    cdef Py_ssize_t _key_at, _value_at, _headers_at, _headers_end
    cdef int32_t _key_len, _value_len

    def __init__(self, *positional, key=None, value=None, headers=(), int64_t timestamp=0,
                 int32_t offset_delta=0):
        if positional:  # Cython's own message would name __init__, not Record
            raise TypeError(
                f"Record() takes keyword arguments only ({len(positional)} positional given): "
                "Record(key=..., value=..., headers=..., timestamp=..., offset_delta=...)")
        self._key = _as_bytes(key, "record key")
        self._value = _as_bytes(value, "record value")
        self._headers = _as_headers(headers)
        self.timestamp = timestamp
        self.offset_delta = offset_delta
        self._lazy = 0
        self._block = None

    @property
    def key(self):
        """The record key, or ``None``."""
        if self._lazy & _LAZY_KEY:
            self._key = self._slice(self._key_at, self._key_len)
            self._built(_LAZY_KEY)
        return self._key

    @property
    def value(self):
        """The record value, or ``None`` (a tombstone)."""
        if self._lazy & _LAZY_VALUE:
            self._value = self._slice(self._value_at, self._value_len)
            self._built(_LAZY_VALUE)
        return self._value

    @property
    def headers(self):
        """The headers, in wire order; keys may repeat."""
        if self._lazy & _LAZY_HEADERS:
            self._headers = _decode_headers(self._block, self._headers_at, self._headers_end)
            self._built(_LAZY_HEADERS)
        return self._headers

    cdef inline object _slice(self, Py_ssize_t at, int32_t n):
        if n < 0:
            return None
        return PyBytes_FromStringAndSize(PyBytes_AS_STRING(self._block) + at, n)

    cdef inline void _built(self, int bit):
        self._lazy &= ~bit
        if not self._lazy:
            self._block = None  # every field built: the block is no longer needed

    cdef Record _copy(self):
        cdef Record r = Record.__new__(Record)
        r._key = self._key
        r._value = self._value
        r._headers = self._headers
        r.timestamp = self.timestamp
        r.offset_delta = self.offset_delta
        r._lazy = self._lazy
        r._block = self._block
        r._key_at = self._key_at
        r._key_len = self._key_len
        r._value_at = self._value_at
        r._value_len = self._value_len
        r._headers_at = self._headers_at
        r._headers_end = self._headers_end
        return r

    def with_key(self, key):
        """A copy of this record with another key."""
        cdef Record r = self._copy()
        r._key = _as_bytes(key, "record key")
        r._built(_LAZY_KEY)
        return r

    def with_value(self, value):
        """A copy of this record with another value."""
        cdef Record r = self._copy()
        r._value = _as_bytes(value, "record value")
        r._built(_LAZY_VALUE)
        return r

    def with_headers(self, headers):
        """A copy of this record with these headers (an iterable of ``Header``)."""
        cdef Record r = self._copy()
        r._headers = _as_headers(headers)
        r._built(_LAZY_HEADERS)
        return r

    def with_header(self, str key, value):
        """A copy of this record with one header appended after the existing ones."""
        cdef Record r = self._copy()
        r._headers = self.headers + (Header(key, value),)
        r._built(_LAZY_HEADERS)
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

    cdef inline bint _same_span(self, Record o, int bit):
        """Whether a field neither record has built lies at the same place of one block."""
        if not (self._lazy & o._lazy & bit) or self._block is not o._block:
            return False
        if bit == _LAZY_KEY:
            return self._key_at == o._key_at and self._key_len == o._key_len
        if bit == _LAZY_VALUE:
            return self._value_at == o._value_at and self._value_len == o._value_len
        return self._headers_at == o._headers_at and self._headers_end == o._headers_end

    def __eq__(self, other):
        if type(other) is not Record:
            return NotImplemented
        cdef Record o = <Record>other
        if self is o:
            return True
        # A plugin that copied records without changing them (the verdict's "equal in
        # every field") is told apart without building the fields it never read.
        return (self.timestamp == o.timestamp and self.offset_delta == o.offset_delta
                and (self._same_span(o, _LAZY_KEY) or self.key == o.key)
                and (self._same_span(o, _LAZY_VALUE) or self.value == o.value)
                and (self._same_span(o, _LAZY_HEADERS) or self.headers == o.headers))

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
    if type(headers) is tuple:
        for h in <tuple>headers:
            if type(h) is not Header:
                break
        else:
            return <tuple>headers  # already a tuple of Header (r.headers + added)
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
    Py_ssize_t origin  # error messages count bytes from here


cdef int _fail(str message) except -1:
    raise CorruptBatch(message)


cdef inline int64_t _read_varlong(Cursor* c, const char* field, Py_ssize_t record_no) except? -1:
    cdef uint64_t result = 0
    cdef int shift = 0
    cdef unsigned char b
    cdef Py_ssize_t start = c.pos
    while True:
        if c.pos >= c.end:
            _fail(f"record {record_no}: {field.decode()} varint truncated at byte {start - c.origin}")
        b = c.data[c.pos]
        c.pos += 1
        result |= (<uint64_t>(b & 0x7F)) << shift
        if not (b & 0x80):
            break
        shift += 7
        if shift > 63:
            _fail(f"record {record_no}: {field.decode()} varint at byte {start - c.origin} is longer than 10 bytes")
    return <int64_t>((result >> 1) ^ (~(result & 1) + 1))


cdef inline int32_t _read_varint(Cursor* c, const char* field, Py_ssize_t record_no) except? -1:
    cdef uint32_t result = 0
    cdef int shift = 0
    cdef unsigned char b
    cdef Py_ssize_t start = c.pos
    while True:
        if c.pos >= c.end:
            _fail(f"record {record_no}: {field.decode()} varint truncated at byte {start - c.origin}")
        b = c.data[c.pos]
        c.pos += 1
        if shift == 28 and (b & 0xF0):
            _fail(f"record {record_no}: {field.decode()} varint at byte {start - c.origin} overflows 32 bits")
        result |= (<uint32_t>(b & 0x7F)) << shift
        if not (b & 0x80):
            break
        shift += 7
    return <int32_t>((result >> 1) ^ (~(result & 1) + 1))


cdef inline int32_t _skip_bytes(Cursor* c, const char* field, Py_ssize_t record_no,
                                 Py_ssize_t* at) except? -2:
    """Check a nullable bytes field; return its length (-1: null), its start in ``at``."""
    cdef Py_ssize_t start = c.pos
    cdef int32_t n = _read_varint(c, field, record_no)
    at[0] = c.pos
    if n == -1:
        return -1
    if n < -1:
        _fail(f"record {record_no}: {field.decode()} length {n} at byte {start - c.origin} is negative")
    if n > c.end - c.pos:
        _fail(f"record {record_no}: {field.decode()} length {n} at byte {start - c.origin} "
              f"exceeds the {c.end - c.pos} bytes left")
    c.pos += n
    return n


cdef inline bint _utf8_valid(const unsigned char* s, Py_ssize_t n) noexcept:
    """Whether ``s[:n]`` is UTF-8 that Python's strict decoder accepts (RFC 3629:
    no overlong forms, no surrogates, nothing above U+10FFFF)."""
    cdef Py_ssize_t i = 0
    cdef unsigned char b
    while i < n:
        b = s[i]
        if b < 0x80:
            i += 1
        elif 0xC2 <= b <= 0xDF:
            if i + 1 >= n or (s[i + 1] & 0xC0) != 0x80:
                return False
            i += 2
        elif 0xE0 <= b <= 0xEF:
            if i + 2 >= n or (s[i + 1] & 0xC0) != 0x80 or (s[i + 2] & 0xC0) != 0x80:
                return False
            if (b == 0xE0 and s[i + 1] < 0xA0) or (b == 0xED and s[i + 1] > 0x9F):
                return False
            i += 3
        elif 0xF0 <= b <= 0xF4:
            if (i + 3 >= n or (s[i + 1] & 0xC0) != 0x80 or (s[i + 2] & 0xC0) != 0x80
                    or (s[i + 3] & 0xC0) != 0x80):
                return False
            if (b == 0xF0 and s[i + 1] < 0x90) or (b == 0xF4 and s[i + 1] > 0x8F):
                return False
            i += 4
        else:
            return False
    return True


cdef tuple _decode_headers(bytes block, Py_ssize_t at, Py_ssize_t end):
    """The headers of a record whose header count starts at ``block[at]`` (validated
    by :func:`decode_records`)."""
    cdef Cursor c
    c.data = <const unsigned char*>PyBytes_AS_STRING(block)
    c.pos = at
    c.end = end
    c.origin = 0
    cdef Py_ssize_t nh = _read_varint(&c, b"header count", 0)
    cdef Py_ssize_t j, vat
    cdef int32_t klen, vlen
    cdef tuple out = PyTuple_New(nh)
    cdef Header h
    for j in range(nh):
        klen = _read_varint(&c, b"header key length", 0)
        key = PyUnicode_DecodeUTF8(<const char*>c.data + c.pos, klen, "surrogateescape")
        c.pos += klen
        vlen = _skip_bytes(&c, b"header value", 0, &vat)
        h = _new_header(key, None if vlen < 0 else
                        PyBytes_FromStringAndSize(<const char*>c.data + vat, vlen))
        Py_INCREF(h)
        PyTuple_SET_ITEM(out, j, h)
    return out


cdef struct _Span:
    # Where one record's fields lie in its records block (see _walk).
    Py_ssize_t start        # its length varint
    Py_ssize_t body         # its attributes byte, right after the length
    Py_ssize_t end          # the byte after its last header
    int64_t ts_delta
    int32_t offset_delta
    int32_t key_len         # -1: null
    Py_ssize_t key_at
    Py_ssize_t value_field  # the value's length varint
    int32_t value_len       # -1: null
    Py_ssize_t value_at
    Py_ssize_t headers_at   # the header count varint
    Py_ssize_t nh


cdef enum:
    _BAD_LENGTH = 1
    _BAD_ATTRIBUTES = 2
    _BAD_HEADER_COUNT = 3
    _BAD_KEY_LENGTH = 4
    _BAD_END = 6


cdef int _bad_record(int what, Py_ssize_t i, Py_ssize_t j, Py_ssize_t n, Py_ssize_t at,
                     Py_ssize_t other) except -1:
    """Raise the error ``_walk`` found (kept out of it, so that it stays small enough to
    be inlined into the loops that call it)."""
    if what == _BAD_LENGTH:
        _fail(f"record {i}: length {n} at byte {at} does not fit the {other} bytes left")
    if what == _BAD_ATTRIBUTES:
        _fail(f"record {i}: attributes missing at byte {at}")
    if what == _BAD_HEADER_COUNT:
        _fail(f"record {i}: header count {n} at byte {at} is impossible")
    if what == _BAD_KEY_LENGTH:
        _fail(f"record {i}: header {j} key length {n} at byte {at} is impossible")
    _fail(f"record {i}: declared length {n} at byte {at} but its fields end at byte {other}")


cdef inline int _walk(Cursor* c, Py_ssize_t i, _Span* s) except -1:
    """Check record ``i`` at ``c.pos`` completely (lengths, varints),
    say where its fields lie in ``s`` and move ``c`` past it."""
    cdef Py_ssize_t outer = c.end, j, hstart, at
    cdef int32_t length, klen
    s.start = c.pos
    length = _read_varint(c, b"record length", i)
    if length < 0 or length > c.end - c.pos:
        _bad_record(_BAD_LENGTH, i, 0, length, s.start - c.origin, c.end - c.pos)
    s.body = c.pos
    s.end = c.pos + length
    c.end = s.end
    if c.pos >= c.end:
        _bad_record(_BAD_ATTRIBUTES, i, 0, 0, c.pos - c.origin, 0)
    c.pos += 1  # record attributes: unused in magic 2
    s.ts_delta = _read_varlong(c, b"timestamp delta", i)
    s.offset_delta = _read_varint(c, b"offset delta", i)
    s.key_len = _skip_bytes(c, b"key", i, &at)
    s.key_at = at
    s.value_field = c.pos
    s.value_len = _skip_bytes(c, b"value", i, &at)
    s.value_at = at
    s.headers_at = hstart = c.pos
    s.nh = _read_varint(c, b"header count", i)
    if s.nh < 0 or s.nh > c.end - c.pos:
        _bad_record(_BAD_HEADER_COUNT, i, 0, s.nh, hstart - c.origin, 0)
    for j in range(s.nh):
        hstart = c.pos
        klen = _read_varint(c, b"header key length", i)
        if klen < 0 or klen > c.end - c.pos:
            _bad_record(_BAD_KEY_LENGTH, i, j, klen, hstart - c.origin, 0)
        c.pos += klen
        _skip_bytes(c, b"header value", i, &at)
    if c.pos != s.end:
        _bad_record(_BAD_END, i, 0, length, s.start - c.origin, c.pos - c.origin)
    c.end = outer
    return 0


def decode_records(bytes data, Py_ssize_t start, Py_ssize_t end, Py_ssize_t count,
                   int64_t base_timestamp, Py_ssize_t origin=0):
    """Decode ``count`` records from ``data[start:end]`` into a tuple of ``Record``.

    The block must hold exactly ``count`` records; anything else raises
    :class:`protocol.errors.CorruptBatch` naming the record and byte offset (counted
    from ``data[origin]``). Every field is checked here; keys, values and headers are
    built when first read.
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
    c.origin = origin
    cdef tuple out = PyTuple_New(count)
    cdef Py_ssize_t i
    cdef _Span s
    cdef Record r
    for i in range(count):
        _walk(&c, i, &s)
        r = Record.__new__(Record)
        r._block = data
        r.timestamp = base_timestamp + s.ts_delta
        r.offset_delta = s.offset_delta
        r._key_len = s.key_len
        r._key_at = s.key_at
        r._value_len = s.value_len
        r._value_at = s.value_at
        r._headers_at = s.headers_at
        r._headers_end = s.end
        if s.nh == 0:
            r._headers = ()
            r._lazy = _LAZY_KEY | _LAZY_VALUE
        else:
            r._lazy = _LAZY_KEY | _LAZY_VALUE | _LAZY_HEADERS
        Py_INCREF(r)
        PyTuple_SET_ITEM(out, i, r)
    if c.pos != end:
        _fail(f"{end - c.pos} bytes left over after the batch's {count} records (byte {c.pos})")
    return out


# ---------------------------------------------------------------- frames and headers

include "_frames.pxi"
include "_produce.pxi"
include "_slots.pxi"


# ---------------------------------------------------------------- encoding

cdef struct Buffer:
    char* data
    Py_ssize_t size
    Py_ssize_t cap


cdef inline Py_ssize_t _varint_size(uint64_t zz) noexcept nogil:
    cdef Py_ssize_t n = 1
    while zz >= 0x80:
        zz >>= 7
        n += 1
    return n


cdef inline uint64_t _zigzag64(int64_t v) noexcept nogil:
    return (<uint64_t>v << 1) ^ <uint64_t>(v >> 63)


cdef inline void _put_uvarint(Buffer* b, uint64_t zz) noexcept nogil:
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


cdef inline Py_ssize_t _field_size(Py_ssize_t n) noexcept:
    """Bytes of a nullable bytes field of length ``n`` (-1: null) on the wire."""
    return _varint_size(_zigzag64(n)) + (n if n > 0 else 0)


cdef inline void _put_span(char* out, Py_ssize_t* pos, const char* src, Py_ssize_t n) noexcept:
    """A nullable bytes field of length ``n`` (-1: null) whose bytes are at ``src``."""
    cdef Buffer b
    b.data = out
    b.size = pos[0]
    _put_uvarint(&b, _zigzag64(n))
    if n > 0:
        memcpy(b.data + b.size, src, n)
        b.size += n
    pos[0] = b.size


cdef Py_ssize_t _record_body(Record r, int64_t ts_delta, int32_t off) except -1:
    """Bytes of ``r`` on the wire after its length varint."""
    cdef Py_ssize_t klen, vlen, hk_len, hv_len
    cdef Py_ssize_t body = 1 + _varint_size(_zigzag64(ts_delta)) + _varint_size(_zigzag64(off))
    cdef Header h
    klen = r._key_len if r._lazy & _LAZY_KEY else _bytes_len(r._key)
    vlen = r._value_len if r._lazy & _LAZY_VALUE else _bytes_len(r._value)
    body += _field_size(klen) + _field_size(vlen)
    if r._lazy & _LAZY_HEADERS:
        return body + r._headers_end - r._headers_at
    body += _varint_size(_zigzag64(len(r._headers)))
    for h in r._headers:
        try:
            PyUnicode_AsUTF8AndSize(h.key, &hk_len)
        except UnicodeEncodeError:
            hk_len = PyBytes_GET_SIZE(_escaped_key(h.key))
        hv_len = _bytes_len(h.value)
        body += _varint_size(_zigzag64(hk_len)) + hk_len + _field_size(hv_len)
    return body


cdef bytes _escaped_key(str key):
    """The bytes of a header key that is not UTF-8 text: its lone surrogates U+DC80 to
    U+DCFF written as the bytes they stand for (how a stored key that is not UTF-8 is
    read); any other surrogate raises UnicodeEncodeError, as ``str.encode`` does."""
    return key.encode("utf-8", "surrogateescape")


cdef int _write_record(char* out, Py_ssize_t* pos, Record r, Py_ssize_t body,
                       int64_t ts_delta, int32_t off) except -1:
    """Write ``r`` (length varint first); fields not built are copied from its block."""
    cdef Buffer b
    cdef Header h
    cdef Py_ssize_t hk_len
    cdef const char* hk
    cdef bytes escaped
    cdef const char* block = NULL
    if r._lazy:
        block = PyBytes_AS_STRING(r._block)
    b.data = out
    b.size = pos[0]
    _put_uvarint(&b, _zigzag64(body))
    b.data[b.size] = 0
    b.size += 1
    _put_uvarint(&b, _zigzag64(ts_delta))
    _put_uvarint(&b, _zigzag64(off))
    if r._lazy & _LAZY_KEY:
        _put_span(b.data, &b.size, block + r._key_at, r._key_len)
    else:
        _put_bytes(&b, r._key)
    if r._lazy & _LAZY_VALUE:
        _put_span(b.data, &b.size, block + r._value_at, r._value_len)
    else:
        _put_bytes(&b, r._value)
    if r._lazy & _LAZY_HEADERS:
        memcpy(b.data + b.size, block + r._headers_at, r._headers_end - r._headers_at)
        b.size += r._headers_end - r._headers_at
    else:
        _put_uvarint(&b, _zigzag64(len(r._headers)))
        for h in r._headers:
            try:
                hk = PyUnicode_AsUTF8AndSize(h.key, &hk_len)
            except UnicodeEncodeError:
                escaped = _escaped_key(h.key)
                hk = PyBytes_AS_STRING(escaped)
                hk_len = PyBytes_GET_SIZE(escaped)
            _put_uvarint(&b, _zigzag64(hk_len))
            memcpy(b.data + b.size, hk, hk_len)
            b.size += hk_len
            _put_bytes(&b, h.value)
    pos[0] = b.size
    return 0


def encode_records(tuple records, int64_t base_timestamp, bint renumber):
    """Encode ``records`` as a magic-2 records block.

    Timestamps are written as deltas from ``base_timestamp``. With ``renumber``
    the offset deltas are written as 0..n-1, which is what a producer must send.
    Returns ``(block, max_timestamp)``; ``max_timestamp`` is ``None`` for no records.
    The block's size is computed first and the records written straight into it.
    """
    cdef Py_ssize_t n = len(records)
    cdef Py_ssize_t i, total = 0, pos = 0
    cdef int64_t max_ts = 0
    cdef Record r
    cdef Py_ssize_t* bodies = <Py_ssize_t*>PyMem_Malloc((n + 1) * sizeof(Py_ssize_t))
    if bodies == NULL:
        raise MemoryError()
    try:
        for i in range(n):
            item = records[i]
            if type(item) is not Record:
                raise TypeError(f"record {i} is a {type(item).__name__}, not a Record")
            r = <Record>item
            if i == 0 or r.timestamp > max_ts:
                max_ts = r.timestamp
            bodies[i] = _record_body(r, r.timestamp - base_timestamp,
                                     <int32_t>i if renumber else r.offset_delta)
            if bodies[i] > 0x7FFFFFFF:
                raise ValueError(f"record {i} is larger than 2 GiB")
            total += _varint_size(_zigzag64(bodies[i])) + bodies[i]
        block = PyBytes_FromStringAndSize(NULL, total)
        out = PyBytes_AS_STRING(block)
        for i in range(n):
            r = <Record>records[i]
            _write_record(out, &pos, r, bodies[i], r.timestamp - base_timestamp,
                          <int32_t>i if renumber else r.offset_delta)
        return block, (max_ts if n else None)
    finally:
        PyMem_Free(bodies)


@cython.boundscheck(False)
@cython.wraparound(False)
def records_size(tuple records):
    """Bytes ``records`` take encoded (before compression; timestamps and offsets written
    as deltas of 0), counted without building a field nobody read. Items that are not
    a ``Record`` count 0 (encoding them fails later, naming them)."""
    cdef Py_ssize_t i, body, total = 0
    for i in range(len(records)):
        item = records[i]
        if type(item) is Record:
            body = _record_body(<Record>item, 0, 0)
            total += _varint_size(_zigzag64(body)) + body
    return total


# ---------------------------------------------------------------- per-record built-ins

cdef inline bint _digit(unsigned char c) noexcept:
    return <unsigned char>(c - 48) <= 9


cdef inline bint _big_exponent(const unsigned char* v, Py_ssize_t j, Py_ssize_t n) noexcept:
    """Whether the exponent after the ``e`` at ``j - 1`` is 100 or more, spelled as
    ``\\+?0*[1-9][0-9]{2}``."""
    if j < n and v[j] == 43:  # +
        j += 1
    while j < n and v[j] == 48:  # leading zeros
        j += 1
    return j + 2 < n and 49 <= v[j] <= 57 and _digit(v[j + 1]) and _digit(v[j + 2])


def json_number_may_overflow(bytes value not None):
    """Whether ``value`` holds what may be a JSON number beyond a double's range, as the
    regular expression ``[0-9.][eE]\\+?0*[1-9][0-9]{2}|[0-9]{200}`` finds it: an exponent
    of 100 or more, or 200 digits in a row (also inside a string: the caller lets the
    full parser decide). For ``json_schema``'s typed path, which skips the fields it does
    not check: one pass in C where the expression read a value byte by byte."""
    cdef const unsigned char* v = <const unsigned char*>PyBytes_AS_STRING(value)
    cdef Py_ssize_t n = PyBytes_GET_SIZE(value), i, run = 0
    cdef unsigned char c
    for i in range(n):
        c = v[i]
        if _digit(c):
            run += 1
            if run >= 200:
                return True
        elif c == 46:  # .
            run = 0
        else:
            run = 0
            continue
        if i + 1 < n and (v[i + 1] | 0x20) == 101 and _big_exponent(v, i + 2, n):  # e, E
            return True
    return False


cdef inline object _ascii_upper(const unsigned char* s, Py_ssize_t n):
    """``bytes.upper()`` of ``s[:n]`` (ASCII a-z only), or None when nothing changes."""
    cdef Py_ssize_t i
    cdef unsigned char c
    for i in range(n):
        if 97 <= s[i] <= 122:
            break
    else:
        return None
    out = PyBytes_FromStringAndSize(NULL, n)
    cdef unsigned char* o = <unsigned char*>PyBytes_AS_STRING(out)
    for i in range(n):
        c = s[i]
        o[i] = c - 32 if 97 <= c <= 122 else c
    return out


cdef object _upper_field(Record r, int bit, object value, Py_ssize_t at, int32_t n):
    if r._lazy & bit:
        if n < 0:
            return None
        return _ascii_upper(<const unsigned char*>PyBytes_AS_STRING(r._block) + at, n)
    if value is None:
        return None
    return _ascii_upper(<const unsigned char*>PyBytes_AS_STRING(value), PyBytes_GET_SIZE(value))


def upper_values(tuple records, bint keys=False):
    """``records`` with every non-null value (and key, with ``keys``) upper-cased as
    ``bytes.upper()`` does (ASCII letters only).

    A record with nothing to change is returned as it is, and ``records`` itself when
    no record changed. A field nobody read is read straight from the decoded block.
    """
    cdef Py_ssize_t i, n = len(records)
    cdef list out = None
    cdef Record r, c
    for i in range(n):
        item = records[i]
        if type(item) is not Record:
            raise TypeError(f"record {i} is a {type(item).__name__}, not a Record")
        r = <Record>item
        value = _upper_field(r, _LAZY_VALUE, r._value, r._value_at, r._value_len)
        key = _upper_field(r, _LAZY_KEY, r._key, r._key_at, r._key_len) if keys else None
        if value is None and key is None:
            if out is not None:
                out.append(r)
            continue
        if out is None:
            out = list(records[:i])
        c = r._copy()
        if value is not None:
            c._value = value
            c._built(_LAZY_VALUE)
        if key is not None:
            c._key = key
            c._built(_LAZY_KEY)
        out.append(c)
    return records if out is None else tuple(out)


def receive_buffer(Py_ssize_t size):
    """A ``bytearray`` of ``size`` bytes left as the allocator gave them, not zeroed.

    For receive buffers only: every byte is written by a receive before anything
    reads it (the frame assembler hands out a frame only once all of it arrived).
    Zeroing a buffer that is about to be overwritten cost as much CPU as the
    kernel's copy into it.
    """
    if size < 0:
        raise ValueError(f"negative size {size}")
    return PyByteArray_FromStringAndSize(NULL, size)


include "_gcm.pxi"


cdef struct _Field:
    const unsigned char* src   # the field's bytes as stored (plaintext or nonce + sealed)
    Py_ssize_t n               # bytes to encrypt or decrypt
    unsigned char* dst         # where the result goes (inside a new bytes object)


cdef _Field* _new_fields(Py_ssize_t n) except NULL:
    """Room for ``n`` fields (PyMem_Free it)."""
    cdef _Field* fields = <_Field*>PyMem_Malloc(max(n, 1) * sizeof(_Field))
    if fields == NULL:
        raise MemoryError()
    return fields


cdef inline const char* _value_span(Record r, Py_ssize_t* size):
    """Where ``r``'s value lies (built or still in its block) and its size; NULL for null."""
    if r._lazy & _LAZY_VALUE:
        if r._value_len < 0:
            return NULL
        size[0] = r._value_len
        return PyBytes_AS_STRING(r._block) + r._value_at
    if r._value is None:
        return NULL
    size[0] = PyBytes_GET_SIZE(r._value)
    return PyBytes_AS_STRING(r._value)


def seal_values(tuple records, object encrypt, bytes aad, Header marker, bytes nonces,
                Py_ssize_t nonce_bytes):
    """``records`` with every non-null value replaced by ``nonce + encrypt(nonce, value,
    aad)`` and ``marker`` appended to its headers; a record with a null value is kept as
    it is (a tombstone stays one).

    ``nonces`` holds ``nonce_bytes`` fresh random bytes per record, in order; the caller
    checked that no record carries ``marker``'s key yet. The cipher is the caller's:
    ``encrypt`` is a callable (e.g. ``cryptography``'s ``AESGCM.encrypt``), called once
    per value, or an :class:`AesGcm` (or its bound ``encrypt``), which seals the whole run without a Python call
    per record and without holding the GIL.
    """
    cdef Py_ssize_t i, k = 0, size, n = len(records)
    if PyBytes_GET_SIZE(nonces) < n * nonce_bytes:
        raise ValueError(f"{PyBytes_GET_SIZE(nonces)} nonce bytes for {n} records")
    for i in range(n):
        if type(records[i]) is not Record:
            raise TypeError(f"record {i} is a {type(records[i]).__name__}, not a Record")
    cdef list out = []
    cdef Record r, c
    cdef tuple suffix = (marker,)
    cdef const char* nonce_at
    cdef const char* at
    cdef AesGcm gcm = _gcm_of(encrypt, "encrypt")
    cdef list sealed = []
    cdef _Field* fields = NULL
    cdef GcmCtx ctx
    cdef bint borrowed = False
    cdef bint ok = True
    if aad is None:
        aad = b""
    cdef const unsigned char* aad_at = <const unsigned char*>PyBytes_AS_STRING(aad)
    cdef Py_ssize_t aad_len = PyBytes_GET_SIZE(aad)
    if gcm is not None:
        fields = _new_fields(n)
    try:
        for i in range(n):
            r = <Record>records[i]
            nonce_at = PyBytes_AS_STRING(nonces) + i * nonce_bytes
            if gcm is None:
                value = r.value
                if value is None:
                    out.append(r)
                    continue
                nonce = PyBytes_FromStringAndSize(nonce_at, nonce_bytes)
                value = nonce + encrypt(nonce, value, aad)
            else:
                at = _value_span(r, &size)
                if at == NULL:
                    out.append(r)
                    continue
                value = PyBytes_FromStringAndSize(NULL, nonce_bytes + size + GCM_TAG_BYTES)
                memcpy(PyBytes_AS_STRING(value), nonce_at, nonce_bytes)
                fields[k].src = <const unsigned char*>at
                fields[k].n = size
                fields[k].dst = <unsigned char*>PyBytes_AS_STRING(value) + nonce_bytes
                k += 1
                sealed.append(r._block)  # the block the span lies in, kept alive
            c = r._copy()
            c._value = value
            c._built(_LAZY_VALUE)
            c._headers = r.headers + suffix
            c._built(_LAZY_HEADERS)
            out.append(c)
        if k:
            ctx = gcm._borrow(True, nonce_bytes)
            borrowed = True
            with nogil:
                for i in range(k):
                    if not _gcm_seal(&ctx, fields[i].dst - nonce_bytes, fields[i].src,
                                     fields[i].n, aad_at, aad_len, fields[i].dst,
                                     fields[i].dst + fields[i].n):
                        ok = False
                        break
    finally:
        if borrowed:
            gcm._give_back(ctx, True, nonce_bytes)
        PyMem_Free(fields)
    if not ok:
        raise RuntimeError("OpenSSL failed to encrypt")
    return tuple(out)


def open_values(tuple records, str marker_key, bytes descriptor, object decrypt, bytes aad,
                Py_ssize_t nonce_bytes, Py_ssize_t tag_bytes):
    """``records`` sealed by :func:`seal_values` under one ``descriptor``, opened: each
    value replaced by ``decrypt(nonce, rest, aad)`` (its first ``nonce_bytes`` are the
    nonce) and its last header, the marker, removed. ``decrypt`` is a callable or an
    :class:`AesGcm` or its bound ``decrypt`` (then ``tag_bytes`` is 16), which opens the whole run without a
    Python call per record and without holding the GIL.

    ``None`` as soon as a record has another shape - no value, a value shorter than a
    nonce and a tag, a last header that is not the marker with ``descriptor``, another
    header named ``marker_key`` - or does not open (``decrypt`` raised): the caller then
    takes its general path, which says which record and why.
    """
    cdef Py_ssize_t i, j, m, size, n = len(records)
    cdef list out = []
    cdef Record r, c
    cdef tuple headers
    cdef Header last
    cdef const char* at
    cdef AesGcm gcm = _gcm_of(decrypt, "decrypt")
    if gcm is not None and tag_bytes != GCM_TAG_BYTES:
        raise ValueError(f"AES-GCM tags are {GCM_TAG_BYTES} bytes, not {tag_bytes}")
    cdef list kept = []
    cdef _Field* fields = NULL
    cdef GcmCtx ctx
    cdef bint borrowed = False
    cdef bint ok = True
    if aad is None:
        aad = b""
    cdef const unsigned char* aad_at = <const unsigned char*>PyBytes_AS_STRING(aad)
    cdef Py_ssize_t aad_len = PyBytes_GET_SIZE(aad)
    if gcm is not None:
        fields = _new_fields(n)
    try:
        for i in range(n):
            item = records[i]
            if type(item) is not Record:
                return None
            r = <Record>item
            headers = r.headers
            m = len(headers)
            if m == 0:
                return None
            last = <Header>headers[m - 1]
            if last.key != marker_key or last.value != descriptor:
                return None
            for j in range(m - 1):
                if (<Header>headers[j]).key == marker_key:
                    return None
            if gcm is None:
                value = r.value
                if value is None or PyBytes_GET_SIZE(value) < nonce_bytes + tag_bytes:
                    return None
                try:
                    plain = decrypt(value[:nonce_bytes], value[nonce_bytes:], aad)
                except Exception:
                    return None
            else:
                at = _value_span(r, &size)
                if at == NULL or size < nonce_bytes + tag_bytes:
                    return None
                size -= nonce_bytes + tag_bytes
                plain = PyBytes_FromStringAndSize(NULL, size)
                fields[i].src = <const unsigned char*>at
                fields[i].n = size
                fields[i].dst = <unsigned char*>PyBytes_AS_STRING(plain)
                kept.append(r._block)  # the block the span lies in, kept alive
            c = r._copy()
            c._value = plain
            c._built(_LAZY_VALUE)
            c._headers = headers[:m - 1]
            c._built(_LAZY_HEADERS)
            out.append(c)
        if gcm is not None and n:
            ctx = gcm._borrow(False, nonce_bytes)
            borrowed = True
            with nogil:
                for i in range(n):
                    if not _gcm_open(&ctx, fields[i].src, fields[i].src + nonce_bytes,
                                     fields[i].n, fields[i].src + nonce_bytes + fields[i].n,
                                     aad_at, aad_len, fields[i].dst):
                        ok = False
                        break
    finally:
        if borrowed:
            gcm._give_back(ctx, False, nonce_bytes)
        PyMem_Free(fields)
    return tuple(out) if ok else None


def first_moved(given_records, returned_records):
    """The index of the first record of ``returned_records`` whose offset delta or
    timestamp differs from the record at the same index of ``given_records`` (two
    sequences of the same length), or -1."""
    cdef tuple given = given_records if type(given_records) is tuple else tuple(given_records)
    cdef tuple returned = (returned_records if type(returned_records) is tuple
                           else tuple(returned_records))
    cdef Py_ssize_t i, n = len(given)
    if len(returned) != n:
        raise ValueError(f"{len(returned)} records returned for {n}")
    cdef object a, b
    for i in range(n):
        a = given[i]
        b = returned[i]
        if type(a) is Record and type(b) is Record:
            if ((<Record>a).offset_delta != (<Record>b).offset_delta
                    or (<Record>a).timestamp != (<Record>b).timestamp):
                return i
        elif a.offset_delta != b.offset_delta or a.timestamp != b.timestamp:
            return i
    return -1


def carries_header(records, str key not None):
    """Whether any record of ``records`` has a header named ``key``: the headers of a
    decoded record not read yet are scanned where they lie, without building them."""
    cdef bytes wanted = key.encode()
    cdef const char* w = PyBytes_AS_STRING(wanted)
    cdef Py_ssize_t wn = PyBytes_GET_SIZE(wanted), j, nh, vat
    cdef int32_t klen
    cdef Cursor c
    cdef Record r
    for item in records:
        if type(item) is not Record:
            if any(h.key == key for h in item.headers):
                return True
            continue
        r = <Record>item
        if not (r._lazy & _LAZY_HEADERS):
            for h in r._headers:
                if (<Header>h).key == key:
                    return True
            continue
        c.data = <const unsigned char*>PyBytes_AS_STRING(r._block)
        c.pos = r._headers_at
        c.end = r._headers_end
        c.origin = 0
        nh = _read_varint(&c, b"header count", 0)
        for j in range(nh):
            klen = _read_varint(&c, b"header key length", 0)
            if klen == wn and memcmp(c.data + c.pos, w, wn) == 0:
                return True
            c.pos += klen
            _skip_bytes(&c, b"header value", 0, &vat)
    return False


def values_present(records):
    """How many records of ``records`` have a non-null value (a decoded record's value
    is looked at where it lies, not built)."""
    cdef Py_ssize_t count = 0
    cdef Record r
    for item in records:
        if type(item) is Record:
            r = <Record>item
            if (r._value_len >= 0) if (r._lazy & _LAZY_VALUE) else (r._value is not None):
                count += 1
        elif item.value is not None:
            count += 1
    return count


# ---------------------------------------------------------------- whole blocks

include "_blocks.pxi"
include "_parallel.pxi"
