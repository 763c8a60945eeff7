"""Run untrusted Python (model-written MBPP solutions) in a sandboxed subprocess.

Layers, outermost first (each one holds on its own for what it covers):

* **Process group and wall clock.** The program starts in a new session (its own process group); the parent waits
  at most ``wall_s`` and then kills the whole group with SIGKILL. After a normal exit the group is killed too, so
  nothing it left behind survives.
* **Kernel resource limits** (``setrlimit``, set by the bootstrap before any program code runs, soft = hard so they
  cannot be raised again): CPU seconds (RLIMIT_CPU), address space (RLIMIT_AS), the size of any file written,
  stdout and stderr included (RLIMIT_FSIZE: the output cap), open files, no core dumps, and processes (RLIMIT_NPROC,
  which the kernel ignores for root, hence the next layer).
* **Unprivileged user.** When the grader runs as root, the bootstrap drops to ``nobody`` (uid/gid 65534) before
  the program runs: root-owned files and directories become read-only to it and RLIMIT_NPROC applies. Only where
  a probe run (once per interpreter) shows the drop working: it fails where ``nobody`` cannot read the
  interpreter's standard library (a pyenv Python under /root) or where root cannot change uid (no CAP_SETUID, or
  root in a user namespace that maps no ``nobody``); then the uid stays, and ``isolation()`` says so and why. A
  drop that the probe passed but that fails later stops the run (status ``error``) instead of running as root.
* **Network namespace.** Where ``unshare -n`` works (root, or unprivileged user namespaces), the program runs in a
  fresh network namespace: no interface but a loopback that is down, so no connection can leave, even from C
  code. Where it does not (a locked-down container), the audit hook below is the network block.
* **Audit hook** (PEP 578, installed by the bootstrap; it cannot be removed): refuses socket creation and name
  lookups, process creation (fork, exec, spawn, system, subprocess), signals to other processes, ctypes, raising
  rlimits, and any write, create, rename, delete or permission change outside the program's own temporary
  directory. An audit hook is not a security boundary against code that deliberately subverts the interpreter;
  it is what makes the common cases fail fast and visibly (``blocked``) on every machine, with the kernel layers
  above as the boundary.
* **Fresh temporary working directory** per run (also ``$TMPDIR`` and ``$HOME``), removed afterwards; the program
  text arrives on stdin, so there is no file to read the harness from.

A run passes only if the process exits 0 **and** prints a per-run random token that the bootstrap writes after
the program (tests included) has run to completion, so ``exit(0)`` or ``os._exit(0)`` before the tests fails.
"""

from __future__ import annotations

import functools
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Sequence

NOBODY = 65534
BLOCKED_MARK = "es-ray-sandbox: blocked"
DROP_MARK = "es-ray-sandbox: cannot drop to uid"
DROP_FAILED_RC = 97
# fractions: a module the bootstrap has not imported, so importing it shows that nobody can read the stdlib
_PROBE = ("import os, sys\nassert 'fractions' not in sys.modules\nimport fractions\n"
          "print(*os.getresuid(), *os.getresgid())\n")


@dataclass(frozen=True)
class SandboxLimits:
    wall_s: float = 10.0
    """Wall-clock limit; the whole process group is killed after it."""
    cpu_s: float = 5.0
    """CPU-time limit (RLIMIT_CPU, rounded up to whole seconds)."""
    memory_mb: int = 1024
    """Address-space limit (RLIMIT_AS)."""
    output_bytes: int = 1 << 20
    """Cap on stdout, stderr and any file the program writes (RLIMIT_FSIZE)."""
    max_open_files: int = 64
    max_processes: int = 64
    """RLIMIT_NPROC for the unprivileged user (counts its threads and processes, all sandboxes together)."""


@dataclass(frozen=True)
class SandboxResult:
    status: str
    """passed | failed | timeout | memory | output_limit | blocked | error"""
    returncode: int | None
    stdout: str
    stderr: str
    seconds: float

    @property
    def passed(self) -> bool:
        return self.status == "passed"


_BOOTSTRAP = r"""
import builtins, json, os, resource, sys

def _setup():
    cfg = json.loads(sys.stdin.read())
    sys.stdin.close()
    lim = cfg["limits"]
    cpu = max(1, int(-(-lim["cpu_s"] // 1)))
    for name, soft, hard in (("RLIMIT_CPU", cpu, cpu + 1), ("RLIMIT_AS", lim["memory_mb"] << 20, None),
                             ("RLIMIT_FSIZE", lim["output_bytes"], None), ("RLIMIT_CORE", 0, None),
                             ("RLIMIT_NOFILE", lim["max_open_files"], None),
                             ("RLIMIT_NPROC", lim["max_processes"], None)):
        resource.setrlimit(getattr(resource, name), (soft, soft if hard is None else hard))
    if cfg["drop_to"] is not None and os.geteuid() == 0:
        uid = cfg["drop_to"]
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            if os.getresuid() != (uid,) * 3 or os.getresgid() != (uid,) * 3:
                raise OSError("uid/gid are %r/%r after the drop" % (os.getresuid(), os.getresgid()))
        except OSError as exc:  # never run the program as root when the drop was asked for
            sys.stderr.write("%s %d: %s\n" % (%(drop)r, uid, exc))
            sys.stderr.flush()
            os._exit(%(drop_rc)d)
    root = os.path.realpath(os.getcwd())
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
    blocked_prefixes = ("socket.", "ctypes.", "subprocess.", "os.fork", "os.forkpty", "os.system", "os.exec",
                        "os.posix_spawn", "os.spawn", "os.kill", "os.killpg", "signal.pthread_kill",
                        "resource.setrlimit", "resource.prlimit", "gc.get_referrers", "gc.get_referents",
                        "gc.get_objects", "urllib.", "http.client.", "ftplib.", "smtplib.", "poplib.", "imaplib.",
                        "nntplib.", "telnetlib.", "webbrowser.", "pty.")
    path_events = {"os.remove": 1, "os.rmdir": 1, "os.mkdir": 1, "os.chmod": 1, "os.chown": 1, "os.truncate": 1,
                   "os.utime": 1, "os.chflags": 1, "os.lchflags": 1, "os.setxattr": 1, "os.removexattr": 1,
                   "shutil.rmtree": 1, "os.rename": 2, "os.link": 2, "os.symlink": 2}
    said = set()
    realpath, join, fspath, getcwd = os.path.realpath, os.path.join, os.fspath, os.getcwd

    def inside(path):
        if isinstance(path, int):
            return True
        p = fspath(path)
        p = p.decode(errors="replace") if isinstance(p, bytes) else p
        full = realpath(join(getcwd(), p))
        return full == root or full.startswith(root + os.sep) or full == "/dev/null"

    def deny(event):
        if event not in said:
            said.add(event)
            try:
                sys.stderr.write("%s %s\n" % (%(mark)r, event))
            except Exception:
                pass
        raise PermissionError("%s: %s is not allowed" % (%(mark)r, event))

    def hook(event, args):
        if event == "open":
            if args[2] & write_flags and not inside(args[0]):
                deny("write outside the working directory")
        elif event in path_events:
            for p in args[:path_events[event]]:
                if not inside(p):
                    deny(event + " outside the working directory")
        elif event == "import" and args[0] in ("_ctypes", "ctypes", "_posixsubprocess"):
            deny("import " + args[0])
        elif event.startswith(blocked_prefixes):
            deny(event)

    sys.dont_write_bytecode = True
    sys.addaudithook(hook)
    return cfg["program"], cfg["token"]

def _run():
    program, token = _setup()
    exec(compile(program, "program.py", "exec"), {"__name__": "__main__", "__builtins__": builtins})
    sys.stdout.write("\n" + token + "\n")
    sys.stdout.flush()

_run()
""".replace("%(mark)r", repr(BLOCKED_MARK)).replace("%(drop)r", repr(DROP_MARK)).replace(
    "%(drop_rc)d", str(DROP_FAILED_RC))


@functools.lru_cache(maxsize=1)
def network_isolation() -> tuple[str, ...]:
    """The ``unshare`` prefix that gives the program its own empty network namespace, or () where none works."""
    exe = shutil.which("unshare")
    if exe is None:
        return ()
    for args in ((exe, "-n"), (exe, "-r", "-n")):
        try:
            if subprocess.run([*args, "true"], capture_output=True, timeout=10).returncode == 0:
                return args
        except (OSError, subprocess.TimeoutExpired):
            continue
    return ()


@functools.lru_cache(maxsize=8)
def _probe_drop(python: str) -> tuple[int | None, str]:
    """(NOBODY when a sandboxed probe run of ``python`` dropped to it and imported from the stdlib, else None;
    what happened, in words)."""
    if os.geteuid() != 0:
        return None, "unchanged (not root)"
    res = _launch(_PROBE, SandboxLimits(wall_s=30.0, cpu_s=10.0), python, NOBODY)
    if res.passed and res.stdout.split() == [str(NOBODY)] * 6:
        return NOBODY, f"nobody ({NOBODY}), checked by a probe run"
    if res.status == "error" and res.stderr.startswith(DROP_MARK):
        why = res.stderr.splitlines()[0][len("es-ray-sandbox: "):]
    else:
        last = res.stderr.strip().splitlines()[-1:] or [res.status]
        why = f"nobody cannot run this Python or read its standard library ({last[0][:200]})"
    return None, f"unchanged: root; the drop to nobody failed here: {why}"


def drop_to_uid(python: str = sys.executable) -> int | None:
    """``nobody`` when running as root and a probe run shows the sandbox can drop to it, else None (the sandbox
    then keeps the uid and relies on the other layers)."""
    return _probe_drop(python)[0]


def isolation(python: str = sys.executable) -> dict:
    """What this machine's sandbox uses for ``python`` (reported in es-eval's results.json); the user is what a
    probe run did."""
    ns = network_isolation()
    uid, user = _probe_drop(python)
    return {
        "network": ("namespace (" + " ".join(os.path.basename(a) if i == 0 else a for i, a in enumerate(ns)) + ")"
                    if ns else "audit hook only (unshare unavailable)") + " + audit hook",
        "user": user,
        "limits": "rlimit cpu, address space, file size, open files, processes; wall clock; process-group kill",
        "filesystem": "fresh temporary directory; writes elsewhere refused (audit hook"
                      + (", nobody's permissions)" if uid is not None else ")"),
    }


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _read_capped(f, cap: int) -> str:
    f.seek(0)
    return f.read(cap).decode("utf-8", errors="replace")


def run_python(program: str, limits: SandboxLimits = SandboxLimits(), python: str = sys.executable
               ) -> SandboxResult:
    """Run ``program`` (Python source) under the sandbox; ``passed`` only if it ran to its end and exited 0."""
    return _launch(program, limits, python, drop_to_uid(python))


def _launch(program: str, limits: SandboxLimits, python: str, drop_to: int | None) -> SandboxResult:
    """run_python with the uid to drop to given (the probe asks for a drop not yet known to work)."""
    token = secrets.token_hex(16)
    outer = tempfile.mkdtemp(prefix="es-ray-sandbox-")
    t0 = time.monotonic()
    try:
        work = os.path.join(outer, "work")
        os.mkdir(work, 0o700)
        os.chmod(outer, 0o711)  # the unprivileged program may pass through, not list or write
        if drop_to is not None:
            os.chown(work, drop_to, drop_to)
        env = {"PATH": "/usr/bin:/bin", "HOME": work, "TMPDIR": work, "LANG": "C.UTF-8", "PYTHONHASHSEED": "0"}
        cmd = [*network_isolation(), python, "-I", "-S", "-B", "-c", _BOOTSTRAP]
        payload = json.dumps({"program": program, "token": token, "limits": asdict(limits),
                              "drop_to": drop_to}).encode()
        with open(os.path.join(outer, "stdout"), "w+b") as out, open(os.path.join(outer, "stderr"), "w+b") as err:
            try:
                proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=out, stderr=err, cwd=work, env=env,
                                        start_new_session=True)
            except OSError as exc:
                return SandboxResult("error", None, "", f"could not start the sandbox: {exc}", 0.0)
            timed_out = False
            try:
                try:
                    proc.stdin.write(payload)
                    proc.stdin.close()
                except BrokenPipeError:
                    pass
                proc.wait(timeout=limits.wall_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                _kill_group(proc)  # always: nothing the program started outlives it
                proc.wait()
            seconds = time.monotonic() - t0
            # Python ignores SIGXFSZ: past the cap its writes fail with EFBIG, so the size tells
            over = max(os.fstat(out.fileno()).st_size, os.fstat(err.fileno()).st_size) >= limits.output_bytes
            stdout = _read_capped(out, limits.output_bytes)
            stderr = _read_capped(err, 64 << 10)
        status = "output_limit" if over else _status(proc.returncode, timed_out, stdout, stderr, token)
        return SandboxResult(status, proc.returncode, stdout.replace("\n" + token + "\n", ""), stderr, seconds)
    finally:
        shutil.rmtree(outer, ignore_errors=True)


def _status(rc: int | None, timed_out: bool, stdout: str, stderr: str, token: str) -> str:
    if timed_out or rc in (-signal.SIGXCPU, -signal.SIGKILL):
        return "timeout"
    if rc == -signal.SIGXFSZ:
        return "output_limit"
    if rc == DROP_FAILED_RC and stderr.startswith(DROP_MARK):  # the bootstrap stopped before the program ran
        return "error"
    if rc == 0 and stdout.rstrip().endswith(token):
        return "passed"
    if "MemoryError" in stderr:
        return "memory"
    if BLOCKED_MARK in stderr:
        return "blocked"
    return "failed"


def run_many(programs: Sequence[str], limits: SandboxLimits = SandboxLimits(), workers: int = 2
             ) -> list[SandboxResult]:
    """Run several programs, ``workers`` at a time (each is its own process; threads only wait on them)."""
    if workers <= 1 or len(programs) <= 1:
        return [run_python(p, limits) for p in programs]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(lambda p: run_python(p, limits), programs))
