"""Run untrusted Python (model-written MBPP solutions) so that it can neither pass without being right nor
reach anything outside its own directory.

The threat is a policy trained on this reward: anything a program can do to look correct, it will eventually
find. So the verdict never lives in the program's process (es_ray.grading.verdict): the program runs with its
tests' probes and reports plain values; a second process that never runs the program checks the tests over those
values (a test of the form ``probe == literal``, most of MBPP, is compared by the grader itself). A program that
exits early, reads the harness's frames or returns an object whose ``__eq__`` is always True reports nothing
usable and fails.

Confinement, per program (es_ray/grading/_sandbox_child.py does it before any program code runs):

* **Namespaces** (``unshare``, as root or with unprivileged user namespaces): its own PID namespace with a fresh
  /proc (it sees no other process, so it cannot signal or read the grader's ``/proc/<pid>/environ``), mount
  namespace (a size-limited tmpfs on its working directory: the disk quota; a private /dev/shm that vanishes with
  it), network namespace (no interface but a loopback that is down) and IPC namespace.
* **Landlock** (Linux >= 5.13 with Landlock enabled; ABI read with the syscall): reads only from the interpreter's
  prefix and the system library directories, writes only in its working directory, whatever the call (``open``,
  ``os.open(..., dir_fd=)``, ``rename``, ``link``); from ABI 4 no TCP bind or connect; from ABI 6 no signal and no
  abstract unix socket outside its own domain (``pidfd_send_signal`` included).
* **No privilege**: as root every capability is dropped (bounding set and effective set), so root-in-the-sandbox
  can neither mount, override file permissions, kill nor trace. Where Landlock is missing, the only other
  accepted boundary is the drop to ``nobody`` (checked by a probe run); where that fails too, or the grader is not
  root, grading is refused (``SandboxUnavailable``) with what to install or configure.
* **rlimits** (soft = hard): CPU seconds, address space, file size (also the output cap), open files, no core
  dumps, processes (ignored by the kernel for root; the PID namespace and the audit hook hold there).
* **Environment**: only PATH, HOME and TMPDIR (its own directory), LANG and PYTHONHASHSEED; the interpreter runs
  with ``-I -S -B`` (no site-packages, no user paths, no bytecode writes).
* **Wall clock**: the whole process group is killed after ``wall_s``; ``setpriv --pdeathsig`` kills the sandbox if
  the grader's thread dies; the PID namespace ends every process the program started.
* **Audit hook** (PEP 578): refuses sockets, process creation, ctypes, signals and writes outside its directory
  early and visibly (status ``blocked``). It is no boundary against code that subverts the interpreter; the
  kernel layers above are.

``isolation()`` says which layers this machine gives (es-eval writes it into results.json).
"""

from __future__ import annotations

import ast
import ctypes
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

from es_ray.grading.verdict import Split, split_tests

NOBODY = 65534
BLOCKED_MARK = "es-ray-sandbox: blocked"
DROP_MARK = "es-ray-sandbox: cannot drop to uid"
CONFINE_MARK = "es-ray-sandbox: cannot confine"
CONFINE_RC = 97
DROP_FAILED_RC = CONFINE_RC
_CHILD = (Path(__file__).with_name("_sandbox_child.py")).read_text()
# the landlock syscalls are 444-446 on both; capset's number differs
CAPSET_SYSCALL = {"x86_64": 126, "aarch64": 91}
_NAMESPACES = ("--pid", "--fork", "--kill-child", "--mount", "--mount-proc", "--net", "--ipc", "--uts")
# fractions: a module the bootstrap has not imported, so importing it shows that nobody can read the stdlib
_PROBE = ("import os, sys\nassert 'fractions' not in sys.modules\nimport fractions\n"
          "print(*os.getresuid(), *os.getresgid())\n")


class SandboxUnavailable(RuntimeError):
    """This machine gives the sandbox no boundary it accepts; grading refuses to start."""


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
    disk_mb: int = 16
    """Size of the tmpfs mounted on the working directory (the disk quota; needs a mount namespace)."""


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


@dataclass(frozen=True)
class Plan:
    """What confines programs on this machine (chosen once per interpreter)."""
    prefix: tuple[str, ...]
    mount_ns: bool
    pid_ns: bool
    landlock: int
    drop_to: int | None
    refused: str | None = None


def landlock_abi() -> int:
    """The kernel's Landlock ABI version (0: not built in or not enabled)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        abi = libc.syscall(444, None, ctypes.c_size_t(0), ctypes.c_uint32(1))  # LANDLOCK_CREATE_RULESET_VERSION
    except (OSError, AttributeError):
        return 0
    return max(0, int(abi)) if sys.platform.startswith("linux") and os.uname().machine in CAPSET_SYSCALL else 0


@functools.lru_cache(maxsize=1)
def namespaces() -> tuple[str, ...]:
    """The ``unshare`` prefix that gives a program its own PID, mount, network, IPC and UTS namespaces (as root,
    else inside a user namespace), or () where neither works."""
    exe = shutil.which("unshare")
    if exe is None:
        return ()
    for args in ((exe, *_NAMESPACES), (exe, "-r", *_NAMESPACES)):
        try:
            if subprocess.run([*args, "true"], capture_output=True, timeout=10).returncode == 0:
                return args
        except (OSError, subprocess.TimeoutExpired):
            continue
    return ()


network_isolation = namespaces  # the same namespaces carry the network one


def _refusal(why: str) -> str:
    return (f"the MBPP code sandbox cannot confine programs here ({why}). Grading needs Landlock (Linux >= 5.13 "
            "with 'landlock' in the lsm= boot list; ABI >= 6 or permitted namespaces for signals), or a grader "
            "running as root with a Python that user nobody can read (e.g. /usr/bin/python3 instead of one under "
            "/root), plus util-linux unshare for the PID/mount/network namespaces")


@functools.lru_cache(maxsize=8)
def sandbox_plan(python: str = sys.executable) -> Plan:
    ns = namespaces()
    mount = pid = bool(ns)
    abi = landlock_abi()
    if abi and (abi >= 6 or pid):
        return Plan(ns, mount, pid, abi, None)
    if os.geteuid() != 0:
        return Plan(ns, mount, pid, abi, None, _refusal(
            f"Landlock ABI {abi}" + ("" if abi else " (none)") + (", no PID namespace" if not pid else "")
            + ", and not root, so no uid to drop to"))
    probe = Plan(ns, mount, pid, abi, NOBODY)
    res = _run_split(Split(_PROBE), SandboxLimits(wall_s=30.0, cpu_s=10.0), python, probe)
    if res.passed and res.stdout.split() == [str(NOBODY)] * 6:
        return probe
    last = (res.stderr.strip().splitlines() or [res.status])[-1][:200]
    return Plan(ns, mount, pid, abi, None, _refusal(
        f"Landlock ABI {abi}; the drop to nobody failed here: {last}"))


def require_sandbox(python: str = sys.executable) -> Plan:
    plan = sandbox_plan(python)
    if plan.refused:
        raise SandboxUnavailable(plan.refused)
    return plan


def drop_to_uid(python: str = sys.executable) -> int | None:
    """``nobody`` when the sandbox drops to it (only where Landlock is missing), else None."""
    return sandbox_plan(python).drop_to


def isolation(python: str = sys.executable) -> dict:
    """What this machine's sandbox uses for ``python`` (reported in es-eval's results.json)."""
    plan = sandbox_plan(python)
    ns = "PID, mount, network, IPC namespaces" if plan.prefix else "no namespaces (unshare not permitted)"
    ll = f"Landlock ABI {plan.landlock}" if plan.landlock else "no Landlock"
    return {
        "refused": plan.refused,
        "network": (f"namespace ({ns})" if plan.prefix else "audit hook only (unshare unavailable)")
                   + (" + Landlock TCP" if plan.landlock >= 4 else "") + " + audit hook",
        "user": ("nobody (65534), checked by a probe run" if plan.drop_to is not None else
                 "root without capabilities" if os.geteuid() == 0 else "unchanged (not root)"),
        "limits": "rlimit cpu, address space, file size, open files, processes; wall clock; process-group kill"
                  + ("; tmpfs disk quota" if plan.mount_ns else "; per-file size only (no mount namespace)"),
        "filesystem": f"{ll}: " + ("writes only in its own directory, reads only the interpreter and system "
                                    "libraries" if plan.landlock else "nobody's permissions") + "; audit hook",
        "signals": ("PID namespace" if plan.pid_ns else "")
                   + (" + Landlock signal scope" if plan.landlock >= 6 else ""),
        "verdict": "checked outside the program's process over plain values",
    }


@functools.lru_cache(maxsize=1)
def _pdeath_prefix() -> tuple[str, ...]:
    """``setpriv --pdeathsig KILL`` where it works (util-linux >= 2.33): the sandbox dies with the grader's thread."""
    exe = shutil.which("setpriv")
    try:
        cmd = (exe, "--pdeathsig", "KILL")
        if exe and subprocess.run([*cmd, "true"], capture_output=True, timeout=10).returncode == 0:
            return cmd
    except (OSError, subprocess.TimeoutExpired):
        pass
    return ()


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _read_capped(f, cap: int) -> str:
    f.seek(0)
    return f.read(cap).decode("utf-8", errors="replace")


@dataclass
class _Raw:
    returncode: int | None
    timed_out: bool
    over: bool
    stdout: str
    stderr: str
    result: dict | None
    error: str | None = None


def _launch(cfg: dict, limits: SandboxLimits, python: str, plan: Plan) -> _Raw:
    """One confined process: ``cfg`` (mode, program or tests) on stdin, its result line read back from a file."""
    outer = tempfile.mkdtemp(prefix="es-ray-sandbox-")
    try:
        work = os.path.join(outer, "work")
        os.mkdir(work, 0o700)
        os.chmod(outer, 0o711)  # the unprivileged program may pass through, not list or write
        if plan.drop_to is not None:
            os.chown(work, plan.drop_to, plan.drop_to)
        env = {"PATH": "/usr/bin:/bin", "HOME": work, "TMPDIR": work, "LANG": "C.UTF-8", "PYTHONHASHSEED": "0"}
        cmd = [*_pdeath_prefix(), *plan.prefix, python, "-I", "-S", "-B", "-c", _CHILD]
        files = [open(os.path.join(outer, n), "w+b") for n in ("stdout", "stderr", "result")]
        out, err, res = files
        try:
            payload = json.dumps({**cfg, "limits": asdict(limits), "work": work, "disk_kb": limits.disk_mb << 10,
                                  "mount_ns": plan.mount_ns, "pid_ns": plan.pid_ns, "landlock": plan.landlock,
                                  "drop_to": plan.drop_to, "result_fd": res.fileno(),
                                  "capset": CAPSET_SYSCALL.get(os.uname().machine)}).encode()
            try:
                proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=out, stderr=err, cwd=work, env=env,
                                        start_new_session=True, pass_fds=(res.fileno(),))
            except OSError as exc:
                return _Raw(None, False, False, "", "", None, f"could not start the sandbox: {exc}")
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
            # Python ignores SIGXFSZ: past the cap its writes fail with EFBIG, so the size tells
            over = max(os.fstat(out.fileno()).st_size, os.fstat(err.fileno()).st_size) >= limits.output_bytes
            lines = _read_capped(res, limits.output_bytes).splitlines()
            try:
                result = json.loads(lines[-1]) if lines else None
            except ValueError:
                result = None
            rc = proc.returncode
            if plan.pid_ns and rc is not None and rc > 128:  # killed inside: the namespace's init says 128 + signal
                rc = -(rc - 128)
            return _Raw(rc, timed_out, over, _read_capped(out, limits.output_bytes),
                        _read_capped(err, 64 << 10), result if isinstance(result, dict) else None)
        finally:
            for f in files:
                f.close()
    finally:
        if plan.drop_to is not None and not plan.mount_ns:
            _clean_shm(plan.drop_to)
        shutil.rmtree(outer, ignore_errors=True)


def _clean_shm(uid: int) -> None:
    """Without a private /dev/shm, remove what the sandbox user left there."""
    for entry in Path("/dev/shm").glob("*"):
        try:
            if entry.lstat().st_uid == uid:
                shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
        except OSError:
            pass


def _status(raw: _Raw) -> str:
    rc = raw.returncode
    if raw.error:
        return "error"
    if raw.timed_out or rc in (-signal.SIGXCPU, -signal.SIGKILL):
        return "timeout"
    if raw.over or rc == -signal.SIGXFSZ:
        return "output_limit"
    if rc == CONFINE_RC and raw.stderr.startswith(("es-ray-sandbox: cannot",)):  # stopped before the program ran
        return "error"
    if rc == 0:
        return "passed"
    if "MemoryError" in raw.stderr:
        return "memory"
    if BLOCKED_MARK in raw.stderr:
        return "blocked"
    return "failed"


def _run_split(split: Split, limits: SandboxLimits, python: str, plan: Plan) -> SandboxResult:
    t0 = time.monotonic()
    raw = _launch({"mode": "run", "program": split.code, "probes": split.probes}, limits, python, plan)
    status, stderr = _status(raw), raw.error or raw.stderr
    values = (raw.result or {}).get("values")
    if status == "passed" and not (isinstance(values, list) and len(values) == len(split.probes)):
        status = "failed"  # it exited 0 without running to its end (its tests never reported)
    if status == "passed" and split.tests and all(t["expected"] is not None for t in split.tests):
        verdicts = _compare_literals(split, values)
        if not all(verdicts):
            status = "failed"
            stderr += "AssertionError: " + "; ".join(t["source"][:200] for t, v in zip(split.tests, verdicts)
                                                     if not v)
    elif status == "passed" and split.tests:
        check = _launch({"mode": "verify", "imports": split.imports, "tests": split.tests, "values": values},
                        limits, python, plan)
        verdicts = (check.result or {}).get("verdicts")
        if _status(check) != "passed" or not isinstance(verdicts, list) or len(verdicts) != len(split.tests):
            status = "timeout" if _status(check) == "timeout" else "error"
            stderr += f"\nthe test check did not finish: {check.error or check.stderr[-2000:]}"
        elif not all(v is True for v in verdicts):
            status = "failed"
            failed = [t["source"] for t, v in zip(split.tests, verdicts) if v is not True]
            stderr += "AssertionError: " + "; ".join(f[:200] for f in failed[:3]) + "\n" + check.stderr[-2000:]
    return SandboxResult(status, raw.returncode, raw.stdout, stderr, time.monotonic() - t0)


def _compare_literals(split: Split, values: list) -> list[bool]:
    """Tests of the form ``probe == literal``, compared here: the probe's value rebuilt from plain data (exact
    builtin types), the literal by ast.literal_eval; no object of the program's is involved."""
    from es_ray.grading._sandbox_child import _decode

    verdicts = []
    for test in split.tests:
        (i,) = test["probes"]
        try:
            if not (isinstance(values[i], list) and values[i] and values[i][0] != "E"):
                raise ValueError("no value")
            verdicts.append(bool(_decode(values[i]) == ast.literal_eval(test["expected"])))
        except (ValueError, TypeError, KeyError, IndexError, RecursionError, MemoryError):
            verdicts.append(False)
    return verdicts


def run_python(program: str, limits: SandboxLimits = SandboxLimits(), python: str = sys.executable,
               n_tests: int | None = None, setup: str = "") -> SandboxResult:
    """Run ``program`` (Python source) confined; ``passed`` only if it ran to its end, exited 0 and every
    trailing top-level assert holds when checked outside its process. ``n_tests``: how many trailing asserts the
    program must end with (the task's tests; fewer means the code swallowed some, which fails); ``setup``: the
    task's setup code the program starts with (its imports are trusted by the check). Raises
    SandboxUnavailable where this machine gives no accepted boundary."""
    plan = require_sandbox(python)
    split = split_tests(program, setup)
    if n_tests is not None and len(split.tests) < n_tests:
        return SandboxResult("failed", None, "", f"the program ends with {len(split.tests)} of its {n_tests} tests "
                             "as separate asserts (its code swallowed the rest)", 0.0)
    return _run_split(split, limits, python, plan)


def run_many(programs: Sequence[str], limits: SandboxLimits = SandboxLimits(), workers: int = 2,
             n_tests: Sequence[int | None] | None = None, setups: Sequence[str] | None = None
             ) -> list[SandboxResult]:
    """Run several programs, ``workers`` at a time (each is its own process; threads only wait on them)."""
    require_sandbox()
    jobs = list(zip(programs, n_tests or [None] * len(programs), setups or [""] * len(programs)))

    def one(job):
        return run_python(job[0], limits, n_tests=job[1], setup=job[2])

    if workers <= 1 or len(jobs) <= 1:
        return [one(job) for job in jobs]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(one, jobs))
