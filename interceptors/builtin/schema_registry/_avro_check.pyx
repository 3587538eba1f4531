# cython: language_level=3
"""Avro binary checked against a schema, in C: does a payload decode, and consume every byte?

Contract: a :class:`Node` graph describes a schema (built by
``avro.py`` from fastavro's parsed schema; named types may refer to themselves).
:meth:`Checker.check` walks ``data[start:]`` with it and returns None when the
bytes are exactly one datum of the schema, per the Avro specification's binary
encoding; otherwise it raises :class:`AvroCheckError` whose ``path`` names the
field (outermost first) and whose ``problem`` says what was wrong. It builds
no Python values, so a valid record costs a walk over its bytes.

Stricter than a lenient reader on purpose: a length or count past the end of
the payload, a negative length, a union branch or enum symbol out of range, a
varint longer than 10 bytes (5 for ``int``) or past 64 bits, an ``int`` outside 32 bits,
string bytes that are not UTF-8 (Python's strict decoder decides), nesting
deeper than ``MAX_DEPTH``, an array or map block claiming more items than
bytes left (or, for items written in no bytes, more than ``MAX_EMPTY_ITEMS``)
and bytes left over are all refusals. A boolean
byte other than 0 and 1 is accepted, as Avro's Java and fastavro readers
accept it. Logical types are checked as the type they annotate.

A :class:`Checker` keeps the failure it is explaining on itself; the walk holds
the GIL from start to end (it never runs Python bytecode), so one instance
serves every thread. The walk is plain C over the buffer (no fastavro, no per-field Python calls),
which is why this module exists: fastavro spends about 5 us building the
dict of a 10-field record that this check walks in a fraction of that.
"""

from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE
from cpython.ref cimport PyObject
from cpython.tuple cimport PyTuple_GET_ITEM, PyTuple_GET_SIZE
from libc.stdint cimport uint64_t
from libc.string cimport memcmp, memcpy

cdef extern from "Python.h":
    object PyUnicode_DecodeUTF8(const char *s, Py_ssize_t size, const char *errors)

__all__ = ["AvroCheckError", "Checker", "MAX_DEPTH", "MAX_EMPTY_ITEMS", "Node"]

cdef enum:
    C_MAX_DEPTH = 256
    C_MAX_EMPTY_ITEMS = 1 << 20

MAX_DEPTH = C_MAX_DEPTH
MAX_EMPTY_ITEMS = C_MAX_EMPTY_ITEMS

# Node kinds (the names avro.py passes).
cdef enum Kind:
    K_NULL = 0
    K_BOOLEAN = 1
    K_INT = 2
    K_LONG = 3
    K_FLOAT = 4
    K_DOUBLE = 5
    K_BYTES = 6
    K_STRING = 7
    K_FIXED = 8
    K_ENUM = 9
    K_ARRAY = 10
    K_MAP = 11
    K_UNION = 12
    K_RECORD = 13

KINDS = {"null": K_NULL, "boolean": K_BOOLEAN, "int": K_INT, "long": K_LONG,
         "float": K_FLOAT, "double": K_DOUBLE, "bytes": K_BYTES, "string": K_STRING,
         "fixed": K_FIXED, "enum": K_ENUM, "array": K_ARRAY, "map": K_MAP,
         "union": K_UNION, "record": K_RECORD}


class AvroCheckError(ValueError):
    """A payload that is not one datum of the schema: ``path`` (field names) and ``problem``."""

    def __init__(self, problem, path=(), expected=None, left_over=0):
        super().__init__(problem)
        self.problem = problem
        self.path = tuple(path)
        self.expected = expected
        """The type of the innermost field on ``path`` (None without a path)."""
        self.left_over = left_over
        """Bytes after a whole datum (0 when the datum itself failed)."""


cdef class Node:
    """One schema node: its kind, a size (fixed bytes, enum symbols, union branches),
    its children (record fields, union branches, or the one array item / map value
    type) and, for a record, its field names."""

    cdef int kind
    cdef Py_ssize_t size
    cdef tuple children
    cdef tuple names
    cdef str desc
    cdef bint zero

    def __init__(self, str kind, str desc):
        self.kind = KINDS[kind]
        self.desc = desc
        self.size = 0
        self.zero = False
        self.children = ()
        self.names = ()

    def set(self, tuple children=(), tuple names=(), Py_ssize_t size=0, bint zero=False):
        """Fill the node (a named record is created first, so it can refer to itself);
        ``zero``: it is always written in no bytes (null, records of such)."""
        for child in children:
            if not isinstance(child, Node):
                raise TypeError("children must be Nodes")
        self.children = children
        self.names = names
        self.size = size
        self.zero = zero


cdef inline bint _ascii(const unsigned char *p, Py_ssize_t n) noexcept:
    """True when no byte of ``p[:n]`` has its high bit set (8 bytes at a time)."""
    cdef uint64_t word
    cdef Py_ssize_t i = 0
    while i + 8 <= n:
        memcpy(&word, p + i, 8)
        if word & 0x8080808080808080ULL:
            return False
        i += 8
    while i < n:
        if p[i] & 0x80:
            return False
        i += 1
    return True


cdef struct Cursor:
    const unsigned char *buf
    Py_ssize_t pos
    Py_ssize_t end
    int depth


cdef class Checker:
    """A schema's root node, ready to check payloads."""

    cdef Node root
    cdef list _path
    cdef str _problem
    cdef str _expected

    def __init__(self, Node root):
        self.root = root

    def check(self, object data, Py_ssize_t start=0):
        """None when ``data[start:]`` is one datum of the schema; else :class:`AvroCheckError`."""
        cdef Cursor cur
        cdef Py_buffer view
        cdef int failed
        if start < 0:
            raise ValueError("start must not be negative")
        self._path = None
        self._problem = None
        self._expected = None
        if type(data) is bytes:
            cur.buf = <const unsigned char *>PyBytes_AS_STRING(data)
            cur.end = PyBytes_GET_SIZE(data)
            cur.pos = start
            cur.depth = 0
            failed = self._walk(self.root, &cur)
        else:
            PyObject_GetBuffer(data, &view, PyBUF_SIMPLE)
            try:
                cur.buf = <const unsigned char *>view.buf
                cur.end = view.len
                cur.pos = start
                cur.depth = 0
                failed = self._walk(self.root, &cur)
            finally:
                PyBuffer_Release(&view)
        if not failed and cur.pos > cur.end:  # start was past the end
            self._fail("the payload ends too early")
            failed = 1
        if not failed and cur.pos < cur.end:
            raise AvroCheckError(f"{cur.end - cur.pos} byte(s) left over after the datum: "
                                 "the payload was written with another schema",
                                 left_over=cur.end - cur.pos)
        if failed:
            path = self._path or []
            path.reverse()
            raise AvroCheckError(self._problem, path, self._expected)

    def check_run(self, tuple records, Py_ssize_t begin, bytes frame):
        """The index of the first record from ``begin`` on that this call did not accept:
        each record's value must be bytes starting with ``frame`` (the 5 framing bytes)
        and hold one datum after it. ``len(records)`` when it accepted them all. A
        record it stops at is for the caller to judge (and explain)."""
        cdef Py_ssize_t n = PyTuple_GET_SIZE(records)
        cdef Py_ssize_t flen = PyBytes_GET_SIZE(frame)
        cdef const char *fbuf = PyBytes_AS_STRING(frame)
        cdef Py_ssize_t i
        cdef Cursor cur
        for i in range(begin, n):
            value = (<object>PyTuple_GET_ITEM(records, i)).value
            if type(value) is not bytes:
                return i
            cur.end = PyBytes_GET_SIZE(value)
            cur.buf = <const unsigned char *>PyBytes_AS_STRING(value)
            if cur.end < flen or memcmp(cur.buf, fbuf, flen) != 0:
                return i
            cur.pos = flen
            cur.depth = 0
            if self._walk(self.root, &cur) or cur.pos != cur.end:
                return i
        return n

    cdef int _fail(self, str problem) except -1:
        self._problem = problem
        self._path = []
        return 1

    cdef int _varint(self, Cursor *cur, long long *out, int max_bytes) except -1:
        cdef unsigned long long n = 0
        cdef unsigned long long b
        cdef int shift = 0
        cdef int count = 0
        while True:
            if cur.pos >= cur.end:
                return self._fail("the payload ends too early")
            b = cur.buf[cur.pos]
            cur.pos += 1
            count += 1
            if count > max_bytes:
                return self._fail(f"a varint longer than {max_bytes} bytes")
            if count == 10 and b > 1:  # the tenth byte holds the 64th bit only
                return self._fail("a varint beyond 64 bits")
            n |= (b & 0x7F) << shift
            if not (b & 0x80):
                break
            shift += 7
        out[0] = <long long>((n >> 1) ^ (-(n & 1)))
        return 0

    cdef int _length(self, Cursor *cur, long long *out) except -1:
        """A length (bytes, string, block byte size) that fits in what is left."""
        if self._varint(cur, out, 10):
            return 1
        if out[0] < 0:
            return self._fail(f"a negative length ({out[0]})")
        if out[0] > cur.end - cur.pos:
            return self._fail(f"a length of {out[0]} byte(s) where {cur.end - cur.pos} "
                              "are left: the payload ends too early")
        return 0

    cdef int _string(self, Cursor *cur) except -1:
        cdef long long n
        cdef Py_ssize_t i
        cdef const unsigned char *p
        if self._length(cur, &n):
            return 1
        p = cur.buf + cur.pos
        if not _ascii(p, n):
            try:
                PyUnicode_DecodeUTF8(<const char *>p, n, "strict")
            except UnicodeDecodeError as exc:
                return self._fail(f"a string that is not UTF-8 ({exc.reason} at byte "
                                  f"{exc.start})")
        cur.pos += n
        return 0

    cdef int _blocks(self, Node node, Cursor *cur, bint is_map) except -1:
        cdef long long count
        cdef long long size
        cdef long long i
        cdef long long index = 0
        cdef Node item = <Node>PyTuple_GET_ITEM(node.children, 0)
        while True:
            if self._varint(cur, &count, 10):
                return 1
            if count == 0:
                return 0
            if count < 0:
                if count == -9223372036854775807 - 1:
                    return self._fail("a block count out of range")
                count = -count
                if self._length(cur, &size):
                    return 1
            if item.zero and not is_map:  # nulls, records of nulls: nothing to walk
                if index + count > C_MAX_EMPTY_ITEMS:
                    return self._fail(f"more than {MAX_EMPTY_ITEMS} items of no width")
                index += count
                continue
            if count > cur.end - cur.pos:  # every other item (and map key) takes a byte
                return self._fail(f"a block of {count} item(s) where {cur.end - cur.pos} "
                                  "byte(s) are left")
            for i in range(count):
                if is_map and self._string(cur):
                    self._path.append(f"[key {index}]")
                    return 1
                if self._walk(item, cur):
                    self._path.append(f"[{index}]")
                    return 1
                index += 1

    cdef int _walk(self, Node node, Cursor *cur) except -1:
        cdef long long v
        cdef Py_ssize_t i
        cdef Py_ssize_t n
        cdef Node child
        cdef int kind = node.kind
        if kind == K_STRING or kind == K_BYTES:
            if kind == K_STRING:
                return self._string(cur)
            if self._length(cur, &v):
                return 1
            cur.pos += v
            return 0
        if kind == K_LONG:
            return self._varint(cur, &v, 10)
        if kind == K_INT:
            if self._varint(cur, &v, 5):
                return 1
            if v < -2147483648 or v > 2147483647:
                return self._fail(f"an int out of 32-bit range ({v})")
            return 0
        if kind == K_RECORD:
            if node.zero:  # nulls, records of nulls: written in no bytes, nothing to walk
                return 0  # (walking them could take time exponential in their nesting)
            cur.depth += 1
            if cur.depth > C_MAX_DEPTH:
                return self._fail(f"records nested deeper than {MAX_DEPTH} levels")
            n = PyTuple_GET_SIZE(node.children)
            for i in range(n):
                child = <Node>PyTuple_GET_ITEM(node.children, i)
                if self._walk(child, cur):
                    if self._expected is None:
                        self._expected = child.desc
                    self._path.append(<object>PyTuple_GET_ITEM(node.names, i))
                    return 1
            cur.depth -= 1
            return 0
        if kind == K_DOUBLE or kind == K_FLOAT or kind == K_BOOLEAN or kind == K_FIXED:
            n = 8 if kind == K_DOUBLE else 4 if kind == K_FLOAT else 1 if kind == K_BOOLEAN \
                else node.size
            if cur.end - cur.pos < n:
                return self._fail("the payload ends too early")
            cur.pos += n
            return 0
        if kind == K_NULL:
            return 0
        if kind == K_UNION or kind == K_ENUM:
            if self._varint(cur, &v, 10):
                return 1
            if v < 0 or v >= node.size:
                what = "union branch" if kind == K_UNION else "enum symbol"
                return self._fail(f"{what} {v} where the schema has {node.size}")
            if kind == K_ENUM:
                return 0
            cur.depth += 1
            if cur.depth > C_MAX_DEPTH:
                return self._fail(f"values nested deeper than {MAX_DEPTH} levels")
            if self._walk(<Node>PyTuple_GET_ITEM(node.children, v), cur):
                return 1
            cur.depth -= 1
            return 0
        if kind == K_ARRAY or kind == K_MAP:
            cur.depth += 1
            if cur.depth > C_MAX_DEPTH:
                return self._fail(f"values nested deeper than {MAX_DEPTH} levels")
            if self._blocks(node, cur, kind == K_MAP):
                return 1
            cur.depth -= 1
            return 0
        return self._fail(f"an unknown node kind {kind}")  # pragma: no cover
