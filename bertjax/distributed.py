"""Multi-host start-up: one call before any device is touched, plus small cross-host helpers.

`initialize()` runs in one of four modes: ``single`` (nothing set, no cluster: no-op);
``explicit`` (coordinator, process count and id from arguments, ``--distributed.*`` flags or the
``BERTJAX_*`` variables that ``launch/local.sh`` sets); ``slurm`` (an ``srun`` step with several
tasks); ``tpu`` (a Cloud TPU VM; JAX asks the metadata server for the workers).

`jax.distributed.initialize` cannot say which process is missing: the others wait out the
timeout and abort from C++ with "Deadline Exceeded". So in explicit and SLURM modes the
processes first meet in a *roll call* on the coordinator port (plain TCP, one JSON line each
way). A missing, duplicated or mis-configured process becomes a one-line
`DistributedStartupError` on every running process within ``timeout_s``; a watchdog also ends
the process if JAX's own start-up overruns.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from absl import flags, logging
from jax.experimental import multihost_utils

ENV_COORDINATOR = "BERTJAX_COORDINATOR"
ENV_NUM_PROCESSES = "BERTJAX_NUM_PROCESSES"
ENV_PROCESS_ID = "BERTJAX_PROCESS_ID"
_ENV_NAMES = (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID)
# What JAX's SLURM detection requires (jax/_src/clusters/slurm_cluster.py).
_SLURM_VARS = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID")
_SLURM_VARS += ("SLURM_LOCALID",)
_FLAG_NAMES = ("coordinator", "num_processes", "process_id", "timeout_s")
_FLAG_NAMES += ("heartbeat_timeout_s", "local_device_ids")
_JOIN_GRACE_S = 10.0  # how much longer a joining process waits for process 0's verdict


class DistributedStartupError(RuntimeError):
    """Raised when the processes of a multi-host job cannot all be brought up; one-line message."""


@dataclasses.dataclass(frozen=True)
class _Settings:
    coordinator: str | None
    num_processes: int | None
    process_id: int | None


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
    """Defines the ``--distributed.*`` absl flags; calling it again is a no-op."""
    if "distributed.coordinator" in flag_values:
        return
    fv = dict(flag_values=flag_values)
    help_coordinator = f"host:port of process 0 in a multi-process run (env {ENV_COORDINATOR})."
    flags.DEFINE_string("distributed.coordinator", None, help_coordinator, **fv)
    help_count = f"Total number of processes (env {ENV_NUM_PROCESSES})."
    flags.DEFINE_integer("distributed.num_processes", None, help_count, lower_bound=1, **fv)
    help_id = f"This process's id in [0, num_processes) (env {ENV_PROCESS_ID})."
    flags.DEFINE_integer("distributed.process_id", None, help_id, lower_bound=0, **fv)
    help_timeout = "Seconds to wait for every process to join before failing."
    flags.DEFINE_integer("distributed.timeout_s", 300, help_timeout, lower_bound=1, **fv)
    help_heartbeat = "Seconds without a heartbeat after which JAX declares a process dead."
    flags.DEFINE_integer(
        "distributed.heartbeat_timeout_s", 100, help_heartbeat, lower_bound=1, **fv
    )
    help_ids = "Comma-separated local device ids this process uses (default: JAX's choice)."
    flags.DEFINE_list("distributed.local_device_ids", None, help_ids, **fv)


def initialize_from_flags(flag_values: flags.FlagValues = flags.FLAGS) -> str:
    """Runs `initialize` with the parsed ``--distributed.*`` flags (env vars fill unset ones)."""
    if "distributed.coordinator" not in flag_values:
        raise DistributedStartupError(
            "call bertjax.distributed.define_flags() before parsing flags"
        )
    value = {name: flag_values[f"distributed.{name}"].value for name in _FLAG_NAMES}
    ids = value.pop("local_device_ids")
    try:
        value["local_device_ids"] = [int(x) for x in ids] if ids else None
    except ValueError:
        message = f"--distributed.local_device_ids={','.join(ids)} is not a list of integers"
        raise DistributedStartupError(message) from None
    return initialize(**value)


def initialize(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    timeout_s: float = 300,
    local_device_ids: Sequence[int] | None = None,
    cpu_collectives: str | None = "gloo",
    heartbeat_timeout_s: int = 100,
) -> str:
    """Brings up JAX's multi-process runtime if this is a multi-process run.

    Arguments left as None fall back on the ``BERTJAX_*`` environment variables. Must run before
    any JAX computation. Returns the mode: ``single``, ``explicit``, ``slurm``, ``tpu`` or
    ``already`` (a second call). Raises `DistributedStartupError` (one-line message) when a
    process is missing, unreachable or mis-configured; never waits longer than ``timeout_s``
    for the roll call nor for JAX's own connection step.
    """
    if jax.distributed.is_initialized():
        return "already"
    env = _settings_from_env(os.environ)
    given = _Settings(
        coordinator if coordinator is not None else env.coordinator,
        num_processes if num_processes is not None else env.num_processes,
        process_id if process_id is not None else env.process_id,
    )
    mode, settings = _choose_mode(given, os.environ)
    if mode == "single":
        if local_device_ids is not None:
            logging.warning("local_device_ids=%s ignored by a single process", local_device_ids)
        logging.info("bertjax.distributed: single process, no distributed runtime")
        return mode
    if cpu_collectives:
        jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
    kwargs: dict[str, Any] = dict(
        initialization_timeout=int(timeout_s),
        heartbeat_timeout_seconds=int(heartbeat_timeout_s),
        shutdown_timeout_seconds=int(timeout_s),
    )
    if local_device_ids is not None:
        kwargs["local_device_ids"] = list(local_device_ids)
    if mode in ("explicit", "slurm"):
        roll_call(settings.coordinator, settings.num_processes, settings.process_id, timeout_s)
        kwargs.update(
            coordinator_address=settings.coordinator,
            num_processes=settings.num_processes,
            process_id=settings.process_id,
        )
    else:  # tpu: JAX reads the worker list from the metadata server; given values override.
        names = ("coordinator_address", "num_processes", "process_id")
        kwargs.update((k, v) for k, v in zip(names, dataclasses.astuple(given)) if v is not None)
    logging.info("bertjax.distributed: %s start-up with %s", mode, kwargs)
    # JAX aborts on its own after `initialization_timeout`; this catches hangs around it.
    message = (
        f"JAX distributed start-up ({mode}) did not finish within {timeout_s + 30:g} s; "
        "a process stopped after the roll call or the coordinator is unreachable"
    )
    with _Watchdog(timeout_s + 30, message):
        try:
            jax.distributed.initialize(**kwargs)
        except ValueError as e:
            raise DistributedStartupError(f"{mode} start-up failed: {e}") from None
    logging.info(
        "bertjax.distributed: process %d of %d up", jax.process_index(), jax.process_count()
    )
    return mode


def roll_call(coordinator: str, num_processes: int, process_id: int, timeout_s: float) -> None:
    """Waits until processes 0..num_processes-1 have all reached this point, or fails.

    Process 0 listens on the coordinator's port; every other process connects and reports its
    id. Raises `DistributedStartupError` naming the missing ids (or the unreachable
    coordinator, a duplicated id, a disagreeing process count) within about ``timeout_s``.
    """
    host, port = parse_coordinator(coordinator)
    meeting = _Meeting(
        coordinator, host, port, num_processes, timeout_s, time.monotonic() + timeout_s
    )
    if process_id == 0:
        _serve_roll_call(meeting)
    else:
        _join_roll_call(meeting, process_id)


def parse_coordinator(coordinator: str) -> tuple[str, int]:
    """Splits ``host:port`` (or ``[v6addr]:port``) and checks the port; one-line error if bad."""
    host, sep, port_text = coordinator.rpartition(":")
    if not sep or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise DistributedStartupError(
            f"coordinator {coordinator!r} is not host:port (e.g. 10.0.0.2:8476)"
        )
    return host.strip("[]"), int(port_text)


def is_coordinator() -> bool:
    """True on process 0, the one that writes summaries, logs metrics and owns the roll call."""
    return jax.process_index() == 0


def process_info() -> dict[str, Any]:
    """A JSON-friendly summary of this process's place in the job (initializes the backend)."""
    return {
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "local_device_count": jax.local_device_count(),
        "device_count": jax.device_count(),
        "local_devices": [str(d) for d in jax.local_devices()],
        "platform": jax.default_backend(),
        "hostname": socket.gethostname(),
        "distributed": jax.distributed.is_initialized(),
    }


def sync(name: str) -> None:
    """Barrier: returns once every process has called ``sync`` with the same name."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def broadcast_from_coordinator(value: Any) -> Any:
    """Returns process 0's ``value`` on every process; ``value`` must be JSON-serializable.

    Meant for small host values (a chosen seed, the step to resume from). Every process gets
    the JSON round trip of process 0's value, also when there is one process (tuples -> lists).
    """
    try:
        payload = json.dumps(value, sort_keys=True).encode()
    except (TypeError, ValueError) as e:
        message = f"broadcast_from_coordinator needs a JSON-serializable value: {e}"
        raise TypeError(message) from None
    if jax.process_count() > 1:
        size = multihost_utils.broadcast_one_to_all(np.int32(len(payload)))
        buffer = np.zeros(int(size), np.uint8)
        if is_coordinator():
            buffer[:] = np.frombuffer(payload, np.uint8)
        payload = np.asarray(multihost_utils.broadcast_one_to_all(buffer)).tobytes()
    return json.loads(payload)


def assert_same_across_hosts(value: Any, what: str) -> None:
    """Raises ValueError on every process if ``value`` differs between processes.

    ``value`` may be a str/bytes, anything JSON-serializable (numpy arrays and scalars allowed),
    or an ml_collections ConfigDict. Only a SHA-256 digest travels between hosts.
    """
    digest = np.frombuffer(hashlib.sha256(_canonical_bytes(value)).digest(), np.uint8)
    if jax.process_count() == 1:
        return
    digests = np.asarray(multihost_utils.process_allgather(digest))  # [processes, 32]
    differ = [i for i in range(digests.shape[0]) if not np.array_equal(digests[i], digests[0])]
    if differ:
        raise ValueError(
            f"hosts disagree on {what}: process ids {differ} differ from process 0 "
            f"(sha256 {digests[differ[0]].tobytes().hex()[:12]} vs "
            f"{digests[0].tobytes().hex()[:12]}); every host must run with the same {what}"
        )


# ----------------------------------------------------------------------------- internals


def _canonical_bytes(value: Any) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    if hasattr(value, "to_json_best_effort"):  # ml_collections.ConfigDict
        return value.to_json_best_effort(sort_keys=True).encode()

    def numpy_to_json(x: Any) -> Any:
        if isinstance(x, np.ndarray | np.generic):
            return x.tolist()
        raise TypeError(f"{type(x).__name__} is not JSON-serializable")

    try:
        return json.dumps(value, sort_keys=True, default=numpy_to_json).encode()
    except (TypeError, ValueError) as e:
        raise TypeError(f"assert_same_across_hosts cannot fingerprint this value: {e}") from None


def _env_int(environ: Mapping[str, str], name: str) -> int | None:
    text = environ.get(name, "").strip()
    if not text:
        return None
    try:
        return int(text)
    except ValueError:
        message = f"environment variable {name}={text!r} is not an integer"
        raise DistributedStartupError(message) from None


def _settings_from_env(environ: Mapping[str, str]) -> _Settings:
    return _Settings(
        environ.get(ENV_COORDINATOR, "").strip() or None,
        _env_int(environ, ENV_NUM_PROCESSES),
        _env_int(environ, ENV_PROCESS_ID),
    )


def _choose_mode(given: _Settings, environ: Mapping[str, str]) -> tuple[str, _Settings]:
    """Decides single / explicit / slurm / tpu and returns the settings the mode will use."""
    n, pid = given.num_processes, given.process_id
    if n is not None and n < 1:
        raise DistributedStartupError(f"num_processes={n} must be at least 1")
    if pid is not None and n is not None and not 0 <= pid < n:
        raise DistributedStartupError(f"process_id={pid} is out of range for num_processes={n}")
    if n == 1:
        return "single", given
    if given.coordinator is not None:
        parse_coordinator(given.coordinator)
    if all(v is not None for v in dataclasses.astuple(given)):
        return "explicit", given
    if all(v in environ for v in _SLURM_VARS) and int(environ["SLURM_NTASKS"]) > 1:
        slurm = _Settings(
            given.coordinator or _slurm_coordinator(environ),
            n if n is not None else int(environ["SLURM_NTASKS"]),
            pid if pid is not None else int(environ["SLURM_PROCID"]),
        )
        return "slurm", slurm
    if _on_cloud_tpu_vm(environ):
        return "tpu", given
    if all(v is None for v in dataclasses.astuple(given)):
        return "single", given
    env_names = dict(zip(("coordinator", "num_processes", "process_id"), _ENV_NAMES))
    missing = [
        f"--distributed.{k} / {v}" for k, v in env_names.items() if getattr(given, k) is None
    ]
    raise DistributedStartupError(
        f"incomplete multi-process settings, missing {'; '.join(missing)} "
        "(set all three, or none for a single process)"
    )


def _slurm_coordinator(environ: Mapping[str, str]) -> str:
    """First host of the step's node list, on the port JAX's SLURM detection picks."""
    nodes = environ["SLURM_STEP_NODELIST"]
    head, bracket, rest = nodes.partition("[")
    if "," in head:  # 'node1,node2[3-4]' -> 'node1'
        host = head.split(",")[0]
    elif bracket:  # 'gpu[007,009-012],x' -> 'gpu007'
        host = head + rest.split(",")[0].split("-")[0].split("]")[0]
    else:
        host = head
    port = environ.get("JAX_COORDINATOR_PORT") or str(
        int(environ["SLURM_JOB_ID"]) % 2**12 + (65535 - 2**12 + 1)
    )
    return f"{host}:{port}"


def _on_cloud_tpu_vm(environ: Mapping[str, str]) -> bool:
    platforms = environ.get("JAX_PLATFORMS", "")
    if platforms and "tpu" not in platforms.split(","):
        return False
    try:
        from jax._src import cloud_tpu_init  # set when `import jax` found TPU chips and libtpu
    except ImportError:  # pragma: no cover - layout of a future JAX
        return False
    return bool(getattr(cloud_tpu_init, "running_in_cloud_tpu_vm", False))


class _Watchdog:
    """Context manager that ends the process with a one-line message if the body overruns."""

    def __init__(self, timeout_s: float, message: str):
        self._timer = threading.Timer(timeout_s, _die, args=(message,))
        self._timer.daemon = True

    def __enter__(self) -> None:
        self._timer.start()

    def __exit__(self, *exc: object) -> None:
        self._timer.cancel()


def _die(message: str) -> None:
    print(f"bertjax.distributed: error: {message}", file=sys.stderr, flush=True)
    os._exit(1)


def _send(conn: socket.socket, obj: dict[str, Any]) -> None:
    try:
        conn.sendall(json.dumps(obj).encode() + b"\n")
    except OSError:
        pass  # that process is gone; its own error tells its story


def _read_line(conn: socket.socket, deadline: float) -> bytes | None:
    data = b""
    while not data.endswith(b"\n") and len(data) < 65536:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None
        conn.settimeout(remaining)
        try:
            chunk = conn.recv(4096)
        except (TimeoutError, OSError):
            return None
        if not chunk:
            return data or None
        data += chunk
    return data


def _listen(port: int) -> socket.socket:
    family = socket.AF_INET6 if socket.has_dualstack_ipv6() else socket.AF_INET
    return socket.create_server(("", port), family=family, dualstack_ipv6=family == socket.AF_INET6)


@dataclasses.dataclass(frozen=True)
class _Meeting:
    coordinator: str
    host: str
    port: int
    num_processes: int
    timeout_s: float
    deadline: float  # time.monotonic() value


def _serve_roll_call(meeting: _Meeting) -> None:
    coordinator, port, deadline = meeting.coordinator, meeting.port, meeting.deadline
    num_processes, timeout_s = meeting.num_processes, meeting.timeout_s
    try:
        listener = _listen(port)
    except OSError as e:
        raise DistributedStartupError(
            f"process 0 cannot listen on coordinator port {port} ({e.strerror or e}); "
            "is another job using it?"
        ) from None
    joined: dict[int, tuple[socket.socket, str]] = {}
    error = None
    try:
        while len(joined) < num_processes - 1 and error is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            listener.settimeout(remaining)
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                break
            line = _read_line(conn, min(deadline, time.monotonic() + 5))
            try:
                hello = json.loads(line or b"")
                pid, n, host = int(hello["process_id"]), int(hello["num_processes"]), hello["host"]
            except (ValueError, KeyError, TypeError):
                logging.warning("roll call: ignoring a connection that sent %r", line)
                conn.close()
                continue
            if n != num_processes:
                error = (
                    f"process {pid} on {host} expects {n} processes but process 0 expects "
                    f"{num_processes}; every process needs the same num_processes"
                )
            elif not 0 < pid < num_processes:
                error = f"process on {host} has process_id={pid}, outside 1..{num_processes - 1}"
            elif pid in joined:
                error = (
                    f"process id {pid} joined twice (from {joined[pid][1]} and {host}); "
                    "every process needs a distinct process_id"
                )
            joined.setdefault(pid, (conn, host))
            if joined[pid][0] is not conn:
                _send(conn, {"error": error})
                conn.close()
        if error is None and len(joined) < num_processes - 1:
            missing = sorted(set(range(1, num_processes)) - set(joined))
            error = (
                f"process ids {missing} of {num_processes} did not join coordinator "
                f"{coordinator} within {timeout_s:g} s (joined: {[0, *sorted(joined)]}); "
                "check that every process was started and points at this coordinator"
            )
        for conn, _ in joined.values():
            _send(conn, {"error": error} if error else {"ok": True})
        if error is None:  # let the others close first, so the port is free for JAX at once
            for conn, _ in joined.values():
                _read_line(conn, time.monotonic() + 2)
    finally:
        for conn, _ in joined.values():
            conn.close()
        listener.close()
    if error:
        raise DistributedStartupError(error)


def _join_roll_call(meeting: _Meeting, process_id: int) -> None:
    coordinator, deadline, timeout_s = meeting.coordinator, meeting.deadline, meeting.timeout_s
    last_error: OSError | None = None
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise DistributedStartupError(
                f"coordinator {coordinator} unreachable from process {process_id} for "
                f"{timeout_s:g} s ({last_error}); is process 0 running and listening there?"
            )
        try:
            conn = socket.create_connection((meeting.host, meeting.port), min(remaining, 5))
            break
        except OSError as e:
            last_error = e
            time.sleep(min(0.25, max(remaining, 0)))
    with conn:
        hello = {"process_id": process_id, "num_processes": meeting.num_processes}
        _send(conn, {**hello, "host": socket.gethostname()})
        line = _read_line(conn, deadline + _JOIN_GRACE_S)
    if line is None:
        raise DistributedStartupError(
            f"coordinator {coordinator} gave process {process_id} no answer within "
            f"{timeout_s + _JOIN_GRACE_S:g} s (process 0 stopped? see its log)"
        )
    try:
        reply = json.loads(line)
    except ValueError:
        reply = {"error": f"garbled answer {line[:80]!r} from coordinator {coordinator}"}
    if "error" in reply:
        raise DistributedStartupError(f"{reply['error']} (reported by process 0)")
