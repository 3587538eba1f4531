"""Starting Spark for a pipeline: Java check, the session, and shipping the plugins dir.

Local mode (the default, ``local[*]``) binds Spark to loopback and runs the
executors' Python workers with this interpreter, so they import the same
``interceptors``/``protocol`` and read the plugins dir straight from disk. On a
cluster (``--master yarn|spark://...|k8s://...``, or under ``spark-submit``) the
plugins dir is zipped and shipped with ``SparkContext.addArchive``; executors
load plugins from the unpacked copy. kiproxy itself must be importable by the
executors' Python (installed on the nodes, or a packed virtualenv passed with
``--archives``), like any PySpark dependency with compiled code.

Spark's own start-up chatter (the JVM's "Using incubator modules", "Using Spark's
default log4j profile", "Setting default log level", NativeCodeLoader) stays out
of the user's terminal: unless ``quiet=False`` (``--verbose``), the driver JVM
logs only errors, through a log4j2 configuration of ours, and its stderr goes to
a file (``spark-driver.log`` in a temporary directory, deleted when the session
ends cleanly). Failures still reach the user as the job's Python exception.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import uuid
import zipfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from kiproxy.interceptors.extras import missing_extras
from kiproxy.pipelines.errors import JavaMissing, PipelineError

__all__ = [
    "MIN_JAVA",
    "check_java",
    "check_pyspark",
    "find_java",
    "is_local",
    "java_major_version",
    "ship_plugins",
    "spark_session",
]

MIN_JAVA = 17
_INSTALL_JAVA = (
    "install a Java 17+ runtime - `apt-get install openjdk-17-jre-headless` (Debian/Ubuntu), "
    "`dnf install java-17-openjdk-headless` (Fedora/RHEL) or `brew install openjdk@17` "
    "(macOS) - or set JAVA_HOME to one"
)


def java_major_version(version_output: str) -> int | None:
    """The major version in ``java -version`` output (``"1.8.0_392"`` -> 8, ``"17.0.15"`` -> 17)."""
    match = re.search(r'version "(\d+)(?:\.(\d+))?', version_output)
    if match is None:
        return None
    major = int(match.group(1))
    if major == 1 and match.group(2) is not None:
        return int(match.group(2))
    return major


def find_java(env: Mapping[str, str] | None = None) -> str | None:
    """The ``java`` PySpark will start: ``$JAVA_HOME/bin/java``, else the one on PATH."""
    env = os.environ if env is None else env
    home = env.get("JAVA_HOME")
    if home:
        candidate = Path(home) / "bin" / "java"
        return str(candidate) if candidate.is_file() else None
    return shutil.which("java", path=env.get("PATH"))


def check_java(env: Mapping[str, str] | None = None) -> str:
    """Fail with what to install unless a Java 17+ runtime is found; returns its version line."""
    env = os.environ if env is None else env
    java = find_java(env)
    if java is None:
        where = f"JAVA_HOME={env['JAVA_HOME']} has no bin/java" if env.get("JAVA_HOME") \
            else "no `java` on PATH"
        raise JavaMissing(f"PySpark needs Java {MIN_JAVA} or newer, and {where}: {_INSTALL_JAVA}")
    try:
        done = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=30,
                              check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise JavaMissing(f"{java} -version failed ({exc}): {_INSTALL_JAVA}") from None
    text = done.stderr + done.stdout
    major = java_major_version(text)
    if major is None or major < MIN_JAVA:
        found = text.strip().splitlines()[0] if text.strip() else "no version"
        raise JavaMissing(f"PySpark needs Java {MIN_JAVA} or newer; {java} is {found!r}: "
                          f"{_INSTALL_JAVA}")
    return text.strip().splitlines()[0]


def check_pyspark(command: str = "kiproxy replay") -> None:
    """Fail with the install command unless the pipelines extra (pyspark and the rest)
    imports; ``command`` is the one being run (``kiproxy replay`` or ``kiproxy report``)."""
    missing = missing_extras([("this command", command)])
    if missing:
        raise PipelineError(missing[0])


def is_local(master: str | None) -> bool:
    """Whether ``master`` runs everything on this machine."""
    return master is None or master.startswith("local")


def _under_spark_submit() -> bool:
    return "PYSPARK_GATEWAY_PORT" in os.environ or "SPARK_SUBMIT_OPTS" in os.environ


_QUIET_LOG4J2 = """\
# kiproxy replay/report without --verbose: the driver logs errors only.
rootLogger.level = error
rootLogger.appenderRef.stderr.ref = console
appender.console.type = Console
appender.console.name = console
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = %d{yy/MM/dd HH:mm:ss} %p %c{1}: %m%n%ex
"""


@contextlib.contextmanager
def _stderr_to(path: Path) -> Iterator[None]:
    """Point file descriptor 2 at ``path`` meanwhile: a JVM started now keeps writing there."""
    sys.stderr.flush()
    saved = os.dup(2)
    target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.dup2(target, 2)
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        os.close(target)


@contextlib.contextmanager
def spark_session(app_name: str, master: str | None = None,
                  conf: Mapping[str, str] | None = None, *, quiet: bool = True
                  ) -> Iterator[Any]:
    """A SparkSession for one job; stopped afterwards unless it was already running.

    An already active session (spark-submit's, a notebook's, the tests') is reused
    as it is, with ``conf`` applied where Spark allows it at run time. ``quiet``
    keeps Spark's start-up messages and warnings out of the terminal (see above).
    """
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    active = getattr(SparkContext, "_active_spark_context", None)
    if active is not None:
        session = SparkSession.builder.getOrCreate()
        for key, value in (conf or {}).items():
            with contextlib.suppress(Exception):
                session.conf.set(key, value)
        yield session
        return

    submitted = _under_spark_submit() and master is None
    local = not submitted and is_local(master)
    builder = SparkSession.builder.appName(app_name)
    if not submitted:
        builder = builder.master(master or "local[*]")
    settings: dict[str, str] = {
        "spark.ui.showConsoleProgress": "false",
        "spark.sql.session.timeZone": "UTC",
    }
    if local:
        # Loopback only: Spark would otherwise bind to the host's external address.
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
        settings.update({
            "spark.driver.host": "127.0.0.1",
            "spark.driver.bindAddress": "127.0.0.1",
            "spark.ui.enabled": "false",
            "spark.sql.shuffle.partitions": "4",
            "spark.pyspark.python": sys.executable,
            "spark.pyspark.driver.python": sys.executable,
            # The Python workers start in the current directory, which Python would put
            # first on their path: run from a source checkout, its kiproxy/ folder (no
            # compiled codec there) would be imported instead of the installed package.
            "spark.executorEnv.PYTHONSAFEPATH": "1",
        })
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    quiet_dir = Path(tempfile.mkdtemp(prefix="kiproxy-spark-")) if quiet else None
    if quiet_dir is not None:
        (quiet_dir / "log4j2.properties").write_text(_QUIET_LOG4J2)
        settings["spark.driver.extraJavaOptions"] = (
            f"-Dlog4j2.configurationFile=file:{quiet_dir / 'log4j2.properties'}")
    settings.update(conf or {})
    for key, value in settings.items():
        builder = builder.config(key, value)
    if quiet_dir is not None:
        with _stderr_to(quiet_dir / "spark-driver.log"):
            session = builder.getOrCreate()
    else:
        session = builder.getOrCreate()
    session.sparkContext.setLogLevel("ERROR" if quiet else "WARN")
    try:
        yield session
    finally:
        session.stop()
    if quiet_dir is not None:
        shutil.rmtree(quiet_dir, ignore_errors=True)


def ship_plugins(spark: Any, plugins_dir: str | None, *, archive: bool | None = None
                 ) -> tuple[str | None, str | None]:
    """Make ``plugins_dir`` loadable by the executors: ``(local path, archive name)``.

    Local mode reads the directory in place (it goes on the workers' ``sys.path``
    when the loader finds a plugin there); any other master gets a zip of it
    through ``SparkContext.addArchive``, unpacked next to each executor
    (``archive=True`` ships it that way in local mode too).
    """
    if plugins_dir is None:
        return None, None
    directory = Path(plugins_dir).resolve()
    sc = spark.sparkContext
    use_archive = not is_local(sc.master) if archive is None else archive
    if not use_archive:
        return str(directory), None
    name = f"kiproxy-plugins-{uuid.uuid4().hex[:8]}.zip"
    target = Path(tempfile.mkdtemp(prefix="kiproxy-plugins-")) / name
    with zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as zf:
        for path in sorted(directory.rglob("*")):
            if "__pycache__" in path.parts or not path.is_file():
                continue
            zf.write(path, path.relative_to(directory).as_posix())
    sc.addArchive(str(target))
    return None, name
