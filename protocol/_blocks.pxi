# Records blocks read and rewritten whole, without a Record object per record (included by
# _codec.pyx, after the record walker ``_walk``).
#
# Contract. A records block is a batch's records once decompressed: ``count`` records in
# Kafka's magic-2 encoding, back to back. ``check_block`` validates a block a fetch-side
# hook returned against the records it replaces, ``block_moved`` against the block they
# came from (no record object built); ``block_header_value`` and
# ``block_carries_header`` look at headers where they lie; ``open_block`` is
# ``open_values`` (the values sealed by ``seal_values`` under one descriptor, opened and
# the marker header dropped) from block to block, its cipher calls and copies run
# without the GIL. Every function validates every record it reads as ``decode_records``
# does and raises :class:`~kiproxy.protocol.errors.CorruptBatch` naming the record.


def block_of(Record record not None):
    """The bytes a decoded ``record`` reads its fields from: the decompressed records
    block of a compressed batch, the bytes an uncompressed one was decoded from; None
    for a record that was built, not decoded."""
    return record._block


cdef inline void _cursor_on(Cursor* c, const unsigned char[::1] data):
    c.data = &data[0] if data.shape[0] else <const unsigned char*>b""
    c.pos = 0
    c.end = data.shape[0]
    c.origin = 0


cdef int _walk_block(Cursor* c, Py_ssize_t count, _Span* spans) except -1:
    """Walk ``count`` records filling ``spans`` (room for ``count``); the block must end
    with the last one."""
    cdef Py_ssize_t i
    for i in range(count):
        _walk(c, i, &spans[i])
    return _walked(c, count)


cdef inline int _walk_delta(Cursor* c, Py_ssize_t i, _Span* s) except -1:
    """What :func:`block_moved` compares of record ``i`` at ``c``, its timestamp and
    offset deltas, read without the rest (of the block the records came from: what a
    hook made of it is walked whole), and move ``c`` past it."""
    cdef Py_ssize_t at = c.pos, end, outer = c.end
    cdef int32_t length = _read_varint(c, b"record length", i)
    if length < 1 or length > c.end - c.pos:
        _bad_record(_BAD_LENGTH, i, 0, length, at - c.origin, c.end - c.pos)
    end = c.pos + length
    c.end = end
    c.pos += 1  # record attributes
    s.ts_delta = _read_varlong(c, b"timestamp delta", i)
    s.offset_delta = _read_varint(c, b"offset delta", i)
    c.end = outer
    c.pos = end
    return 0


cdef inline int _walked(Cursor* c, Py_ssize_t count) except -1:
    """The block at ``c`` must end with its ``count``-th record, where ``c`` is now."""
    if c.pos != c.end:
        _fail(f"{c.end - c.pos} bytes left over after {count} records (byte {c.pos})")
    return 0


cdef _Span* _new_spans(Py_ssize_t n) except NULL:
    cdef _Span* spans = <_Span*>PyMem_Malloc(max(n, 1) * sizeof(_Span))
    if spans == NULL:
        raise MemoryError()
    return spans


def check_block(const unsigned char[::1] data, int64_t base_timestamp, tuple given):
    """The index of the first record of the block ``data`` whose offset delta or
    timestamp (``base_timestamp`` plus its delta) differs from the record at the same
    index of ``given``, or -1. ``data`` must hold exactly ``len(given)`` valid records:
    anything else raises ``CorruptBatch``."""
    cdef Py_ssize_t i, n = len(given)
    cdef Cursor c
    _cursor_on(&c, data)
    if n > c.end // 7 + 1:
        _fail(f"{n} records cannot fit in {c.end} bytes")
    cdef _Span* spans = _new_spans(n)
    cdef Record r
    try:
        _walk_block(&c, n, spans)
        for i in range(n):
            item = given[i]
            if type(item) is Record:
                r = <Record>item
                if (spans[i].offset_delta != r.offset_delta
                        or base_timestamp + spans[i].ts_delta != r.timestamp):
                    return i
            elif (spans[i].offset_delta != item.offset_delta
                    or base_timestamp + spans[i].ts_delta != item.timestamp):
                return i
        return -1
    finally:
        PyMem_Free(spans)


def block_moved(const unsigned char[::1] data, const unsigned char[::1] original,
                Py_ssize_t count):
    """:func:`check_block` against the block the records came from rather than the
    records: the index of the first record of ``data`` whose offset delta or timestamp
    delta differs from the record at the same index of ``original`` (both of one batch,
    so one base timestamp), or -1. ``data`` must hold exactly ``count`` valid records,
    and ``original`` ``count`` records whose deltas read (only those are read of it):
    anything else raises ``CorruptBatch``. No record object is built."""
    cdef Py_ssize_t i
    cdef Cursor c, o
    _cursor_on(&c, data)
    _cursor_on(&o, original)
    if count > c.end // 7 + 1 or count > o.end // 7 + 1:
        _fail(f"{count} records cannot fit in {min(c.end, o.end)} bytes")
    cdef _Span* spans = _new_spans(count)
    cdef _Span* was = _new_spans(count)
    try:
        for i in range(count):  # in step: the two walks' memory reads overlap
            _walk_delta(&o, i, &was[i])
            _walk(&c, i, &spans[i])
        _walked(&o, count)
        _walked(&c, count)
        for i in range(count):
            if (spans[i].offset_delta != was[i].offset_delta
                    or spans[i].ts_delta != was[i].ts_delta):
                return i
        return -1
    finally:
        PyMem_Free(was)
        PyMem_Free(spans)


cdef struct _HeaderAt:
    Py_ssize_t start      # its key length varint
    Py_ssize_t key_at
    int32_t key_len
    Py_ssize_t value_at
    int32_t value_len     # -1: null


cdef inline int _next_header(Cursor* c, _HeaderAt* h) except -1:
    """Read the header at ``c.pos`` (of a record ``_walk`` validated) and move past it."""
    h.start = c.pos
    h.key_len = _read_varint(c, b"header key length", 0)
    h.key_at = c.pos
    c.pos += h.key_len
    h.value_len = _skip_bytes(c, b"header value", 0, &h.value_at)
    return 0


cdef inline bint _named(Cursor* c, _HeaderAt* h, const char* key, Py_ssize_t n) noexcept:
    return h.key_len == n and memcmp(c.data + h.key_at, key, n) == 0


cdef inline void _headers_of(Cursor* c, _Span* s) noexcept:
    """Put ``c`` on the first header of the record ``s`` (after its header count)."""
    c.pos = s.headers_at
    c.end = s.end
    while c.data[c.pos] & 0x80:
        c.pos += 1
    c.pos += 1


def block_header_value(const unsigned char[::1] data, str key not None):
    """The value of the first record's last header when that header is named ``key``,
    else None (no record, no header, another name, or a null value)."""
    cdef Cursor c
    cdef _Span s
    cdef _HeaderAt h
    cdef Py_ssize_t j
    cdef bytes wanted = key.encode()
    h.value_len = -1
    _cursor_on(&c, data)
    if c.end == 0:
        return None
    _walk(&c, 0, &s)
    if s.nh == 0:
        return None
    _headers_of(&c, &s)
    for j in range(s.nh):
        _next_header(&c, &h)
    if h.value_len < 0 or not _named(&c, &h, PyBytes_AS_STRING(wanted),
                                     PyBytes_GET_SIZE(wanted)):
        return None
    return PyBytes_FromStringAndSize(<const char*>c.data + h.value_at, h.value_len)


def block_carries_header(const unsigned char[::1] data, Py_ssize_t count, str key not None):
    """Whether any of the ``count`` records of the block ``data`` has a header named
    ``key`` (the block is validated whole)."""
    cdef Cursor c
    cdef _HeaderAt h
    cdef Py_ssize_t i, j, next_record
    cdef bytes wanted = key.encode()
    cdef const char* w = PyBytes_AS_STRING(wanted)
    cdef Py_ssize_t wn = PyBytes_GET_SIZE(wanted)
    _cursor_on(&c, data)
    cdef Py_ssize_t end = c.end
    if count > end // 7 + 1:
        _fail(f"{count} records cannot fit in {end} bytes")
    cdef _Span* spans = _new_spans(count)
    try:
        _walk_block(&c, count, spans)
        for i in range(count):
            _headers_of(&c, &spans[i])
            for j in range(spans[i].nh):
                _next_header(&c, &h)
                if _named(&c, &h, w, wn):
                    return True
        return False
    finally:
        PyMem_Free(spans)


cdef struct _Opening:
    # One sealed record of open_block: what is copied, what is decrypted, where.
    Py_ssize_t head_at       # attributes .. key: copied as they are
    Py_ssize_t head_len
    Py_ssize_t sealed_at     # nonce, ciphertext, tag
    Py_ssize_t plain_len
    Py_ssize_t kept_at       # the headers before the marker: copied as they are
    Py_ssize_t kept_len
    Py_ssize_t kept_count
    Py_ssize_t body          # the opened record's length (after its length varint)
    Py_ssize_t out_at        # where the opened record starts in the new block


cdef Py_ssize_t _plan_opening(const unsigned char[::1] data, Py_ssize_t count, bytes marker,
                              bytes descriptor, Py_ssize_t nonce_bytes, _Opening* ops
                              ) except -2:
    """Walk the block ``data`` (``count`` records, validated whole) filling ``ops``: the
    size of the opened block, or -1 as soon as a record has another shape than
    :func:`open_block` opens. Raises ``CorruptBatch`` for a malformed block."""
    cdef const char* w = PyBytes_AS_STRING(marker)
    cdef Py_ssize_t wn = PyBytes_GET_SIZE(marker)
    cdef const char* d = PyBytes_AS_STRING(descriptor)
    cdef Py_ssize_t dn = PyBytes_GET_SIZE(descriptor)
    cdef Cursor c
    cdef _HeaderAt h
    cdef Py_ssize_t i, j, total = 0
    cdef _Span* s
    cdef _Opening* o
    _cursor_on(&c, data)
    if count > c.end // 7 + 1:
        _fail(f"{count} records cannot fit in {c.end} bytes")
    cdef _Span* spans = _new_spans(count)
    try:
        _walk_block(&c, count, spans)
        for i in range(count):
            s = &spans[i]
            o = &ops[i]
            if s.value_len < nonce_bytes + GCM_TAG_BYTES or s.nh == 0:
                return -1
            _headers_of(&c, s)
            o.kept_at = c.pos
            for j in range(s.nh):
                _next_header(&c, &h)
                if _named(&c, &h, w, wn) and j < s.nh - 1:
                    return -1  # a second marker: the general path says why
            if (not _named(&c, &h, w, wn) or h.value_len != dn
                    or memcmp(c.data + h.value_at, d, dn) != 0):
                return -1
            o.head_at = s.body
            o.head_len = s.value_field - s.body
            o.sealed_at = s.value_at
            o.plain_len = s.value_len - nonce_bytes - GCM_TAG_BYTES
            o.kept_len = h.start - o.kept_at
            o.kept_count = s.nh - 1
            o.body = (o.head_len + _field_size(o.plain_len)
                      + _varint_size(_zigzag64(o.kept_count)) + o.kept_len)
            o.out_at = total
            total += _varint_size(_zigzag64(o.body)) + o.body
        return total
    finally:
        PyMem_Free(spans)


cdef inline bint _open_one(const GcmCtx* ctx, const unsigned char* src, unsigned char* dst,
                           _Opening* o, const unsigned char* aad, Py_ssize_t aad_len,
                           Py_ssize_t nonce_bytes) noexcept nogil:
    """Write the opened record ``o`` of the block ``src`` at ``dst + o.out_at``: False
    when its value does not open."""
    cdef Buffer b
    b.data = <char*>dst
    b.size = o.out_at
    _put_uvarint(&b, _zigzag64(o.body))
    memcpy(b.data + b.size, src + o.head_at, o.head_len)
    b.size += o.head_len
    _put_uvarint(&b, _zigzag64(o.plain_len))
    if not _gcm_open(ctx, src + o.sealed_at, src + o.sealed_at + nonce_bytes, o.plain_len,
                     src + o.sealed_at + nonce_bytes + o.plain_len, aad, aad_len,
                     <unsigned char*>b.data + b.size):
        return False
    b.size += o.plain_len
    _put_uvarint(&b, _zigzag64(o.kept_count))
    memcpy(b.data + b.size, src + o.kept_at, o.kept_len)
    return True


def open_block(const unsigned char[::1] data, Py_ssize_t count, str marker_key not None,
               bytes descriptor not None, object decrypt, bytes aad, Py_ssize_t nonce_bytes):
    """The block ``data`` (``count`` records sealed by :func:`seal_values` under one
    ``descriptor``) with every value opened and every marker header dropped, as a new
    block; ``decrypt`` must be an :class:`AesGcm` or its bound ``decrypt``.

    ``None`` when ``decrypt`` is another cipher, or as soon as a record has another
    shape (as :func:`open_values` says) or does not open: the caller then takes its
    record-by-record path, which says which record and why. A malformed block raises
    ``CorruptBatch``.
    """
    cdef AesGcm gcm = _gcm_of(decrypt, "decrypt")
    if gcm is None:
        return None
    if aad is None:
        aad = b""
    cdef Py_ssize_t i, total
    cdef _Opening* ops = <_Opening*>PyMem_Malloc(max(count, 1) * sizeof(_Opening))
    cdef GcmCtx ctx
    cdef bint borrowed = False
    cdef bint ok = True
    cdef const unsigned char* aad_at = <const unsigned char*>PyBytes_AS_STRING(aad)
    cdef Py_ssize_t aad_len = PyBytes_GET_SIZE(aad)
    cdef unsigned char* out
    cdef const unsigned char* src = &data[0] if data.shape[0] else <const unsigned char*>b""
    if ops == NULL:
        raise MemoryError()
    try:
        total = _plan_opening(data, count, marker_key.encode(), descriptor, nonce_bytes, ops)
        if total < 0:
            return None
        opened = PyBytes_FromStringAndSize(NULL, total)
        out = <unsigned char*>PyBytes_AS_STRING(opened)
        ctx = gcm._borrow(False, nonce_bytes)
        borrowed = True
        with nogil:
            for i in range(count):
                if not _open_one(&ctx, src, out, &ops[i], aad_at, aad_len, nonce_bytes):
                    ok = False
                    break
    finally:
        if borrowed:
            gcm._give_back(ctx, False, nonce_bytes)
        PyMem_Free(ops)
    return opened if ok else None
