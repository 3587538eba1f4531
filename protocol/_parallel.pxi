# Loops whose cost is a whole Fetch answer's, split over threads without the GIL
# (included by _codec.pyx, after _gcm.pxi and _blocks.pxi).
#
# Contract. ``_run_tasks(fn, ctx, n, threads)`` calls ``fn(ctx, task, worker)`` once for
# every task in [0, n): on the calling thread (worker 0) and on up to ``threads - 1``
# POSIX threads started for the call and joined before it returns, so no thread
# outlives it; ``worker`` (below ``threads``) says which thread runs the task, for state
# that is one thread's alone. ``fn`` runs without the GIL and touches no Python object.
# A helper that cannot be started leaves its share to the others: the tasks all run.
#
# ``load_crc32c(path, symbol)`` binds CRC-32C to the ``crc32c`` package's own compiled
# function (that package computes every other CRC of the proxy, so both agree by
# construction), checked against the standard check value before it is used;
# ``verify_crcs`` checks many batches' CRCs and ``blocks_around`` writes many batches'
# headers with their CRCs, over ``threads``. Unbound, they compute the CRCs one after
# the other with the GIL held, through the package's Python function: the same answers.
#
# ``open_blocks`` is ``open_block`` for many blocks at once (a fetched partition's
# batches): each block is walked and validated with the GIL held, as ``open_block``
# walks it, then the values of every block are opened in chunks of records spread
# over ``threads``. A thread per call rather than a kept pool: a call is a whole
# partition's work (milliseconds), next to which starting a thread (tens of
# microseconds) is small, and nothing is left running between answers.

from cpython.buffer cimport PyBUF_READ

cdef extern from *:
    """
    #include <pthread.h>
    static Py_ssize_t kiproxy_next_task(Py_ssize_t* counter) {
        return __atomic_fetch_add(counter, 1, __ATOMIC_RELAXED);
    }
    """
    ctypedef unsigned long pthread_t
    int pthread_create(pthread_t* thread, void* attr, void* (*start)(void*) noexcept nogil,
                       void* arg) nogil
    int pthread_join(pthread_t thread, void** result) nogil
    Py_ssize_t kiproxy_next_task(Py_ssize_t* counter) nogil

ctypedef void (*_task_fn)(void* ctx, Py_ssize_t task, int worker) noexcept nogil

cdef enum:
    MAX_THREADS = 16
    _RECORDS_PER_TASK = 16


cdef struct _Tasks:
    _task_fn fn
    void* ctx
    Py_ssize_t n
    Py_ssize_t next      # the next task to take (atomic)


cdef struct _Worker:
    _Tasks* tasks
    int index


cdef void _work(_Tasks* t, int worker) noexcept nogil:
    cdef Py_ssize_t task = kiproxy_next_task(&t.next)
    while task < t.n:
        t.fn(t.ctx, task, worker)
        task = kiproxy_next_task(&t.next)


cdef void* _helper(void* arg) noexcept nogil:
    cdef _Worker* w = <_Worker*>arg
    _work(w.tasks, w.index)
    return NULL


cdef void _run_tasks(_task_fn fn, void* ctx, Py_ssize_t n, int threads) noexcept nogil:
    cdef _Tasks t
    cdef _Worker workers[MAX_THREADS]
    cdef pthread_t ids[MAX_THREADS]
    cdef int i, started = 0
    t.fn = fn
    t.ctx = ctx
    t.n = n
    t.next = 0
    threads = max(1, min(threads, MAX_THREADS, <int>min(n, MAX_THREADS)))
    for i in range(1, threads):
        workers[started].tasks = &t
        workers[started].index = started + 1
        if pthread_create(&ids[started], NULL, _helper, &workers[started]) != 0:
            break
        started += 1
    _work(&t, 0)
    for i in range(started):
        pthread_join(ids[i], NULL)


ctypedef uint32_t (*_crc_fn_t)(uint32_t crc, const unsigned char* data,
                                unsigned long n) noexcept nogil
cdef _crc_fn_t _crc = NULL


def load_crc32c(str path, str symbol):
    """Bind CRC-32C to ``symbol`` of the library at ``path`` (a function of the CRC
    register, the bytes and their length, without the final inversion, as the ``crc32c``
    package's extension has them); OSError when it cannot be, or does not give the
    CRC-32C check value and the ``crc32c`` package's CRC of a long sample."""
    global _crc
    if _crc != NULL:
        return
    cdef _crc_fn_t found = <_crc_fn_t>_symbol(_library(path), symbol.encode(), path)
    cdef bytes sample = bytes(range(256)) * 1031  # long enough for every code path
    if (~found(~(<uint32_t>0), <const unsigned char*>b"123456789", 9) != <uint32_t>0xE3069283
            or ~found(~(<uint32_t>0), <const unsigned char*>PyBytes_AS_STRING(sample),
                      PyBytes_GET_SIZE(sample)) != <uint32_t>_crc32c(sample)):
        raise OSError(f"{symbol} of {path} is not CRC-32C")
    _crc = found


def crc32c_bound():
    """Whether the CRCs of ``verify_crcs`` and ``blocks_around`` run through the bound
    function, over threads (``load_crc32c``), rather than in turn."""
    return _crc != NULL


cdef inline uint32_t _crc_of(const unsigned char* data, Py_ssize_t n, uint32_t crc
                             ) noexcept nogil:
    """The CRC-32C of ``data`` continuing ``crc``, as ``crc32c(data, crc)`` gives it."""
    return ~_crc(~crc, data, <unsigned long>n)


cdef struct _CrcJob:
    const unsigned char* head     # 40 bytes the CRC starts with, or NULL
    const unsigned char* data
    Py_ssize_t n
    uint32_t crc                  # the result


cdef void _crc_task(void* arg, Py_ssize_t task, int worker) noexcept nogil:
    cdef _CrcJob* job = (<_CrcJob*>arg) + task
    cdef uint32_t crc = 0 if job.head == NULL else _crc_of(job.head, 40, 0)
    job.crc = _crc_of(job.data, job.n, crc)


cdef void _crcs(_CrcJob* jobs, Py_ssize_t n, int threads) except *:
    """Every job's CRC: over ``threads`` without the GIL once bound, else in Python."""
    cdef Py_ssize_t i
    if _crc == NULL:
        for i in range(n):
            head = b"" if jobs[i].head == NULL else \
                PyBytes_FromStringAndSize(<const char*>jobs[i].head, 40)
            jobs[i].crc = _crc32c(PyMemoryView_FromMemory(<char*>jobs[i].data, jobs[i].n,
                                                          PyBUF_READ), _crc32c(head))
        return
    with nogil:
        _run_tasks(_crc_task, jobs, n, threads)


def verify_crcs(bytes frame not None, list starts not None, list ends not None,
                int threads):
    """The index of the first of the batches ``frame[starts[i]:ends[i]]`` whose CRC-32C
    is not the one its header holds, or -1; the CRCs computed over ``threads``."""
    cdef Py_ssize_t n = len(starts), i, start, end, size = PyBytes_GET_SIZE(frame)
    if len(ends) != n:
        raise ValueError(f"{n} starts and {len(ends)} ends")
    cdef const unsigned char* p = <const unsigned char*>PyBytes_AS_STRING(frame)
    cdef _CrcJob* jobs = <_CrcJob*>PyMem_Malloc(max(n, 1) * sizeof(_CrcJob))
    if jobs == NULL:
        raise MemoryError()
    try:
        for i in range(n):
            start, end = starts[i], ends[i]
            if start < 0 or end > size or end - start < 61:
                raise ValueError(f"batch {i}: bytes {start} to {end} of {size} are no batch")
            jobs[i].head = NULL
            jobs[i].data = p + start + 21
            jobs[i].n = end - start - 21
        _crcs(jobs, n, threads)
        for i in range(n):
            if jobs[i].crc != <uint32_t>_be32(p + <Py_ssize_t>starts[i] + 17):
                return i
        return -1
    finally:
        PyMem_Free(jobs)


def blocks_around(list headers not None, list blocks not None, int threads):
    """:func:`batch_around` of each ``headers[i]`` (its attributes, last offset delta,
    max timestamp and record count kept) around ``blocks[i]`` (bytes, uncompressed or
    already compressed as the header says), the CRCs computed over ``threads``: a list
    of the three pieces, or None where :func:`batch_around` gives None."""
    cdef Py_ssize_t n = len(headers), i, k = 0
    if len(blocks) != n:
        raise ValueError(f"{n} headers and {len(blocks)} blocks")
    cdef list out = [None] * n
    cdef _CrcJob* jobs = <_CrcJob*>PyMem_Malloc(max(n, 1) * sizeof(_CrcJob))
    cdef Py_ssize_t* where = <Py_ssize_t*>PyMem_Malloc(max(n, 1) * sizeof(Py_ssize_t))
    cdef tuple pieces
    if jobs == NULL or where == NULL:
        PyMem_Free(jobs)
        PyMem_Free(where)
        raise MemoryError()
    try:
        for i in range(n):
            h, block = headers[i], blocks[i]
            pieces = _pieces_around(h, h.attributes, h.last_offset_delta, h.max_timestamp,
                                    h.record_count, block, False)
            if pieces is None:
                continue
            out[i] = pieces
            jobs[k].head = <const unsigned char*>PyBytes_AS_STRING(pieces[1])
            jobs[k].data = <const unsigned char*>PyBytes_AS_STRING(block)
            jobs[k].n = PyBytes_GET_SIZE(block)
            where[k] = i
            k += 1
        _crcs(jobs, k, threads)
        for i in range(k):  # into the prefixes made above, not yet seen by anyone
            _put_be(<unsigned char*>PyBytes_AS_STRING((<tuple>out[where[i]])[0]) + 17,
                    jobs[i].crc, 4)
        return out
    finally:
        PyMem_Free(where)
        PyMem_Free(jobs)


cdef struct _OpenAll:
    # What the tasks of open_blocks share: every record's opening, in block order.
    _Opening* ops
    Py_ssize_t* block_of           # the block of each opening
    const unsigned char** src      # each block's records
    unsigned char** dst            # each opened block (NULL: not opened)
    unsigned char* opened          # each opening: 1 when its value opened
    GcmCtx* contexts               # what each worker seals or opens with
    Py_ssize_t n_ops
    const unsigned char* aad
    Py_ssize_t aad_len
    Py_ssize_t nonce_bytes


cdef void _open_task(void* arg, Py_ssize_t task, int worker) noexcept nogil:
    cdef _OpenAll* a = <_OpenAll*>arg
    cdef Py_ssize_t i, b
    cdef Py_ssize_t end = min(a.n_ops, (task + 1) * _RECORDS_PER_TASK)
    for i in range(task * _RECORDS_PER_TASK, end):
        b = a.block_of[i]
        a.opened[i] = _open_one(&a.contexts[worker], a.src[b], a.dst[b], &a.ops[i], a.aad,
                                a.aad_len, a.nonce_bytes)


def open_blocks(list blocks not None, list counts not None, str marker_key not None,
                bytes descriptor not None, object decrypt, bytes aad,
                Py_ssize_t nonce_bytes, int threads):
    """:func:`open_block` of each block of ``blocks`` (``counts[i]`` records each, all
    sealed under one ``descriptor``), its cipher calls spread over ``threads`` threads:
    a list with, for each block, its opened block or None (as :func:`open_block` says
    None, and for a malformed block: the caller then takes its general path for that
    block alone, which says why); all are None when ``decrypt`` is another cipher."""
    cdef Py_ssize_t n = len(blocks), i, k, total, n_ops = 0
    if len(counts) != n:
        raise ValueError(f"{n} blocks and {len(counts)} counts")
    cdef list out = [None] * n
    cdef AesGcm gcm = _gcm_of(decrypt, "decrypt")
    if gcm is None or n == 0:
        return out
    if aad is None:
        aad = b""
    threads = max(1, min(threads, MAX_THREADS))
    for i in range(n):
        if counts[i] < 0:
            raise ValueError(f"block {i}: a count of {counts[i]}")
        n_ops += <Py_ssize_t>counts[i]
    cdef bytes marker = marker_key.encode()
    cdef list views = [None] * n
    cdef const unsigned char[::1] view
    cdef _OpenAll a
    a.ops = <_Opening*>PyMem_Malloc(max(n_ops, 1) * sizeof(_Opening))
    a.block_of = <Py_ssize_t*>PyMem_Malloc(max(n_ops, 1) * sizeof(Py_ssize_t))
    a.src = <const unsigned char**>PyMem_Malloc(n * sizeof(void*))
    a.dst = <unsigned char**>PyMem_Malloc(n * sizeof(void*))
    a.opened = <unsigned char*>PyMem_Malloc(max(n_ops, 1))
    a.contexts = <GcmCtx*>PyMem_Malloc(threads * sizeof(GcmCtx))
    a.aad = <const unsigned char*>PyBytes_AS_STRING(aad)
    a.aad_len = PyBytes_GET_SIZE(aad)
    a.nonce_bytes = nonce_bytes
    a.n_ops = 0
    cdef int made = 0
    try:
        if (a.ops == NULL or a.block_of == NULL or a.src == NULL or a.dst == NULL
                or a.opened == NULL or a.contexts == NULL):
            raise MemoryError()
        for i in range(n):
            view = blocks[i]
            views[i] = view  # held until the tasks are done
            a.src[i] = &view[0] if view.shape[0] else <const unsigned char*>b""
            a.dst[i] = NULL
            try:
                total = _plan_opening(view, counts[i], marker, descriptor, nonce_bytes,
                                      a.ops + a.n_ops)
            except CorruptBatch:
                continue
            if total < 0:
                continue
            opened = PyBytes_FromStringAndSize(NULL, total)
            out[i] = opened
            a.dst[i] = <unsigned char*>PyBytes_AS_STRING(opened)
            for k in range(a.n_ops, a.n_ops + <Py_ssize_t>counts[i]):
                a.block_of[k] = i
            a.n_ops += <Py_ssize_t>counts[i]
        threads = max(1, min(threads, <int>((a.n_ops + _RECORDS_PER_TASK - 1)
                                            // _RECORDS_PER_TASK)))
        a.contexts[0] = gcm._borrow(False, nonce_bytes)
        made = 1
        while made < threads:
            a.contexts[made] = gcm._another(a.contexts[0], False, nonce_bytes)
            made += 1
        with nogil:
            _run_tasks(_open_task, &a, (a.n_ops + _RECORDS_PER_TASK - 1) // _RECORDS_PER_TASK,
                       threads)
        for k in range(a.n_ops):
            if not a.opened[k]:
                out[a.block_of[k]] = None
        return out
    finally:
        if made:
            gcm._give_back(a.contexts[0], False, nonce_bytes)
        for i in range(1, made):
            if a.contexts[i].evp != NULL:
                _evp.ctx_free(a.contexts[i].evp)
        PyMem_Free(a.contexts)
        PyMem_Free(a.opened)
        PyMem_Free(a.dst)
        PyMem_Free(a.src)
        PyMem_Free(a.block_of)
        PyMem_Free(a.ops)
