"""``KeyFileKms``: KEKs from a local JSON or YAML file, for development and tests.

Contract. The file names 256-bit KEKs, each with numbered versions and the version
that wraps new data keys::

    keys:
      KEK_orders:
        current: 2            # new data keys are wrapped under version 2
        versions:
          1: 3q2+7w...base64 of 32 bytes...
          2: yv66vg...

A reference is a key's name, and the name is its id. A data key is 32 random bytes
wrapped with AES-256-GCM under the current version; the wrapped form is::

    version  u32 big-endian   the KEK version that wrapped it
    nonce    12 bytes         random
    sealed   48 bytes         the data key (32) and the GCM tag (16)

with the KEK's name as associated data, so a wrapped key only unwraps under the key
it names. A key rotated by adding a version and moving ``current`` still unwraps the
data keys of every version left in the file. AES-GCM rather than AES key wrap
(RFC 3394) because it binds the key name as associated data, which AES-KW cannot.

The file is read once, when the provider is made; a file that does not parse, a
key that is not 32 bytes of base64 or a ``current`` with no version is a
:class:`ValueError` naming the file and the key. A name the file does not hold is a
:meth:`~KeyFileKms.reference_problem` (the built-in refuses a configuration that
fixes such a key). This provider does no I/O after
that and is never :class:`~.kms.KmsUnavailable`.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import struct
from collections.abc import Mapping
from pathlib import Path

import yaml
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from .kms import DATA_KEY_BYTES, DataKey, KmsProvider, Undecryptable, UnresolvedKey

__all__ = ["KeyFileKms", "write_key_file"]

_VERSION = struct.Struct(">I")
_NONCE_BYTES = 12
_WRAPPED_BYTES = _VERSION.size + _NONCE_BYTES + DATA_KEY_BYTES + 16
_AAD_PREFIX = b"kiproxy key file\x00"


class _Kek:
    __slots__ = ("current", "versions")

    def __init__(self, current: int, versions: dict[int, AESGCM]) -> None:
        self.current = current
        self.versions = versions


def _parse(path: Path) -> dict[str, _Kek]:
    text = path.read_text(encoding="utf-8")
    try:
        raw = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as exc:
        raise ValueError(f"key file {path}: does not parse: {exc}") from None
    if not isinstance(raw, Mapping) or not isinstance(raw.get("keys"), Mapping):
        raise ValueError(f"key file {path}: expected a mapping with `keys:` "
                         "(name -> {current, versions})")
    keks: dict[str, _Kek] = {}
    for name, entry in raw["keys"].items():
        where = f"key file {path}: keys.{name}"
        if not isinstance(entry, Mapping) or not isinstance(entry.get("versions"), Mapping):
            raise ValueError(f"{where}: expected `current` and `versions`")
        versions: dict[int, AESGCM] = {}
        for version, encoded in entry["versions"].items():
            try:
                number = int(version)
                key = base64.b64decode(str(encoded), validate=True)
            except (ValueError, binascii.Error):
                raise ValueError(f"{where}.versions.{version}: expected a version number "
                                 "and 32 bytes of base64") from None
            if len(key) != DATA_KEY_BYTES or not 0 < number < 2**32:
                raise ValueError(f"{where}.versions.{version}: a key is 32 bytes of base64 "
                                 f"(got {len(key)}) under a version 1..2^32-1")
            versions[number] = AESGCM(key)
        current = entry.get("current")
        if not isinstance(current, int) or current not in versions:
            raise ValueError(f"{where}.current: {current!r} is not one of its versions "
                             f"{sorted(versions)}")
        keks[str(name)] = _Kek(current, versions)
    return keks


class KeyFileKms(KmsProvider):
    """KEKs read from a local file (see the module docstring)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise ValueError(f"key file {self.path}: no such file")
        self._keks = _parse(self.path)

    def reference_problem(self, reference: str) -> str | None:
        """A name the file does not hold (the file is read once: it never will)."""
        if reference in self._keks:
            return None
        return (f"key file {self.path} has no key {reference!r} (it has "
                f"{sorted(self._keks)}); add the key to the file or name one it has")

    async def resolve_key(self, reference: str) -> str:
        problem = self.reference_problem(reference)
        if problem is not None:
            raise UnresolvedKey(problem)
        return reference

    async def generate_data_key(self, key_id: str) -> DataKey:
        kek = self._keks.get(key_id)
        if kek is None:
            raise UnresolvedKey(f"key file {self.path} has no key {key_id!r}")
        plaintext = os.urandom(DATA_KEY_BYTES)
        nonce = os.urandom(_NONCE_BYTES)
        sealed = kek.versions[kek.current].encrypt(nonce, plaintext, _aad(key_id))
        return DataKey(key_id=key_id, plaintext=plaintext,
                       wrapped=_VERSION.pack(kek.current) + nonce + sealed)

    async def decrypt_data_key(self, key_id: str, wrapped: bytes) -> bytes:
        kek = self._keks.get(key_id)
        if kek is None:
            raise Undecryptable(f"key file {self.path} has no key {key_id!r}: a data key "
                                "wrapped under it cannot be unwrapped")
        if len(wrapped) != _WRAPPED_BYTES:
            raise Undecryptable(f"a data key wrapped under {key_id!r} is {_WRAPPED_BYTES} "
                                f"bytes, not {len(wrapped)}")
        (version,) = _VERSION.unpack_from(wrapped)
        aead = kek.versions.get(version)
        if aead is None:
            raise Undecryptable(f"key file {self.path}: key {key_id!r} has no version "
                                f"{version} any more (it has {sorted(kek.versions)})")
        nonce = wrapped[_VERSION.size:_VERSION.size + _NONCE_BYTES]
        try:
            return aead.decrypt(nonce, wrapped[_VERSION.size + _NONCE_BYTES:], _aad(key_id))
        except InvalidTag:
            raise Undecryptable(f"a data key wrapped under {key_id!r} version {version} "
                                "does not unwrap: it is damaged or was wrapped by another "
                                "key") from None


def _aad(key_id: str) -> bytes:
    return _AAD_PREFIX + key_id.encode()


def write_key_file(path: str | os.PathLike[str],
                   keys: Mapping[str, tuple[int, Mapping[int, bytes]]]) -> None:
    """Write a key file: ``{name: (current, {version: 32-byte key})}`` (tests, tooling)."""
    document = {"keys": {
        name: {"current": current,
               "versions": {v: base64.b64encode(k).decode() for v, k in versions.items()}}
        for name, (current, versions) in keys.items()}}
    Path(path).write_text(json.dumps(document, indent=2) if str(path).endswith(".json")
                          else yaml.safe_dump(document), encoding="utf-8")
