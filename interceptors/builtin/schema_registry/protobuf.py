"""Protobuf payloads: descriptors built from the registry's schema, the indexes choosing the type.

Contract: :func:`compile_protobuf` turns a registered Protobuf schema and its
references into a descriptor pool of its own. The registry may hold either form
a producer registered: ``.proto`` text (compiled by the ``protoc`` bundled in
``grpcio-tools``, in process, with the well-known ``google/protobuf/*.proto``
files on its include path; no ``protoc`` on PATH needed), or a base64-encoded
``FileDescriptorProto``, the form some serializers register (confluent-kafka's
``ProtobufSerializer`` registers one importing a well-known type, such as
``google/protobuf/timestamp.proto``, with no reference for it: the protobuf runtime's
own copy of that file is added). The frame's
message indexes choose the message type (``[0]`` the file's first message,
``[1, 0]`` the first message nested in the second), and the payload must parse
as that type with nothing left unexplained:

* bytes that are no Protobuf encoding, or a proto2 message missing a required
  field, fail to parse;
* a field the schema does not declare - or a declared field number sent with
  another wire type, which Protobuf keeps aside as an unknown field too - is
  refused, in the message or any message nested in it: such a payload was
  written with another schema, and a consumer built from this id's schema would
  silently drop the data. A producer whose schema gained a field registers the
  new schema and gets a new id, so this costs a correct producer nothing.
"""

from __future__ import annotations

import base64
import binascii
import importlib
import os
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

try:
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
    from google.protobuf.descriptor import Descriptor, FieldDescriptor
    from google.protobuf.message import DecodeError, Message
    from google.protobuf.unknown_fields import UnknownFieldSet
except ModuleNotFoundError as exc:  # pragma: no cover - the extra is installed in CI
    raise ImportError("the schema_registry interceptor needs protobuf: pip install "
                      "'.[schema-registry]' (from a kiproxy checkout)") from exc

from kiproxy.interceptors.builtin.schema_registry.formats import (
    PayloadError,
    SchemaCompileError,
    SchemaSource,
    check_each,
    walk_references,
)

if TYPE_CHECKING:
    from kiproxy.interceptors.api import Record

__all__ = ["ProtobufSchema", "compile_protobuf", "to_map"]

_PROTOC_LOCK = threading.Lock()  # protoc's in-process entry point is not documented as re-entrant
_WIRE_TYPES = {0: "varint", 1: "64-bit", 2: "length-delimited", 3: "group", 4: "group end",
               5: "32-bit"}


def _as_descriptor(text: str) -> descriptor_pb2.FileDescriptorProto | None:
    """The FileDescriptorProto ``text`` encodes in base64, or None for ``.proto`` text."""
    if "{" in text or ";" in text:
        return None
    try:
        raw = base64.b64decode(text, validate=True)
        return descriptor_pb2.FileDescriptorProto.FromString(raw)
    except (binascii.Error, DecodeError, ValueError):
        return None


def _protoc(files: dict[str, str], main: str) -> list[descriptor_pb2.FileDescriptorProto]:
    """``.proto`` texts (import path -> text) compiled, dependencies first."""
    from grpc_tools import protoc  # imported on first use: it loads protoc's C++ library

    well_known = str(Path(protoc.__file__).parent / "_proto")
    with tempfile.TemporaryDirectory(prefix="kiproxy-proto-") as tmp:
        for name, text in files.items():
            path = Path(tmp, name)
            if not path.resolve().is_relative_to(Path(tmp).resolve()):
                raise SchemaCompileError(f"reference name {name!r} leaves the import root")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        out = os.path.join(tmp, "out.pb")
        with _PROTOC_LOCK:
            code = protoc.main(["protoc", f"-I{tmp}", f"-I{well_known}", "--include_imports",
                                f"--descriptor_set_out={out}", os.path.join(tmp, main)])
        if code != 0 or not os.path.exists(out):
            raise SchemaCompileError("protoc could not compile it (its messages are in the "
                                     "proxy's standard error)")
        fds = descriptor_pb2.FileDescriptorSet.FromString(Path(out).read_bytes())
    return list(fds.file)


_WELL_KNOWN = "google/protobuf/"


def _well_known(name: str) -> descriptor_pb2.FileDescriptorProto | None:
    """The well-known file ``name`` (``google/protobuf/timestamp.proto``) as the protobuf
    runtime holds it, or None for any other name."""
    stem = name.removeprefix(_WELL_KNOWN).removesuffix(".proto")
    if not name.startswith(_WELL_KNOWN) or not name.endswith(".proto") or \
            not stem.isidentifier():
        return None
    try:
        importlib.import_module(f"google.protobuf.{stem}_pb2")
        found = descriptor_pool.Default().FindFileByName(name)
    except (ImportError, KeyError):
        return None
    fdp = descriptor_pb2.FileDescriptorProto()
    found.CopyToProto(fdp)
    return fdp


def _with_well_known(protos: list[descriptor_pb2.FileDescriptorProto]
                     ) -> list[descriptor_pb2.FileDescriptorProto]:
    """``protos`` after the well-known files they import and do not hold (and those
    files' own imports), dependencies first."""
    have = {p.name for p in protos}
    added: list[descriptor_pb2.FileDescriptorProto] = []

    def add(name: str) -> None:  # its imports first (the well-known ones are few and shallow)
        if name in have:
            return
        fdp = _well_known(name)
        if fdp is None:
            return  # the pool names it when it cannot build without it
        have.add(name)
        for dependency in fdp.dependency:
            add(dependency)
        added.append(fdp)

    for proto in protos:
        for dependency in proto.dependency:
            add(dependency)
    return [*added, *protos]


class ProtobufSchema:
    """One Protobuf schema id: its pool and the message classes its indexes reach."""

    uses_message_indexes = True
    schema_type = "PROTOBUF"

    def __init__(self, schema_id: int, pool: descriptor_pool.DescriptorPool,
                 main: descriptor_pb2.FileDescriptorProto) -> None:
        self.schema_id = schema_id
        self._pool = pool
        self._main = main
        self._classes: dict[tuple[int, ...], type[Message]] = {}

    def _descriptor(self, indexes: tuple[int, ...]) -> Descriptor:
        messages = self._main.message_type
        names: list[str] = []
        for index in indexes:
            if index >= len(messages):
                where = ".".join(names) or f"the file of schema id {self.schema_id}"
                raise PayloadError(f"message indexes {list(indexes)} name message {index} of "
                                   f"{where}, which has only {len(messages)}")
            names.append(messages[index].name)
            messages = messages[index].nested_type
        package = f"{self._main.package}." if self._main.package else ""
        if not names:
            raise PayloadError("empty message indexes")
        return self._pool.FindMessageTypeByName(package + ".".join(names))

    def _message_class(self, indexes: tuple[int, ...]) -> type[Message]:
        cls = self._classes.get(indexes)
        if cls is None:
            if len(self._classes) > 256:
                self._classes.clear()
            cls = self._classes[indexes] = message_factory.GetMessageClass(
                self._descriptor(indexes))
        return cls

    def record_name(self, indexes: tuple[int, ...]) -> str:
        """The full name of the message the indexes choose."""
        return str(self._descriptor(indexes).full_name)

    def check(self, payload: bytes | memoryview, indexes: tuple[int, ...] = (),
              start: int = 0) -> None:
        """:meth:`decode`'s verdict, the value dropped."""
        self.decode(memoryview(payload)[start:], indexes)

    def check_run(self, records: tuple[Record, ...], begin: int, frame: bytes) -> int:
        """Records from ``begin`` on checked one at a time (:func:`.formats.check_each`)."""
        return check_each(self, records, begin, frame)

    def decode(self, payload: memoryview, indexes: tuple[int, ...]) -> Message:
        """The parsed message; :class:`PayloadError` if it does not parse or has unknown fields."""
        cls = self._message_class(indexes)
        try:
            message = cls.FromString(bytes(payload))
        except (DecodeError, RuntimeError, ValueError) as exc:
            raise PayloadError(f"does not parse as {cls.DESCRIPTOR.full_name} (schema id "
                               f"{self.schema_id}): {exc}") from None
        problem = _unknown(message, "")
        if problem:
            raise PayloadError(f"{problem} ({cls.DESCRIPTOR.full_name}, schema id "
                               f"{self.schema_id}): the payload was written with another schema")
        return message


def _map_value(fd: Any) -> Any:
    """The value field of a map field's entry type, None when ``fd`` is no map."""
    entry = fd.message_type
    if entry is None or not entry.GetOptions().map_entry:
        return None
    return entry.fields_by_name["value"]


def _unknown(message: Message, path: str) -> str | None:
    unknown = UnknownFieldSet(message)
    if len(unknown):
        field = unknown[0]
        where = f" in {path}" if path else ""
        declared = message.DESCRIPTOR.fields_by_number.get(field.field_number)
        kind = _WIRE_TYPES.get(field.wire_type, str(field.wire_type))
        if declared is not None:
            return (f"field {declared.name}{where} (number {field.field_number}) arrived as "
                    f"{kind}, a wire type its declared type does not use")
        return f"field number {field.field_number}{where} ({kind}) is not in the schema"
    for fd, value in message.ListFields():
        if fd.type != FieldDescriptor.TYPE_MESSAGE:
            continue
        sub = f"{path}.{fd.name}" if path else fd.name
        map_value = _map_value(fd)
        if map_value is not None:
            items = value.values() if map_value.type == FieldDescriptor.TYPE_MESSAGE else ()
        elif fd.is_repeated:
            items = value
        else:
            items = (value,)
        for item in items:
            problem = _unknown(item, sub)
            if problem:
                return problem
    return None


_CEL_NATIVE = frozenset(f"google.protobuf.{name}" for name in (
    "Timestamp", "Duration", "Struct", "Value", "ListValue", "DoubleValue", "FloatValue",
    "Int64Value", "UInt64Value", "Int32Value", "UInt32Value", "BoolValue", "StringValue",
    "BytesValue"))
"""Well-known message types CEL reads as its own values (a timestamp, a duration, JSON,
the wrapped scalar): handed over as messages, not as maps of their fields."""


def _cel_value(message: Message) -> Any:
    return message if message.DESCRIPTOR.full_name in _CEL_NATIVE else to_map(message)


def to_map(message: Message) -> dict[str, Any]:
    """A message as CEL reads it: every field by its proto name (unset scalars at their
    defaults, unset message fields and oneof members absent), enums as numbers, a
    well-known type as CEL's own value (``google.protobuf.Timestamp`` a timestamp)."""
    out: dict[str, Any] = {}
    for fd in message.DESCRIPTOR.fields:
        if fd.has_presence and not message.HasField(fd.name):
            continue
        value = getattr(message, fd.name)
        if fd.type == FieldDescriptor.TYPE_MESSAGE:
            map_value = _map_value(fd)
            if map_value is not None:
                is_msg = map_value.type == FieldDescriptor.TYPE_MESSAGE
                out[fd.name] = {k: _cel_value(v) if is_msg else v for k, v in value.items()}
            elif fd.is_repeated:
                out[fd.name] = [_cel_value(v) for v in value]
            else:
                out[fd.name] = _cel_value(value)
        elif fd.is_repeated:
            out[fd.name] = list(value)
        else:
            out[fd.name] = value
    return out


def compile_protobuf(source: SchemaSource) -> ProtobufSchema:
    """Build the descriptor pool of ``source`` and its references."""
    where = f"schema id {source.schema_id}"
    main_name = f"kiproxy_schema_{source.schema_id}.proto"
    texts: dict[str, str] = {}
    protos: list[descriptor_pb2.FileDescriptorProto] = []
    for name, ref in walk_references(source):
        fdp = _as_descriptor(ref.schema)
        if fdp is None:
            texts[name] = ref.schema
        else:
            fdp.name = name  # imports name the file by its reference name
            protos.append(fdp)
    main = _as_descriptor(source.schema)
    try:
        if main is None:
            if protos:
                raise SchemaCompileError(f"{where}: .proto text referencing descriptor-form "
                                         "schemas is not supported")
            compiled = _protoc({**texts, main_name: source.schema}, main_name)
            protos = compiled
            main = next(p for p in compiled if p.name == main_name)
        else:
            main.name = main_name
            if texts:
                protos = _protoc(texts, next(iter(texts))) + protos
            protos.append(main)
        pool = descriptor_pool.DescriptorPool()
        added: set[str] = set()
        for fdp in _with_well_known(protos):
            if fdp.name not in added:
                pool.Add(fdp)
                added.add(fdp.name)
        pool.FindFileByName(main_name)
    except SchemaCompileError as exc:
        raise SchemaCompileError(f"{where}: {exc}") if not str(exc).startswith(where) \
            else exc from None
    except (TypeError, KeyError, ValueError) as exc:
        raise SchemaCompileError(f"{where}: the Protobuf schema does not build: {exc}") from None
    return ProtobufSchema(source.schema_id, pool, main)
