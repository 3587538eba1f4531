# Instances of frozen, slotted dataclasses made from their fields' values in compiled code
# (included by _codec.pyx).
#
# Contract. ``SlotsMaker(cls)`` for a dataclass ``cls`` declared with ``slots=True``
# (frozen or not) is a callable taking one value per field of ``cls``, positionally, in
# declaration order (``dataclasses.fields(cls)``), that returns a new ``cls`` instance
# holding them: the instance ``cls(**fields)`` makes, without running ``__init__`` - so
# no default, no ``default_factory`` and no ``__post_init__``; a class with a
# ``__post_init__`` is refused. A wrong number of values is a TypeError. The class
# itself is untouched: it stays frozen for everyone else (setting a field still raises
# ``FrozenInstanceError``).
#
# Why: a frozen dataclass's ``__init__`` sets each field through
# ``object.__setattr__``, a Python-level call per field; the proxy makes a
# ``RecordBatch`` and an ``InterceptContext`` (19 fields between them) for every batch it
# hands to a plugin, which cost a one-record Produce request about a tenth of its
# instructions. Here each field is one call of its slot's setter in C.

from cpython.object cimport PyTypeObject

ctypedef int (*_descr_set_t)(object, object, object) except -1

cdef extern from "Python.h":
    PyTypeObject* _type_of "Py_TYPE" (object)


cdef class SlotsMaker:
    """Makes instances of a slotted dataclass from its fields' values (module comment)."""

    cdef readonly object cls
    cdef tuple _slots
    cdef Py_ssize_t _n

    def __init__(self, cls):
        import dataclasses
        if not dataclasses.is_dataclass(cls) or not isinstance(cls, type):
            raise TypeError(f"{cls!r} is not a dataclass")
        if hasattr(cls, "__post_init__"):
            raise TypeError(f"{cls.__qualname__} has a __post_init__, which a SlotsMaker "
                            "does not run")
        slots = []
        for f in dataclasses.fields(cls):
            slot = cls.__dict__.get(f.name)
            if type(slot).__name__ != "member_descriptor":
                raise TypeError(f"{cls.__qualname__}.{f.name} is not a slot "
                                "(declare the dataclass with slots=True)")
            slots.append(slot)
        self.cls = cls
        self._slots = tuple(slots)
        self._n = len(slots)

    def __call__(self, *values):
        cdef Py_ssize_t i
        if len(values) != self._n:
            raise TypeError(f"{self.cls.__qualname__} has {self._n} fields; "
                            f"{len(values)} values given")
        obj = object.__new__(self.cls)
        for i in range(self._n):
            slot = self._slots[i]
            (<_descr_set_t>_type_of(slot).tp_descr_set)(slot, obj, values[i])
        return obj
