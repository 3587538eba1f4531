# Included in kiproxy/protocol/_codec.pyx (one compiled module): the per-request wire
# work of the connection, compiled because in Python it cost more than forwarding a
# small request does. Each part reads what clients and brokers send almost always and
# leaves anything else to the Python code it stands in front of, which names what is
# wrong; the tests hold each to that Python code.

from cpython.bytearray cimport PyByteArray_AS_STRING, PyByteArray_GET_SIZE
from cpython.buffer cimport PyBUF_WRITE
from cpython.memoryview cimport PyMemoryView_FromMemory
from libc.string cimport memmove

from kiproxy.protocol.errors import FrameTooLarge, MalformedFrame

# ---------------------------------------------------------------- Produce answers
#
# Every answer to a Produce v10+ request is checked for KIP-951's node_endpoints (broker
# addresses the client must not see) before it is passed on. The general check walks
# the schema with Python closures (kiproxy.protocol.messages.response_tags): a fifth
# of the proxy's own work per small request. This is the same walk for the one shape
# brokers send almost always, compiled: it answers True only for a body it has read
# whole, every length in bounds and every tagged-field section empty; anything else
# (a tagged field, a null where a value must be, a long varint, a short read) answers
# False and the caller takes the general path, which names what is wrong.

cdef inline Py_ssize_t _answer_uvarint(const unsigned char* p, Py_ssize_t pos, Py_ssize_t end,
                                      Py_ssize_t* out) noexcept:
    """An unsigned varint of at most 4 bytes at ``pos``: the position after it, -1 if not."""
    cdef Py_ssize_t value = 0
    cdef int shift = 0
    cdef unsigned char b
    while pos < end and shift < 28:
        b = p[pos]
        pos += 1
        value |= <Py_ssize_t>(b & 0x7F) << shift
        if not (b & 0x80):
            out[0] = value
            return pos
        shift += 7
    return -1


cdef inline Py_ssize_t _answer_string(const unsigned char* p, Py_ssize_t pos, Py_ssize_t end,
                                      bint nullable) noexcept:
    """Past a compact (nullable) string at ``pos``, or -1."""
    cdef Py_ssize_t n
    pos = _answer_uvarint(p, pos, end, &n)
    if pos < 0 or (n == 0 and not nullable) or (n > 0 and n - 1 > end - pos):
        return -1
    return pos + n - 1 if n > 0 else pos


cdef inline Py_ssize_t _answer_count(const unsigned char* p, Py_ssize_t pos, Py_ssize_t end,
                                     Py_ssize_t* count) noexcept:
    """Past a compact, non-null array count at ``pos`` (the count in ``count``), or -1."""
    cdef Py_ssize_t n
    pos = _answer_uvarint(p, pos, end, &n)
    if pos < 0 or n == 0 or n - 1 > end - pos:
        return -1
    count[0] = n - 1
    return pos


cdef inline Py_ssize_t _answer_untagged(const unsigned char* p, Py_ssize_t pos,
                                        Py_ssize_t end) noexcept:
    """Past an empty tagged-field section at ``pos``, or -1."""
    return pos + 1 if pos < end and p[pos] == 0 else -1


def produce_answer_untagged(bytes frame, int version):
    """Whether ``frame`` (a Produce v10-v13 response without its length prefix, header v1)
    reads whole with every tagged-field section empty, so that it names no broker.

    False says only that this fast check cannot tell: the caller then reads the answer
    with the general code, which rewrites what it must or names what is wrong.
    """
    cdef const unsigned char* p = <const unsigned char*>PyBytes_AS_STRING(frame)
    cdef Py_ssize_t end = PyBytes_GET_SIZE(frame)
    cdef Py_ssize_t pos, topics, partitions, errors, t, i, e
    if version < 10 or version > 13 or end < 5:
        return False
    pos = _answer_untagged(p, 4, end)  # the header's tags, after the correlation id
    if pos < 0:
        return False
    pos = _answer_count(p, pos, end, &topics)
    if pos < 0:
        return False
    for t in range(topics):
        if version >= 13:
            pos = pos + 16 if end - pos >= 16 else -1  # topic_id
        else:
            pos = _answer_string(p, pos, end, False)  # name
        if pos < 0:
            return False
        pos = _answer_count(p, pos, end, &partitions)
        if pos < 0:
            return False
        for i in range(partitions):
            if end - pos < 30:
                return False
            pos += 30  # index, error_code, base_offset, log_append_time, log_start_offset
            pos = _answer_count(p, pos, end, &errors)
            if pos < 0:
                return False
            for e in range(errors):
                if end - pos < 4:
                    return False
                pos = _answer_string(p, pos + 4, end, True)  # batch_index_error_message
                if pos >= 0:
                    pos = _answer_untagged(p, pos, end)
                if pos < 0:
                    return False
            pos = _answer_string(p, pos, end, True)  # error_message
            if pos >= 0:
                pos = _answer_untagged(p, pos, end)  # current_leader would be tag 0
            if pos < 0:
                return False
        pos = _answer_untagged(p, pos, end)
        if pos < 0:
            return False
    if end - pos < 4:
        return False
    pos = _answer_untagged(p, pos + 4, end)  # throttle_time_ms; node_endpoints is tag 0
    return pos == end


# ---------------------------------------------------------------- request headers
#
# Every request's header is read before anything else is decided; in Python the read
# and the frozen dataclass's __init__ (one object.__setattr__ a field) cost more than
# forwarding a small request does. This reads the header brokers get from every
# client (header v1 or v2, no tagged field) into the same RequestHeader value, its
# fields set as its own __init__ would set them; anything else answers None and
# kiproxy.protocol.framing reads it in Python, naming what is wrong.

cdef extern from "Python.h":
    int PyObject_GenericSetAttr(object o, object name, object value) except -1

cdef dict _header_versions = {}


def read_request_header(object frame, type header_type, object header_version_of):
    """A ``header_type`` (RequestHeader) read from the start of ``frame`` (bytes or
    bytearray), or None when this compiled reader leaves it to the general one.

    ``header_version_of(api_key, api_version)`` is asked once per pair and kept.
    """
    cdef const unsigned char* p
    cdef Py_ssize_t end, pos
    cdef int api_key, api_version, size
    cdef int32_t correlation_id
    if type(frame) is bytes:
        p = <const unsigned char*>PyBytes_AS_STRING(frame)
        end = PyBytes_GET_SIZE(frame)
    elif type(frame) is bytearray:
        p = <const unsigned char*>PyByteArray_AS_STRING(frame)
        end = PyByteArray_GET_SIZE(frame)
    else:
        return None
    if end < 10:
        return None
    api_key = <short>((p[0] << 8) | p[1])
    api_version = <short>((p[2] << 8) | p[3])
    correlation_id = <int32_t>((<uint32_t>p[4] << 24) | (<uint32_t>p[5] << 16)
                               | (<uint32_t>p[6] << 8) | <uint32_t>p[7])
    key = (api_key << 16) | (api_version & 0xFFFF)
    version = _header_versions.get(key)
    if version is None:
        version = header_version_of(api_key, api_version)
        if version is None:
            return None
        _header_versions[key] = version
    if version != 1 and version != 2:
        return None
    size = <short>((p[8] << 8) | p[9])
    pos = 10
    if size >= 0:
        if pos + size > end:
            return None
        client_id = PyUnicode_DecodeUTF8(<const char*>p + pos, size, "replace")
        pos += size
    elif size == -1:
        client_id = None
    else:
        return None
    if version == 2:
        if pos >= end or p[pos] != 0:
            return None
        pos += 1
    header = header_type.__new__(header_type)
    PyObject_GenericSetAttr(header, "api_key", api_key)
    PyObject_GenericSetAttr(header, "api_version", api_version)
    PyObject_GenericSetAttr(header, "correlation_id", correlation_id)
    PyObject_GenericSetAttr(header, "client_id", client_id)
    PyObject_GenericSetAttr(header, "header_version", version)
    PyObject_GenericSetAttr(header, "body_offset", pos)
    return header


# ---------------------------------------------------------------- frame assembly
#
# kiproxy.protocol.framing.FrameAssembler: every receive on every socket of the proxy
# goes through get_buffer() and buffer_updated(), twice per request and answer. The
# same logic as the Python class it replaced, compiled: a small request cost more in
# these two calls than in everything the proxy decides about it.


cdef object _NO_VIEW = memoryview(b"")


cdef class FrameAssembler:
    """Frames assembled in the buffers their bytes are received into.

    For a reader with ``recv_into`` (``asyncio.BufferedProtocol``): it asks
    :meth:`get_buffer` where the next bytes go, receives into that buffer, and
    reports how many arrived to :meth:`buffer_updated`, which returns the frames
    they complete, in order, without their length prefixes.

    Frames under ``large_frame`` bytes share one chunk buffer, many per receive,
    and are handed out as ``bytes`` (one small copy each). A larger frame of up to
    ``part_size`` bytes gets a ``bytes`` object of exactly its size once its length
    prefix has arrived; the rest of it is received straight into that object
    (through a writable view of its storage, held by nobody else until the last
    byte is in, as ``PyBytes_FromStringAndSize(NULL, n)`` is filled in C), which is
    handed out as is and never touched again. A frame above
    ``part_size`` is received into buffers made one at a time as its bytes arrive,
    each at most as large as what has arrived so far, then joined once into
    ``bytes``: a length prefix alone makes the assembler allocate ``part_size``
    bytes at most, and a frame's buffers never exceed twice what the client has
    sent (Kafka's broker allocates the whole frame on the prefix; a proxy in front
    of it should not). A negative length, or one above ``max_frame_size``, raises
    in :meth:`buffer_updated` as soon as the prefix is seen, before any
    allocation; the assembler is then unusable, like the stream it came from.
    """

    cdef public Py_ssize_t max_frame_size
    cdef public Py_ssize_t large_frame
    cdef public Py_ssize_t part_size
    cdef Py_ssize_t _chunk_size
    # Made when bytes arrive and dropped once every byte in it is handed out: an idle
    # connection holds no chunk.
    cdef object _chunk  # bytearray or None
    cdef object _view
    cdef Py_ssize_t _start  # unconsumed bytes are _chunk[_start:_end]
    cdef Py_ssize_t _end
    cdef Py_ssize_t _large  # length of a large frame whose prefix sits at _chunk[_start:]
    cdef object _parts  # list of the large frame's buffers, or None
    cdef object _part  # bytearray, or the bytes a frame of up to part_size is received into
    cdef object _part_view
    cdef Py_ssize_t _part_filled
    cdef Py_ssize_t _part_size
    cdef Py_ssize_t _need
    cdef Py_ssize_t _got

    def __init__(self, Py_ssize_t max_frame_size=100 * 1024 * 1024, *,
                 Py_ssize_t chunk_size=64 * 1024, Py_ssize_t large_frame=16 * 1024,
                 Py_ssize_t part_size=64 * 1024):
        if not 0 < large_frame <= chunk_size - 4:
            raise ValueError(f"large_frame {large_frame} must be in 1..chunk_size - 4 "
                             f"({chunk_size - 4})")
        if part_size < chunk_size:
            raise ValueError(f"part_size {part_size} must be at least chunk_size {chunk_size}")
        self.max_frame_size = max_frame_size
        self.large_frame = large_frame
        self.part_size = part_size
        self._chunk_size = chunk_size
        self._chunk = None
        self._view = _NO_VIEW
        self._start = self._end = self._large = 0
        self._parts = None
        self._part = bytearray()
        self._part_view = memoryview(self._part)
        self._part_filled = self._need = self._got = self._part_size = 0

    @property
    def buffered(self):
        """Bytes received but not yet returned as a frame (length prefixes included)."""
        if self._parts is not None:
            return 4 + self._got
        return self._end - self._start

    def discard(self):
        """Drop every buffer held, at once: the stream is gone. (A closed connection's
        objects form reference cycles that only the cyclic collector frees, maybe much
        later; the partial frame it held must not wait for that.)"""
        self._chunk, self._view = None, _NO_VIEW
        self._parts, self._part, self._part_view = None, bytearray(), _NO_VIEW
        self._start = self._end = self._large = self._need = self._got = 0
        self._part_filled = self._part_size = 0

    cdef object _next_part(self):
        # Double what has arrived, at most: a client must send bytes to make the
        # assembler hold more of them.
        cdef Py_ssize_t size = self._need - self._got
        if size > max(self.part_size, self._got):
            size = max(self.part_size, self._got)
        part = PyByteArray_FromStringAndSize(NULL, size)
        self._parts.append(part)
        self._part, self._part_view, self._part_filled = part, memoryview(part), 0
        self._part_size = size
        return self._part_view

    def get_buffer(self):
        """Where the next bytes must be received; never empty."""
        cdef Py_ssize_t start, end, have
        cdef char* dst
        if self._parts is not None:
            if self._part_filled == self._part_size:
                return self._next_part()
            return self._part_view[self._part_filled:]
        start, end = self._start, self._end
        if self._large:
            # The buffer is made only now, when the reader is about to fill it: a
            # reader paused with a prefix received holds no more than the chunk.
            self._need, self._large = self._large, 0
            have = end - start - 4
            self._parts, self._got = [], have
            if self._need <= self.part_size:  # the whole frame, as the bytes handed out
                part = PyBytes_FromStringAndSize(NULL, self._need)
                dst = PyBytes_AS_STRING(part)
                view = PyMemoryView_FromMemory(dst, self._need, PyBUF_WRITE)
                self._part_size = self._need
            else:
                part = PyByteArray_FromStringAndSize(NULL, self.part_size)
                dst = PyByteArray_AS_STRING(part)
                view = memoryview(part)
                self._part_size = self.part_size
            memcpy(dst, PyByteArray_AS_STRING(self._chunk) + start + 4, have)
            self._parts.append(part)
            self._part, self._part_view, self._part_filled = part, view, have
            self._start = self._end = 0
            self._chunk, self._view = None, _NO_VIEW
            return self._part_view[have:]
        chunk = self._chunk
        if chunk is None:
            chunk = self._chunk = PyByteArray_FromStringAndSize(NULL, self._chunk_size)
            self._view = memoryview(chunk)
            self._start = self._end = start = end = 0
        elif PyByteArray_GET_SIZE(chunk) - end < PyByteArray_GET_SIZE(chunk) // 4:
            # Little room left: move the start of the next frame (smaller than
            # large_frame) to the front.
            memmove(PyByteArray_AS_STRING(chunk), PyByteArray_AS_STRING(chunk) + start,
                    end - start)
            self._start, self._end = 0, end - start
            end -= start
        return self._view[end:]

    def buffer_updated(self, Py_ssize_t nbytes):
        """Count ``nbytes`` received into the last :meth:`get_buffer`; return whole frames."""
        cdef Py_ssize_t pos, end
        cdef int32_t size
        cdef const unsigned char* p
        cdef list frames
        parts = self._parts
        if parts is not None:
            self._part_filled += nbytes
            self._got += nbytes
            if self._got < self._need:
                return []
            frame = parts[0] if len(parts) == 1 else b"".join(parts)
            self._parts, self._part, self._part_view = None, bytearray(), _NO_VIEW
            self._part_size = 0
            return [frame]
        chunk = self._chunk
        if chunk is None:
            raise AssertionError("buffer_updated() without get_buffer()")
        p = <const unsigned char*>PyByteArray_AS_STRING(chunk)
        pos = self._start
        end = self._end = self._end + nbytes
        frames = []
        while end - pos >= 4:
            size = <int32_t>((<uint32_t>p[pos] << 24) | (<uint32_t>p[pos + 1] << 16)
                             | (<uint32_t>p[pos + 2] << 8) | <uint32_t>p[pos + 3])
            if size < 0:
                raise MalformedFrame(f"frame length {size} is negative")
            if size > self.max_frame_size:
                raise FrameTooLarge(
                    f"frame length {size} exceeds max_frame_size {self.max_frame_size}")
            if end - pos - 4 < size:
                if size >= self.large_frame:
                    self._large = size
                break
            frames.append(PyBytes_FromStringAndSize(<const char*>p + pos + 4, size))
            pos += 4 + size
        self._start = pos
        if pos == end:
            self._chunk, self._view = None, _NO_VIEW
            self._start = self._end = 0
        return frames
