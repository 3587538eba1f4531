"""The Wasm runtime of the ``wasm`` built-in: interceptors compiled to WebAssembly.

Owns everything between the interceptor API and a sandboxed WebAssembly
module, in four parts, each importing only the ones above it:

* :mod:`.declaration` - what a module says about itself (its
  ``kiproxy.interceptor`` custom section) and how config overrides it.
* :mod:`.abi` - the bytes exchanged with a module: the input a batch or record
  is written as (JSON or binary) and the result read back.
* :mod:`.engine` - wasmtime: compiling, instances, fuel, the memory cap, epoch
  interruption at the deadline, recompiling a changed file (the pool of instances
  and the file watch are the Wasm host's,
  :mod:`~kiproxy.interceptors.builtin.sandbox`). The only module that
  imports ``wasmtime`` (an optional dependency, ``pip install
  '.[wasm]'`` from a kiproxy checkout), and only when a module is configured.
* :mod:`.interceptor` - :class:`WasmInterceptor`, the built-in users configure
  (by the short name ``wasm`` or as
  ``kiproxy.interceptors.builtin.wasm:WasmInterceptor``): config, and the
  topic's module run through the host's
  :class:`~kiproxy.interceptors.builtin.sandbox.SandboxHost` (per-topic modules,
  worker threads), as the ``extism`` built-in runs Extism's ABI.

Like every built-in it uses only the public API (:mod:`kiproxy.interceptors`)
and never the runtime; the rules a batch is judged by are the verdict's.
"""

from kiproxy.interceptors.builtin.wasm.interceptor import (
    STATUS_OK,
    STATUS_REJECT,
    STATUS_UNCHANGED,
    WasmInterceptor,
    decode_result,
    encode_input,
)

__all__ = [
    "STATUS_OK",
    "STATUS_REJECT",
    "STATUS_UNCHANGED",
    "WasmInterceptor",
    "decode_result",
    "encode_input",
]
