# Included in kiproxy/protocol/_codec.pyx (after _frames.pxi, whose varint readers it
# uses): the per-request work of an intercepted Produce request that is pure byte
# walking - the request's layout read, the request spliced back, each batch's header
# read and written - compiled because in Python it cost as much as the interceptor's
# own call. As in _frames.pxi, each function reads what clients send almost always and
# answers the value the Python code would, or None ("can't tell") for anything else;
# the Python code, which stays the reference, then runs and names what is wrong. The
# tests hold each to that Python code (tests/protocol/test_produce_compiled.py).

from cpython.dict cimport PyDict_Next
from cpython.object cimport PyObject, PyTypeObject
from cpython.ref cimport Py_DECREF
from libc.string cimport memset
from libc.stdint cimport INT32_MAX, INT64_MAX, INT64_MIN, int16_t

from crc32c import crc32c as _crc32c

cdef extern from "Python.h":
    object PyType_GenericAlloc(PyTypeObject* t, Py_ssize_t nitems)
    int PyType_IsSubtype(PyTypeObject* a, PyTypeObject* b)
    bint PyLong_CheckExact(object o)
    long long PyLong_AsLongLongAndOverflow(object o, int* overflow) except? -1

# ---------------------------------------------------------------- Produce request layout
#
# kiproxy.protocol.produce_request.read_produce_request, for a Produce v3-v13 body
# with every length in bounds, every string UTF-8 and no tagged field: the same
# ProduceLayout of TopicSpan and PartitionSpan named tuples.

cdef object _NOT_UTF8 = object()


cdef inline int32_t _be32(const unsigned char* p) noexcept:
    return <int32_t>((<uint32_t>p[0] << 24) | (<uint32_t>p[1] << 16)
                     | (<uint32_t>p[2] << 8) | <uint32_t>p[3])


cdef inline int64_t _be64(const unsigned char* p) noexcept:
    return <int64_t>((<uint64_t>_be32(p) << 32) | <uint32_t>_be32(p + 4))


cdef inline object _named_tuple(type cls, Py_ssize_t n):
    """An empty ``cls`` (a named tuple) of ``n`` items, made as tuple.__new__ makes it."""
    return PyType_GenericAlloc(<PyTypeObject*>cls, n)


cdef inline void _item(object t, Py_ssize_t i, object value) noexcept:
    Py_INCREF(value)
    PyTuple_SET_ITEM(t, i, value)


cdef inline Py_ssize_t _req_length(const unsigned char* p, Py_ssize_t pos, Py_ssize_t end,
                                   bint flexible, int width, Py_ssize_t* out) noexcept:
    """Past a length (a compact one on flexible versions, else ``width`` bytes signed)
    at ``pos``, the length in ``out``; -1 if it runs past ``end`` or is a long varint."""
    cdef Py_ssize_t n
    if flexible:
        pos = _answer_uvarint(p, pos, end, &n)
        out[0] = n - 1
        return pos
    if end - pos < width:
        return -1
    out[0] = <int16_t>((p[pos] << 8) | p[pos + 1]) if width == 2 else _be32(p + pos)
    return pos + width


cdef inline object _utf8(const unsigned char* p, Py_ssize_t pos, Py_ssize_t n):
    """``p[pos:pos + n]`` decoded as bytes.decode() does, or _NOT_UTF8."""
    if not _utf8_valid(p + pos, n):
        return _NOT_UTF8
    return PyUnicode_DecodeUTF8(<const char*>p + pos, n, NULL)


def read_produce_layout(object frame, Py_ssize_t body_offset, int version, type layout_type,
                        type topic_type, type partition_type, object uuid_type):
    """The ``layout_type`` (ProduceLayout) of the Produce v3-v13 body at
    ``frame[body_offset:]`` (bytes or bytearray), its topics ``topic_type`` and its
    partitions ``partition_type`` (named tuples), v13's topic ids ``uuid_type(bytes=)``;
    or None when this compiled reader leaves the body to the general one: a tagged
    field, a length that is null, negative, a long varint or past the frame, a name
    that is not UTF-8, bytes after the body.
    """
    cdef const unsigned char* p
    cdef Py_ssize_t end, pos, size, n_topics, n_parts, t, i, start, count_at, part_count_at
    cdef Py_ssize_t part_start, records_at, data_start
    cdef bint flexible = version >= 9
    cdef bint by_id = version >= 13
    cdef tuple topics, parts
    if type(frame) is bytes:
        p = <const unsigned char*>PyBytes_AS_STRING(frame)
        end = PyBytes_GET_SIZE(frame)
    elif type(frame) is bytearray:
        p = <const unsigned char*>PyByteArray_AS_STRING(frame)
        end = PyByteArray_GET_SIZE(frame)
    else:
        return None
    for cls in (layout_type, topic_type, partition_type):
        if not PyType_IsSubtype(<PyTypeObject*>cls, <PyTypeObject*>tuple):
            return None
    if version < 3 or version > 13 or body_offset < 0 or body_offset > end:
        return None
    pos = _req_length(p, body_offset, end, flexible, 2, &size)
    if pos < 0 or size < -1 or size > end - pos:
        return None
    transactional_id = None
    if size >= 0:
        transactional_id = _utf8(p, pos, size)
        if transactional_id is _NOT_UTF8:
            return None
        pos += size
    if end - pos < 6:
        return None
    acks = <int16_t>((p[pos] << 8) | p[pos + 1])
    timeout_ms = _be32(p + pos + 2)
    pos += 6
    count_at = pos
    pos = _req_length(p, pos, end, flexible, 4, &n_topics)
    # Every entry takes a byte at least: a longer array runs past the frame.
    if pos < 0 or n_topics < 0 or n_topics > end - pos:
        return None
    topics = PyTuple_New(n_topics)
    for t in range(n_topics):
        start = pos
        name = topic_id = None
        if by_id:
            if end - pos < 16:
                return None
            if memcmp(p + pos, b"\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0", 16) != 0:
                topic_id = uuid_type(bytes=PyBytes_FromStringAndSize(<const char*>p + pos, 16))
            pos += 16
        else:
            pos = _req_length(p, pos, end, flexible, 2, &size)
            if pos < 0 or size < 0 or size > end - pos:
                return None
            name = _utf8(p, pos, size)
            if name is _NOT_UTF8:
                return None
            pos += size
        part_count_at = pos
        pos = _req_length(p, pos, end, flexible, 4, &n_parts)
        if pos < 0 or n_parts < 0 or n_parts > end - pos:
            return None
        parts = PyTuple_New(n_parts)
        for i in range(n_parts):
            part_start = pos
            if end - pos < 4:
                return None
            index = _be32(p + pos)
            records_at = pos + 4
            pos = _req_length(p, records_at, end, flexible, 4, &size)
            if pos < 0 or size < -1 or size > end - pos:
                return None
            data_start = pos
            if size > 0:
                pos += size
            data_end = pos
            if flexible:
                pos = _answer_untagged(p, pos, end)
                if pos < 0:
                    return None
            part = _named_tuple(partition_type, 6)
            _item(part, 0, index)
            _item(part, 1, part_start)
            _item(part, 2, records_at)
            _item(part, 3, data_start)
            _item(part, 4, data_end)
            _item(part, 5, pos)
            _item(parts, i, part)
        if flexible:
            pos = _answer_untagged(p, pos, end)
            if pos < 0:
                return None
        topic = _named_tuple(topic_type, 6)
        _item(topic, 0, name)
        _item(topic, 1, topic_id)
        _item(topic, 2, start)
        _item(topic, 3, part_count_at)
        _item(topic, 4, parts)
        _item(topic, 5, pos)
        _item(topics, t, topic)
    if flexible:
        pos = _answer_untagged(p, pos, end)
    if pos != end:
        return None
    layout = _named_tuple(layout_type, 6)
    _item(layout, 0, transactional_id)
    _item(layout, 1, acks)
    _item(layout, 2, timeout_ms)
    _item(layout, 3, count_at)
    _item(layout, 4, topics)
    _item(layout, 5, pos)
    return layout


# ---------------------------------------------------------------- Produce request splice
#
# kiproxy.protocol.produce_splice.splice_produce_request for edits in a dict keyed by
# (int, int) to bytes or None, on the layout read_produce_request gave: the same bytes,
# measured in one pass and written in a second into one bytes object.

cdef struct _SpliceTopic:
    Py_ssize_t start, count_at, end, first, n_parts, removed, touched

cdef struct _SplicePart:
    Py_ssize_t start, records_at, data_end, end
    PyObject* new  # a reference held to the new records; NULL when untouched or removed
    bint touched


cdef inline Py_ssize_t _uvarint_put(char* out, Py_ssize_t at, uint64_t value) noexcept:
    """Writes ``value`` as an unsigned varint at ``out + at`` (when ``out``); the end."""
    while value >= 0x80:
        if out != NULL:
            out[at] = <char>((value & 0x7F) | 0x80)
        at += 1
        value >>= 7
    if out != NULL:
        out[at] = <char>value
    return at + 1


cdef inline Py_ssize_t _length_put(char* out, Py_ssize_t at, Py_ssize_t n,
                                   bint flexible) noexcept:
    """A (compact) length ``n`` at ``out + at``; the end."""
    if flexible:
        return _uvarint_put(out, at, <uint64_t>(n + 1))
    if out != NULL:
        out[at] = <char>(n >> 24)
        out[at + 1] = <char>(n >> 16)
        out[at + 2] = <char>(n >> 8)
        out[at + 3] = <char>n
    return at + 4


cdef inline Py_ssize_t _splice_copy(char* out, Py_ssize_t at, const char* src, Py_ssize_t a,
                             Py_ssize_t b) noexcept:
    """``src[a:b]`` copied to ``out + at``; the end, or -1 if ``b < a``."""
    if at < 0 or b < a:
        return -1
    if out != NULL:
        memcpy(out + at, src + a, b - a)
    return at + b - a


cdef Py_ssize_t _splice(char* out, const char* src, Py_ssize_t size, bint flexible,
                        Py_ssize_t count_at, Py_ssize_t count_end, Py_ssize_t n_topics,
                        Py_ssize_t topics_left, _SpliceTopic* topics,
                        _SplicePart* parts) noexcept:
    """The spliced request written to ``out`` (measured only when NULL); its size, or -1
    for a layout whose positions do not follow each other."""
    cdef Py_ssize_t at = 0, copied = count_end, t, j, kept, new_size
    cdef _SpliceTopic* topic
    cdef _SplicePart* part
    at = _splice_copy(out, at, src, 0, count_at)
    if topics_left != n_topics:
        at = _length_put(out, at, topics_left, flexible) if at >= 0 else -1
    else:
        at = _splice_copy(out, at, src, count_at, count_end)
    for t in range(n_topics):
        topic = &topics[t]
        if not topic.touched:
            continue
        kept = topic.n_parts - topic.removed
        if kept == 0:
            at = _splice_copy(out, at, src, copied, topic.start)
            copied = topic.end
            continue
        if kept != topic.n_parts:
            at = _splice_copy(out, at, src, copied, topic.count_at)
            at = _length_put(out, at, kept, flexible) if at >= 0 else -1
            copied = parts[topic.first].start
        for j in range(topic.first, topic.first + topic.n_parts):
            part = &parts[j]
            if not part.touched:
                continue
            if part.new == NULL:
                at = _splice_copy(out, at, src, copied, part.start)
                copied = part.end
                continue
            at = _splice_copy(out, at, src, copied, part.records_at)
            new_size = PyBytes_GET_SIZE(<object>part.new)
            at = _length_put(out, at, new_size, flexible) if at >= 0 else -1
            at = _splice_copy(out, at, PyBytes_AS_STRING(<object>part.new), 0, new_size)
            copied = part.data_end
        if at < 0:
            return -1
    if copied > size:
        return -1
    return _splice_copy(out, at, src, copied, size)


cdef inline bint _position(object value, Py_ssize_t size, Py_ssize_t* out):
    """``value`` as a position in a frame of ``size`` bytes, if it is an int in range."""
    if not PyLong_CheckExact(value):
        return False
    out[0] = value
    return 0 <= out[0] <= size


def splice_produce(object frame, bint flexible, object edits, object layout):
    """splice_produce_request's bytes for ``frame`` (bytes), its ``layout`` and a dict
    of ``edits``, or None when this compiled splice leaves them to the general one: an
    edit keyed otherwise than by a pair of ints or to neither bytes nor None, a records
    size past 2**31 - 1 on a version without compact lengths, positions that do not
    follow each other in the frame.
    """
    cdef Py_ssize_t size, n_topics, n_parts = 0, t, j, k, count_at = 0, count_end, topics_left
    cdef Py_ssize_t body_end = 0, ti, pj, total
    cdef _SpliceTopic* topics = NULL
    cdef _SplicePart* parts = NULL
    cdef PyObject* key
    cdef PyObject* value
    cdef tuple spans, topic, part
    if type(frame) is not bytes or type(edits) is not dict or not isinstance(layout, tuple):
        return None
    # Read as tuples: a named tuple's own item lookup goes through its type's __getitem__.
    size = PyBytes_GET_SIZE(frame)
    if len(<tuple>layout) != 6 or not _position((<tuple>layout)[3], size, &count_at) or \
            not _position((<tuple>layout)[5], size, &body_end):
        return None
    if type((<tuple>layout)[4]) is not tuple:
        return None
    spans = (<tuple>layout)[4]
    n_topics = len(spans)
    for t in range(n_topics):
        if not isinstance(spans[t], tuple) or len(<tuple>spans[t]) != 6 \
                or type((<tuple>spans[t])[4]) is not tuple:
            return None
        n_parts += len(<tuple>(<tuple>spans[t])[4])
    topics = <_SpliceTopic*>PyMem_Malloc(sizeof(_SpliceTopic) * n_topics + 1)
    parts = <_SplicePart*>PyMem_Malloc(sizeof(_SplicePart) * n_parts + 1)
    try:
        if topics == NULL or parts == NULL:
            raise MemoryError()
        memset(parts, 0, sizeof(_SplicePart) * n_parts)
        k = 0
        for t in range(n_topics):
            topic = <tuple>spans[t]
            topics[t].first = k
            topics[t].n_parts = len(<tuple>topic[4])
            topics[t].removed = topics[t].touched = 0
            if not (_position(topic[2], size, &topics[t].start)
                    and _position(topic[3], size, &topics[t].count_at)
                    and _position(topic[5], size, &topics[t].end)):
                return None
            for j in range(topics[t].n_parts):
                if not isinstance((<tuple>topic[4])[j], tuple):
                    return None
                part = <tuple>(<tuple>topic[4])[j]
                if len(part) != 6 or not (
                        _position(part[1], size, &parts[k].start)
                        and _position(part[2], size, &parts[k].records_at)
                        and _position(part[4], size, &parts[k].data_end)
                        and _position(part[5], size, &parts[k].end)):
                    return None
                k += 1
        j = 0
        while PyDict_Next(edits, &j, &key, &value):
            if type(<object>key) is not tuple or len(<object>key) != 2:
                return None
            if not (PyLong_CheckExact((<object>key)[0]) and PyLong_CheckExact((<object>key)[1])):
                return None
            if <object>value is not None and type(<object>value) is not bytes:
                return None
            if not flexible and <object>value is not None and \
                    PyBytes_GET_SIZE(<object>value) > INT32_MAX:
                return None
            # A key naming no partition of the request is never looked up, as in Python.
            if not (0 <= (<object>key)[0] < n_topics):
                continue
            ti = (<object>key)[0]
            if not (0 <= (<object>key)[1] < topics[ti].n_parts):
                continue
            pj = (<object>key)[1]
            parts[topics[ti].first + pj].touched = True
            topics[ti].touched = True
            if <object>value is None:
                topics[ti].removed += 1
            elif parts[topics[ti].first + pj].new == NULL:  # held until the bytes are out
                Py_INCREF(<object>value)
                parts[topics[ti].first + pj].new = value
        topics_left = n_topics
        for t in range(n_topics):
            if topics[t].touched and topics[t].removed == topics[t].n_parts:
                topics_left -= 1
        count_end = topics[0].start if n_topics else body_end
        total = _splice(NULL, PyBytes_AS_STRING(frame), size, flexible, count_at, count_end,
                        n_topics, topics_left, topics, parts)
        if total < 0:
            return None
        out = PyBytes_FromStringAndSize(NULL, total)
        _splice(PyBytes_AS_STRING(out), PyBytes_AS_STRING(frame), size, flexible, count_at,
                count_end, n_topics, topics_left, topics, parts)
        return out
    finally:
        for k in range(n_parts if parts != NULL else 0):
            if parts[k].new != NULL:
                Py_DECREF(<object>parts[k].new)
        PyMem_Free(topics)
        PyMem_Free(parts)


# ---------------------------------------------------------------- record batch headers
#
# kiproxy.protocol.records._read_header and _around: every batch of an intercepted
# request is read through the first and written back through the second.

cdef inline int _int_field(object value, int64_t low, int64_t high, int64_t* out) except -1:
    """``value`` in ``out`` if it is an int in ``low..high``: 1, else 0."""
    cdef int overflow = 0
    if not PyLong_CheckExact(value):
        return 0
    out[0] = PyLong_AsLongLongAndOverflow(value, &overflow)
    return overflow == 0 and low <= out[0] <= high


cdef inline void _put_be(unsigned char* out, uint64_t value, int width) noexcept:
    cdef int i
    for i in range(width):
        out[i] = <unsigned char>(value >> (8 * (width - 1 - i)))


def read_batch_header(object data, Py_ssize_t start, Py_ssize_t end, type header_type):
    """The ``header_type`` (RecordBatchHeader) of the magic-2 batch at ``data[start:end]``
    (bytes or bytearray), its fields set as its own __init__ would set them; or None
    when the general reader must name what is wrong (a short batch, another magic, a
    batchLength out of bounds, a negative recordCount, an unknown codec).
    """
    cdef const unsigned char* p
    cdef Py_ssize_t size
    cdef int32_t batch_length, count
    cdef int attributes
    if type(data) is bytes:
        p = <const unsigned char*>PyBytes_AS_STRING(data)
        size = PyBytes_GET_SIZE(data)
    elif type(data) is bytearray:
        p = <const unsigned char*>PyByteArray_AS_STRING(data)
        size = PyByteArray_GET_SIZE(data)
    else:
        return None
    if start < 0 or end > size or end - start < 61:
        return None
    p += start
    batch_length = _be32(p + 8)
    attributes = <int16_t>((p[21] << 8) | p[22])
    count = _be32(p + 57)
    if p[16] != 2 or batch_length < 49 or batch_length > end - start - 12 or count < 0 \
            or (attributes & 0x07) > 4:
        return None
    header = header_type.__new__(header_type)
    PyObject_GenericSetAttr(header, "base_offset", _be64(p))
    PyObject_GenericSetAttr(header, "batch_length", batch_length)
    PyObject_GenericSetAttr(header, "partition_leader_epoch", _be32(p + 12))
    PyObject_GenericSetAttr(header, "crc", <uint32_t>_be32(p + 17))
    PyObject_GenericSetAttr(header, "attributes", attributes)
    PyObject_GenericSetAttr(header, "last_offset_delta", _be32(p + 23))
    PyObject_GenericSetAttr(header, "base_timestamp", _be64(p + 27))
    PyObject_GenericSetAttr(header, "max_timestamp", _be64(p + 35))
    PyObject_GenericSetAttr(header, "producer_id", _be64(p + 43))
    PyObject_GenericSetAttr(header, "producer_epoch", <int16_t>((p[51] << 8) | p[52]))
    PyObject_GenericSetAttr(header, "base_sequence", _be32(p + 53))
    PyObject_GenericSetAttr(header, "record_count", count)
    return header


def batch_around(object header, object attributes, object last_offset_delta,
                 object max_timestamp, object count, object block):
    """_around's three pieces (the header to the CRC, the rest of the header, ``block``)
    for a ``block`` (bytes) already compressed as ``attributes`` say; or None when a
    field is not an int that fits its width, where struct.pack would raise.
    """
    return _pieces_around(header, attributes, last_offset_delta, max_timestamp, count,
                          block, True)


cdef tuple _pieces_around(object header, object attributes, object last_offset_delta,
                          object max_timestamp, object count, object block, bint crc):
    """:func:`batch_around`; with ``crc`` False the prefix's CRC is left 0, for the
    caller to write into the new bytes before they are shared."""
    cdef int64_t v[11]
    cdef unsigned char prefix[21]
    cdef unsigned char after[40]
    if type(block) is not bytes:
        return None
    if not (_int_field(attributes, -0x8000, 0x7FFF, &v[0])
            and _int_field(last_offset_delta, -0x80000000, 0x7FFFFFFF, &v[1])
            and _int_field(header.base_timestamp, INT64_MIN, INT64_MAX, &v[2])
            and _int_field(max_timestamp, INT64_MIN, INT64_MAX, &v[3])
            and _int_field(header.producer_id, INT64_MIN, INT64_MAX, &v[4])
            and _int_field(header.producer_epoch, -0x8000, 0x7FFF, &v[5])
            and _int_field(header.base_sequence, -0x80000000, 0x7FFFFFFF, &v[6])
            and _int_field(count, -0x80000000, 0x7FFFFFFF, &v[7])
            and _int_field(header.base_offset, INT64_MIN, INT64_MAX, &v[8])
            and _int_field(header.partition_leader_epoch, -0x80000000, 0x7FFFFFFF, &v[9])):
        return None
    v[10] = 49 + PyBytes_GET_SIZE(block)  # batchLength
    if v[10] > 0x7FFFFFFF:
        return None
    _put_be(after, <uint64_t>v[0], 2)
    _put_be(after + 2, <uint64_t>v[1], 4)
    _put_be(after + 6, <uint64_t>v[2], 8)
    _put_be(after + 14, <uint64_t>v[3], 8)
    _put_be(after + 22, <uint64_t>v[4], 8)
    _put_be(after + 30, <uint64_t>v[5], 2)
    _put_be(after + 32, <uint64_t>v[6], 4)
    _put_be(after + 36, <uint64_t>v[7], 4)
    after_crc = PyBytes_FromStringAndSize(<const char*>after, 40)
    _put_be(prefix, <uint64_t>v[8], 8)
    _put_be(prefix + 8, <uint64_t>v[10], 4)
    _put_be(prefix + 12, <uint64_t>v[9], 4)
    prefix[16] = 2
    _put_be(prefix + 17, <uint32_t>(_crc32c(block, _crc32c(after_crc)) if crc else 0), 4)
    return PyBytes_FromStringAndSize(<const char*>prefix, 21), after_crc, block
