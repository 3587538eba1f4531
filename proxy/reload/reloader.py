"""Hot reload: which settings change live, how a change is noticed, and the switch.

Contract:

- A reload reads the config file again and applies the command-line overrides
  the process started with, exactly as at start (flags win over the file).
- It is all or nothing. The new configuration is validated, checked against
  the settings that need a restart (:data:`RESTART_ONLY`), and then built
  completely - interceptors imported and configured, observers opened, TLS
  material loaded - by the caller's ``build`` function. Only then does
  ``apply`` switch to it. Any failure on the way leaves the running
  configuration untouched, and the reason is returned, logged and counted.
- Reloads never run concurrently. A trigger that arrives while a reload runs is
  coalesced into one more reload after it (100 triggers while one build runs cost
  two builds; triggers spaced wider than a build each cost one), and its caller
  gets that reload's result.
- The file watch (:class:`FileWatch`) polls content hashes, so it sees a
  Kubernetes ConfigMap update (a symlink swap) as well as an edit in place, and
  it waits until the watched files have stopped changing for ``debounce``
  seconds before it triggers: a certificate that is still being written is not
  applied half-written, and if it is caught between two writes anyway, it fails
  validation and the next change triggers again. It measures change from the
  files the running configuration was built from, whichever trigger built it
  (:meth:`FileWatch.applied`): a file edited, reloaded by signal and then put
  back is reloaded again, not taken for unchanged.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from kiproxy.proxy.config.model import ProxyConfig

log = logging.getLogger("kiproxy.reload")

__all__ = [
    "RESTART_ONLY",
    "FileWatch",
    "ReloadResult",
    "Reloader",
    "restart_only_changes",
    "watched_paths",
]

RESTART_ONLY: tuple[str, ...] = (
    "listen",
    "advertised_host",
    "broker_port_start",
    "node_ports",
    "workers",
    "metrics_listen",
    "admin",
    "upstream",
    "upstream_tls",
    "log_format",
    "reload",
    "max_decode_memory",
    "max_client_buffered_bytes",
    "max_decompressed_batch_bytes",
    "max_decompression_ratio",
    "dead_letter_sink",
    "audit_sink",
)
"""Settings that decide sockets, processes or the cluster the proxy fronts.

Changing one needs a restart; a reload that changes one is refused as a whole.
The decode and receive budgets and the decompression limits are process-wide
(shared by requests of every generation), so they are restart-only too, as are the
dead-letter and audit sinks (one producer each for the process, connected at start).
Turning client TLS or mTLS on or off is restart-only (the listener would change
protocol); a new certificate, key or client CA on a TLS listener is live.
"""


def _value(config: ProxyConfig, key: str) -> Any:
    value = getattr(config, key)
    return value.model_dump() if hasattr(value, "model_dump") else value


def restart_only_changes(old: ProxyConfig, new: ProxyConfig) -> list[str]:
    """The restart-only settings that differ between ``old`` and ``new``, as keys."""
    changed = [key for key in RESTART_ONLY if _value(old, key) != _value(new, key)]
    if (old.tls.cert is None) != (new.tls.cert is None):
        changed.append("tls (turning TLS on or off)")
    elif (old.tls.client_ca is None) != (new.tls.client_ca is None):
        changed.append("tls.client_ca (turning mTLS on or off)")
    return changed


@dataclass(frozen=True, slots=True, kw_only=True)
class ReloadResult:
    """What one reload did."""

    ok: bool
    """Whether the new configuration is now running."""
    generation: int
    """The configuration generation running after the reload."""
    trigger: str
    """What asked for it: ``signal``, ``http`` or ``watch``."""
    message: str
    """``"applied"``, or why nothing was applied."""
    restart_required: tuple[str, ...] = ()
    """Restart-only keys the new file changes (the reload was refused for them)."""
    config_hash: str = ""
    """Hash of the configuration running after the reload."""

    def as_json(self) -> dict[str, Any]:
        """The answer of ``POST /reload``."""
        return {"ok": self.ok, "generation": self.generation, "trigger": self.trigger,
                "message": self.message, "restart_required": list(self.restart_required),
                "config_hash": self.config_hash}


class ReloadRefused(Exception):
    """A reload that must not be applied; the message says why."""

    def __init__(self, message: str, restart_required: Iterable[str] = ()) -> None:
        super().__init__(message)
        self.restart_required = tuple(restart_required)


G = TypeVar("G")


class Reloader(Generic[G]):
    """Serializes reloads and turns each into an all-or-nothing switch.

    ``before_load`` runs first (the server notes what the watched files hold);
    ``load`` reads and validates the configuration (raising ``ConfigError`` or
    ``OSError``); ``build`` makes everything the new configuration needs
    (raising anything: the message is reported); ``apply`` switches to it and
    must not fail.
    """

    def __init__(self, *, config: ProxyConfig, generation: int,
                 load: Callable[[], ProxyConfig],
                 build: Callable[[ProxyConfig, int], Awaitable[G]],
                 apply: Callable[[G, ProxyConfig, str], Awaitable[None]],
                 before_load: Callable[[], Awaitable[None]] | None = None,
                 on_result: Callable[[ReloadResult], None] | None = None) -> None:
        self.config = config
        self.generation = generation
        self.last_success: float | None = None
        self._load = load
        self._build = build
        self._apply = apply
        self._on_result = on_result
        self._before_load = before_load
        self._lock = asyncio.Lock()
        self._pending: asyncio.Future[ReloadResult] | None = None

    async def reload(self, trigger: str) -> ReloadResult:
        """Reload now, or join the one reload queued behind the running one."""
        if self._pending is not None:
            return await asyncio.shield(self._pending)
        if not self._lock.locked():
            async with self._lock:
                return await self._once(trigger)
        self._pending = asyncio.get_running_loop().create_future()
        pending = self._pending
        async with self._lock:
            self._pending = None
            try:
                result = await self._once(trigger)
            except BaseException as exc:
                pending.set_exception(exc)
                raise
            pending.set_result(result)
            return result

    async def _once(self, trigger: str) -> ReloadResult:
        try:
            if self._before_load is not None:
                await self._before_load()
            new = self._load()
            changed = restart_only_changes(self.config, new)
            if changed:
                raise ReloadRefused(
                    f"{', '.join(changed)} changed: a restart is needed to apply "
                    f"{'it' if len(changed) == 1 else 'them'}; nothing was reloaded",
                    changed)
            built = await self._build(new, self.generation + 1)
        except ReloadRefused as exc:
            return self._done(False, trigger, str(exc), exc.restart_required)
        except Exception as exc:
            return self._done(False, trigger, _reason(exc))
        await self._apply(built, new, trigger)
        self.config = new
        self.generation += 1
        self.last_success = time.time()
        return self._done(True, trigger, "applied")

    def _done(self, ok: bool, trigger: str, message: str,
              restart_required: tuple[str, ...] = ()) -> ReloadResult:
        result = ReloadResult(ok=ok, generation=self.generation, trigger=trigger,
                              message=message, restart_required=restart_required,
                              config_hash=config_hash(self.config))
        if ok:
            log.info("reload (%s) applied: configuration generation %d", trigger,
                     self.generation)
        else:
            log.warning("reload (%s) failed, the running configuration is unchanged: %s",
                        trigger, message)
        if self._on_result is not None:
            self._on_result(result)
        return result


def _reason(exc: BaseException) -> str:
    text = str(exc).strip()
    return text if text else type(exc).__name__


_SECRET_WORDS = ("password", "secret", "token", "key")


def redacted(value: Any, key: str = "", secret: bool = False) -> Any:
    """``value`` with every setting whose name suggests a secret replaced by ``***``.

    File paths of TLS keys are kept (they are not secrets); values of keys
    named like ``password``, ``secret``, ``token`` or ``*_key`` inside
    interceptor configs are hidden, and so is every value below such a key (the
    ``signer``'s ``keys: {id: secret}``, the ``header_token_authorizer``'s ``tokens``),
    their own names kept.
    """
    lowered = key.lower()
    secret = secret or (lowered not in ("key", "tls_key")
                        and any(w in lowered for w in _SECRET_WORDS))
    if isinstance(value, dict):
        return {k: redacted(v, str(k), secret) for k, v in value.items()}
    if isinstance(value, list):
        return [redacted(v, key, secret) for v in value]
    if secret and isinstance(value, str | bytes | int):
        return "***"
    return value


def config_hash(config: ProxyConfig) -> str:
    """A short, stable hash of the configuration (shown by ``/config`` and ``/healthz``): of
    the file and flags as written, the same in every worker of a ``workers`` proxy."""
    if config._as_written is not None:
        return config._as_written
    text = config.model_dump_json(by_alias=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def watched_paths(config: ProxyConfig, config_file: str | Path | None) -> list[Path]:
    """What the file watch looks at: the config file, the plugins dir, TLS files and the
    interceptor's properties file (the server adds the files its interceptors declare)."""
    paths = [Path(p) for p in (config_file, config.plugins_dir, config.tls.cert,
                               config.tls.key, config.tls.client_ca,
                               config.interceptor.properties) if p]
    return paths


def _digest(paths: Iterable[Path]) -> dict[str, str]:
    """Content hash of every file under ``paths`` (directories are walked)."""
    out: dict[str, str] = {}
    for path in paths:
        files = sorted(p for p in path.rglob("*") if p.is_file()
                       and "__pycache__" not in p.parts) if path.is_dir() else [path]
        for f in files:
            try:
                out[str(f)] = hashlib.blake2b(f.read_bytes(), digest_size=16).hexdigest()
            except OSError:
                out[str(f)] = "unreadable"
    return out


class FileWatch:
    """Calls ``trigger`` once the watched files have changed and then settled.

    Polls every ``interval`` seconds; a change must stay unchanged for
    ``debounce`` seconds before ``trigger`` runs. ``paths`` is called before
    every poll, so a reload that names new certificate files is followed.
    """

    def __init__(self, paths: Callable[[], list[Path]], trigger: Callable[[], Awaitable[Any]],
                 *, interval: float = 0.5, debounce: float = 1.0) -> None:
        self._paths = paths
        self._trigger = trigger
        self._interval = interval
        self._debounce = debounce
        self._task: asyncio.Task[None] | None = None
        self._applied: dict[str, str] | None = None
        """What the watched files held when the running configuration read them."""
        self._tried: dict[str, str] | None = None
        """What the watch last reloaded from, since the running configuration was read:
        a reload that failed is not tried again while the files stay so."""

    def start(self) -> None:
        """Begin watching (from the current contents)."""
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        """Stop watching."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def snapshot(self) -> dict[str, str]:
        """What the watched files hold now (read on the calling thread)."""
        return _digest(self._paths())

    def applied(self, snapshot: dict[str, str]) -> None:
        """A reload by any trigger built the running configuration from files holding
        ``snapshot`` (taken before it read them): changes count from there."""
        self._applied = snapshot
        self._tried = None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        if self._applied is None:
            self._applied = await loop.run_in_executor(None, _digest, self._paths())
        seen, since = self._applied, loop.time()
        while True:
            await asyncio.sleep(self._interval)
            now = await loop.run_in_executor(None, _digest, self._paths())
            if now != seen:
                seen, since = now, loop.time()
                continue
            # Counted from the running configuration's files (set by applied() when a
            # reload succeeds): files put back as they were after a failed reload are
            # what runs, and nothing is reloaded.
            if (now != self._applied and now != self._tried
                    and loop.time() - since >= self._debounce):
                self._tried = now
                try:
                    await self._trigger()
                except Exception:
                    log.exception("reload from the file watch failed")
