"""Run untrusted Python (model-written MBPP solutions) so that it can neither pass without being right nor
reach anything outside its own directory.

The threat is a policy trained on this reward: anything a program can do to look correct, it will eventually
find. So the verdict never lives in the program's process (es_ray.grading.verdict): the program runs with its
tests' probes and reports plain values; a second process that never runs the program checks the tests over those
values (a test of the form ``probe == literal``, most of MBPP, is compared by the grader itself). A program that
exits early, reads the harness's frames or returns an object whose ``__eq__`` is always True reports nothing
usable and fails.

Confinement, per program (es_ray/grading/_sandbox_child.py; what holds which attack: docs/security.md). Nothing
inside the program's process is trusted:

* **Namespaces** (``unshare``, as root or with unprivileged user namespaces): PID (its own /proc), mount,
  network (a loopback that is down), IPC and UTS. Where they are not permitted, grading refuses to start.
* **A minimal root**: the namespace's init mounts a tmpfs holding the interpreter's prefix and ``/usr``
  read-only, four device files, a fresh /proc, private /tmp and /dev/shm and the working directory (a
  size-limited tmpfs), and pivots into it: no host socket, Ray session directory or other grader's work dir.
* **Landlock** where the kernel has it: writes only in the working directory, no TCP, signal scope.
* **A dedicated uid** (as root): ``UID_BASE`` + a slot held with a lock file for the run, never root; every
  capability and the bounding set dropped. A grader that is not root: root of a user namespace, no capabilities.
* **One process**: the init forks the program's process, which sets its rlimits (CPU, address space, file size,
  open files, threads) and installs the seccomp-bpf filter (es_ray/grading/seccomp.py) before its first
  instruction: no second process, exec, socket, ptrace, mount, namespaces, bpf, io_uring, ... (the init holds the
  filter's listener: a refused call is recorded and the process killed, ``escape_attempt``). So the per-process
  limits are the whole program's.
* **Kernel memory**: every tmpfs in the jail has ``nr_inodes`` as well as ``size`` (the work dir
  ``disk_inodes``), which bounds what a tmpfs keeps outside its blocks (inodes, dentries, symlink bodies, xattr
  space), and the filter answers the ``*setxattr*`` calls EOPNOTSUPP and SysV IPC's ``*get`` calls ENOSYS (a
  segment or queue is no process's memory). All of it goes with the mount namespace; a memfd or pipe goes with
  its descriptor (at most ``max_open_files`` x ``output_bytes`` or 1 MiB).
* **The record**: the init writes the one result record (exit status or signal, the program's pipe capped at
  ``output_bytes``) with a per-run nonce to a descriptor the program's process closes before any program code
  runs; the grader parses it with size and depth bounds and compares only hash-free values itself; the rest
  goes to the check process under ``check_s``. Anything not parsed or compared within that:
  ``unparseable_result``.
* **Wall clock**: the whole namespace dies after ``wall_s``; ``setpriv --pdeathsig`` kills it if the grader's
  thread dies.
* **Audit hook** (PEP 578): refuses the common escapes early and visibly (a PermissionError naming the event;
  the program fails). The program can switch it off or print its words; no guarantee and no failure kind rests
  on it.
* **Failure kinds** come only from what the program cannot write: the grader's own timer and the init's record
  (the listener's notification, the CPU time and peak memory the kernel counted, the pipe's and the files' sizes).
  A program that kills itself with a signal, or prints a mark, is ``failed`` (reason ``self_signal``, or its exit
  status). See ``_status``.
* **Size**: a program over ``MAX_PROGRAM_BYTES`` is not parsed (``too_long``), so the grader's own time per
  program is bounded whatever the candidate's size.

``isolation()`` says which layers this machine gives (es-eval writes it into results.json).
"""

from __future__ import annotations

import ast
import ctypes
import fcntl
import functools
import json
import os
import shutil
import signal
import secrets
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Sequence

from es_ray.grading._sandbox_child import ITEMS, MAX_JSON_DEPTH, _decode, bounded_loads
from es_ray.grading.seccomp import SYSCALLS, build_filter
from es_ray.grading.verdict import Split, TestsTooLarge, split_tests

NOBODY = 65534
UID_BASE = 2_000_000_000
"""First of the dedicated unprivileged uids (one per concurrent program, claimed with a lock file); never root,
never the uid that runs Ray."""
UID_SLOTS = 256
BLOCKED_MARK = "es-ray-sandbox: blocked"
DROP_MARK = "es-ray-sandbox: cannot drop to uid"
CONFINE_MARK = "es-ray-sandbox: cannot confine"
CONFINE_RC = 97
DROP_FAILED_RC = CONFINE_RC
_CHILD = (Path(__file__).with_name("_sandbox_child.py")).read_text()
# the landlock syscalls are 444-446 on both; capset's number differs
CAPSET_SYSCALL = {"x86_64": 126, "aarch64": 91}
_NAMESPACES = ("--pid", "--fork", "--kill-child", "--mount", "--mount-proc", "--net", "--ipc", "--uts")
# fractions: a module the bootstrap has not imported, so importing it shows that the jail holds the stdlib
_PROBE = (
    "import os, sys\nassert 'fractions' not in sys.modules\nimport fractions\n"
    "print(*os.getresuid(), *os.getresgid())\n"
    "print([l.split()[1] for l in open('/proc/self/status') if l.startswith('Seccomp:')][0])\n"
)
# the grader's own bounds on a result record (before and while it parses one)
RESULT_READ_FACTOR = 8  # a record holds at most output_bytes of the program's pipe, JSON-escaped (6x at worst)
MAX_PROGRAM_BYTES = 128 << 10
"""A program (setup, candidate and tests, UTF-8) longer than this is ``too_long`` before anything parses it: MBPP's
reference solutions with their tests stay under 4 KiB (a completion of 1,024 tokens under 8 KiB), and the grader
splits 128 KiB in well under a second (benchmarks/sandbox.py --split)."""
MEMORY_FRACTION = 0.9
"""``memory``: a program that did not pass and whose peak (virtual size sampled by the init, or resident size from
``wait4``) reached this fraction of ``memory_mb``."""
CPU_FRACTION = 0.9
"""``timeout`` without the wall clock: a program that did not pass and whose CPU time (``wait4``, counted in ticks:
1.96 s is seen for a 2 s limit) reached this fraction of RLIMIT_CPU."""
_FAST_TAGS = frozenset("nbsifctyYr")  # values the grader rebuilds itself: nothing of them is hashed


class SandboxUnavailable(RuntimeError):
    """This machine gives the sandbox no boundary it accepts; grading refuses to start."""


@dataclass(frozen=True)
class SandboxLimits:
    wall_s: float = 10.0
    """Wall-clock limit; the whole namespace is killed after it."""
    cpu_s: float = 5.0
    """CPU-time limit (RLIMIT_CPU, rounded up to whole seconds)."""
    memory_mb: int = 1024
    """Address-space limit (RLIMIT_AS; the program is one process, so this is the whole program's)."""
    output_bytes: int = 1 << 20
    """Cap on stdout, stderr, any file the program writes (RLIMIT_FSIZE) and its result record."""
    max_open_files: int = 64
    max_processes: int = 64
    """RLIMIT_NPROC for the dedicated uid (its threads; a second process is refused by seccomp)."""
    disk_mb: int = 16
    """Size of the tmpfs mounted on the working directory (the disk quota)."""
    disk_inodes: int = 1024
    """Inodes of that tmpfs (files, directories, symlinks): what bounds its kernel memory outside ``disk_mb``, at
    most a few KiB each (an inode, a dentry, a symlink's body up to 4 KiB, 1 KiB of xattr space)."""
    check_s: float = 3.0
    """Wall-clock limit of the separate test check, where one is needed: the grader's own time per program is at
    most wall_s + check_s plus two process starts."""


@dataclass(frozen=True)
class SandboxResult:
    status: str
    """passed | failed | timeout | memory | output_limit | escape_attempt | unparseable_result | too_long | error"""
    returncode: int | None
    stdout: str
    stderr: str
    seconds: float
    reason: str = ""
    """Why a ``failed`` program failed, as far as the jail saw it: ``wrong`` (a test did not hold), ``self_signal``
    (killed by a signal that no jail layer sent), ``exit N``, ``no_result``, ``tests_swallowed``,
    ``tests_too_large``."""

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
    """The first dedicated uid (as root), or None (root of a user namespace: capabilities dropped)."""
    refused: str | None = None
    seccomp: str = ""
    """The filter (es_ray/grading/seccomp.py) as hex."""
    jail: tuple = ()
    """The minimal root's mounts (see _jail_ops)."""
    hook: bool = True
    """The audit hook (a fast, visible first refusal; no guarantee rests on it). Tests switch layers off
    (seccomp="", jail=(), hook=False, landlock=0, drop_to=None) to show which one holds an attack."""


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
    return (
        f"the MBPP code sandbox cannot confine programs here ({why}). Grading needs Linux namespaces "
        "(util-linux unshare, run as root or with unprivileged user namespaces: sysctl "
        "kernel.unprivileged_userns_clone=1 / user.max_user_namespaces > 0; in Docker a seccomp profile that "
        "allows unshare, mount and pivot_root), seccomp with user notification (Linux >= 5.0) on x86_64 or "
        "aarch64, and an interpreter whose files "
        "are world-readable; Landlock (Linux >= 5.13, 'landlock' in the lsm= boot list) is used where present"
    )


SMALL_TMPFS = "size=64k,nr_inodes=16,mode=1777"
"""/tmp and /dev/shm inside the jail: the program writes in its working directory."""


def _jail_ops(python: str) -> tuple:
    """The minimal root for ``python``: its prefix and the system libraries read-only, four device files, a fresh
    /proc, small private /tmp and /dev/shm (the working directory is added per run)."""
    info = subprocess.run(
        [
            python,
            "-I",
            "-S",
            "-c",
            "import os, sys; print(sys.base_prefix); print(os.path.dirname(os.path.realpath(sys.executable)))",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout.split("\n")
    dirs = sorted({os.path.realpath(p) for p in ("/usr", *info[:2]) if p and os.path.isdir(p)})
    ops: list = []
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            ops.append(("symlink", top, os.readlink(top)))
        elif os.path.isdir(top):
            dirs.append(top)
    for d in sorted(set(dirs)):
        if not any(d != o and d.startswith(o.rstrip("/") + "/") for o in dirs):
            ops.append(("bind", d, 1))  # MS_RDONLY
    ops += [
        ("file", dev, 0) for dev in ("/dev/null", "/dev/zero", "/dev/urandom", "/dev/random") if os.path.exists(dev)
    ]
    if os.path.islink("/etc/localtime"):
        ops.append(("symlink", "/etc/localtime", os.readlink("/etc/localtime")))
    ops += [("proc", "/proc"), ("tmpfs", "/tmp", SMALL_TMPFS), ("tmpfs", "/dev/shm", SMALL_TMPFS)]
    return tuple(ops)


@functools.lru_cache(maxsize=8)
def sandbox_plan(python: str = sys.executable) -> Plan:
    ns = namespaces()
    abi = landlock_abi()
    try:
        bpf = build_filter().hex()
    except ValueError as exc:
        return Plan(ns, bool(ns), bool(ns), abi, None, _refusal(str(exc)))
    if not ns:
        return Plan(ns, False, False, abi, None, _refusal("no namespaces: unshare is not permitted"))
    drop = UID_BASE if os.geteuid() == 0 and "-r" not in ns else None
    probe = Plan(ns, True, True, abi, drop, None, bpf, _jail_ops(python))
    res = _run_split(Split(_PROBE), SandboxLimits(wall_s=30.0, cpu_s=10.0), python, probe)
    out = res.stdout.split()
    ids_ok = len(out) == 7 and (drop is None or (int(out[0]) >= UID_BASE and len(set(out[:6])) == 1))
    if res.passed and ids_ok and out[6] == "2":
        return probe
    last = (res.stderr.strip().splitlines() or [res.status])[-1][:300]
    return Plan(
        ns, True, True, abi, drop, _refusal(f"a probe program did not run confined here: {last}"), bpf, probe.jail
    )


def require_sandbox(python: str = sys.executable) -> Plan:
    plan = sandbox_plan(python)
    if plan.refused:
        raise SandboxUnavailable(plan.refused)
    return plan


def isolation(python: str = sys.executable) -> dict:
    """What this machine's sandbox uses for ``python`` (reported in es-eval's results.json)."""
    plan = sandbox_plan(python)
    ll = f"Landlock ABI {plan.landlock}" if plan.landlock else "no Landlock"
    return {
        "refused": plan.refused,
        "syscalls": "seccomp-bpf: no second process, no exec, no socket of any family, no ptrace, mount, "
        "namespaces, bpf, io_uring, userfaultfd, perf_event_open, keyctl (the init holds the filter's "
        "listener: a refused call is not run, the process is killed, escape_attempt); xattrs and SysV "
        "IPC refused",
        "network": "network namespace (loopback down) + seccomp (no socket)"
        + (" + Landlock TCP" if plan.landlock >= 4 else "")
        + " + audit hook",
        "user": (
            f"a dedicated uid from {UID_BASE} (one per concurrent program), checked by a probe run"
            if plan.drop_to is not None
            else "root of a user namespace without capabilities"
        ),
        "limits": "one process (seccomp), so rlimit cpu, address space, file size, open files are the whole "
        "program's; wall clock kills the PID namespace; tmpfs disk quota with nr_inodes (kernel memory)",
        "filesystem": "mount namespace with a minimal read-only root (interpreter, system libraries), private "
        f"/tmp and /dev/shm; {ll}" + (": writes only in its own directory" if plan.landlock else ""),
        "signals": "PID namespace" + (" + Landlock signal scope" if plan.landlock >= 6 else ""),
        "verdict": "checked outside the program's process over plain values; the record comes from the "
        "namespace's init with a per-run nonce, bounded before it is parsed",
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


def _reached(f, cap: int) -> bool:
    """Whether the program wrote ``cap`` bytes to ``f``: its size reached the cap with no hole before it (a file
    truncated or seeked up to the cap, with nothing written, reads as the cap in ``st_size`` alone)."""
    if os.fstat(f.fileno()).st_size < cap:
        return False
    try:
        return os.lseek(f.fileno(), 0, os.SEEK_HOLE) >= cap
    except OSError:  # no SEEK_HOLE on this file system: the whole file is data
        return True


def _read_capped(f, cap: int) -> str:
    f.seek(0)
    return f.read(cap).decode("utf-8", errors="replace")


@contextmanager
def _uid_slot(plan: Plan):
    """A dedicated uid for one program, held (flock) while it runs, so that concurrent graders on this node, in
    this process or others, never share one (RLIMIT_NPROC counts per uid)."""
    if plan.drop_to is None:
        yield None
        return
    lockdir = os.path.join(tempfile.gettempdir(), "es-ray-sandbox-uids")
    os.makedirs(lockdir, mode=0o700, exist_ok=True)
    for slot in range(UID_SLOTS):
        f = open(os.path.join(lockdir, str(slot)), "a")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.close()
            continue
        try:
            yield plan.drop_to + slot
        finally:
            f.close()
        return
    raise RuntimeError(f"all {UID_SLOTS} sandbox uids are in use")


@dataclass
class _Raw:
    returncode: int | None
    """How the program's process ended: its exit status, or -signal."""
    timed_out: bool
    over: bool
    stdout: str
    stderr: str
    result: dict | None
    error: str | None = None
    """The sandbox could not confine (from the nonce-carrying record) or could not start."""
    unparseable: bool = False
    refused: int | None = None
    """The system call the seccomp filter refused (the init's listener saw it)."""
    cpu_out: bool = False
    """The kernel counted the CPU limit used up (``wait4``'s rusage)."""
    memory_out: bool = False
    """The peak the init observed reached MEMORY_FRACTION of the limit."""


def _launch(cfg: dict, limits: SandboxLimits, python: str, plan: Plan) -> _Raw:
    """One confined run: ``cfg`` (mode, program or tests) on stdin; the namespace's init writes one record, with
    this run's nonce, to a file only it holds."""
    outer = tempfile.mkdtemp(prefix="es-ray-sandbox-")
    nonce, mark = secrets.token_hex(16), secrets.token_hex(8)
    try:
        work, root = os.path.join(outer, "work"), os.path.join(outer, "root")
        os.mkdir(work, 0o700)
        os.mkdir(root, 0o700)
        with _uid_slot(plan) as uid:
            owner = "" if uid is None else f",uid={uid},gid={uid}"
            ops = [
                *(plan.jail or [("tmpfs", "/dev/shm", SMALL_TMPFS)]),
                ("tmpfs", work, f"size={limits.disk_mb << 10}k,nr_inodes={limits.disk_inodes},mode=0700{owner}"),
            ]
            env = {"PATH": "/usr/bin:/bin", "HOME": work, "TMPDIR": work, "LANG": "C.UTF-8", "PYTHONHASHSEED": "0"}
            cmd = [*_pdeath_prefix(), *plan.prefix, python, "-I", "-S", "-B", "-c", _CHILD]
            files = [open(os.path.join(outer, n), "w+b") for n in ("stdout", "stderr", "result")]
            out, err, res = files
            try:
                machine = os.uname().machine
                payload = json.dumps(
                    {
                        **cfg,
                        "limits": asdict(limits),
                        "work": work,
                        "nonce": nonce,
                        "mark_nonce": mark if plan.hook else None,
                        "pid_ns": plan.pid_ns,
                        "landlock": plan.landlock,
                        "drop_to": uid,
                        "result_fd": res.fileno(),
                        "capset": CAPSET_SYSCALL.get(machine),
                        "seccomp": plan.seccomp,
                        "seccomp_nr": _syscall_nr(machine, "seccomp"),
                        "exit_nr": _syscall_nr(machine, "exit_group"),
                        "jail": {"root": root if plan.jail else "", "ops": ops, "pivot_root": _pivot_root_nr(machine)},
                    }
                ).encode()
                try:
                    proc = subprocess.Popen(
                        cmd,
                        stdin=subprocess.PIPE,
                        stdout=out,
                        stderr=err,
                        cwd=outer,
                        env=env,
                        start_new_session=True,
                        pass_fds=(res.fileno(),),
                    )
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
                    _kill_group(proc)  # always: the namespace's init dies, and with it every process inside
                    proc.wait()
                # Python ignores SIGXFSZ: past the cap its writes fail with EFBIG, so the size tells
                over = _reached(out, limits.output_bytes) or _reached(err, limits.output_bytes)
                record = _record(_read_capped(res, RESULT_READ_FACTOR * limits.output_bytes + 4096), nonce)
                raw = _Raw(
                    None, timed_out, over, _read_capped(out, limits.output_bytes), _read_capped(err, 64 << 10), None
                )
                if record is None:
                    raw.error = None if timed_out else f"the sandbox ended without its record (rc {proc.returncode})"
                elif record.get("stage") == "confine":
                    raw.error = f"{CONFINE_MARK}: {record.get('error')}"
                else:
                    sig, code = record.get("signal"), record.get("exit")
                    raw.returncode = -sig if isinstance(sig, int) else code if isinstance(code, int) else None
                    raw.over = raw.over or record.get("over") is True or record.get("file_at_cap") is True
                    raw.result, raw.unparseable = _parse_result(record.get("result"))
                    refused, cpu, peak = record.get("refused"), record.get("cpu_s"), record.get("peak_kb")
                    raw.refused = refused if type(refused) is int else None
                    raw.cpu_out = type(cpu) is float and cpu >= CPU_FRACTION * _cpu_limit(limits)
                    raw.memory_out = type(peak) is int and peak >= MEMORY_FRACTION * (limits.memory_mb << 10)
                return raw
            finally:
                for f in files:
                    f.close()
    finally:
        shutil.rmtree(outer, ignore_errors=True)


def _syscall_nr(machine: str, name: str) -> int | None:
    return SYSCALLS.get(machine, {}).get(name)


def _pivot_root_nr(machine: str) -> int | None:
    return _syscall_nr(machine, "pivot_root")


def _cpu_limit(limits: SandboxLimits) -> int:
    return max(1, int(-(-limits.cpu_s // 1)))  # RLIMIT_CPU's soft limit, as _sandbox_child._rlimits sets it


def _record(text: str, nonce: str) -> dict | None:
    """The init's record: the last line, and only if it carries this run's nonce."""
    lines = text.rstrip("\n").rsplit("\n", 1)
    try:
        record = bounded_loads(lines[-1], 2) if lines[-1] else None
    except ValueError:
        return None
    return record if isinstance(record, dict) and record.get("nonce") == nonce else None


def _parse_result(text) -> tuple[dict | None, bool]:
    """The program's pipe (at most output_bytes): its last line as a dict, or (None, True) when it is there but
    cannot be parsed within the bounds (MAX_JSON_DEPTH measured without recursion, no NaN/Infinity): the same
    parse the check's init uses on what the grader sends it."""
    if not isinstance(text, str) or not text.strip():
        return None, False
    try:
        value = bounded_loads(text.rstrip("\n").rsplit("\n", 1)[-1], MAX_JSON_DEPTH)
    except (ValueError, MemoryError):
        return None, True
    return (value, False) if isinstance(value, dict) else (None, True)


def _status(raw: _Raw) -> tuple[str, str]:
    """The status and, for ``failed``, its reason, from the jail's observations only: the grader's timer, the
    record's listener notification, the kernel's CPU and memory counters, the pipe's and files' sizes. Never from
    the program's exit signal alone or its stderr: a signal it raised on itself is ``failed``/``self_signal``."""
    rc = raw.returncode
    if raw.timed_out:
        return "timeout", ""
    if raw.error:
        return "error", ""
    if raw.refused is not None:
        return "escape_attempt", ""
    if raw.over:
        return "output_limit", ""
    if raw.unparseable:
        return "unparseable_result", ""
    if rc == 0:
        return "passed", ""
    if raw.cpu_out:
        return "timeout", ""
    if raw.memory_out:
        return "memory", ""
    if rc is None:
        return "failed", "no_result"
    return "failed", "self_signal" if rc < 0 else f"exit {rc}"


def _run_split(split: Split, limits: SandboxLimits, python: str, plan: Plan) -> SandboxResult:
    t0 = time.monotonic()
    raw = _launch({"mode": "run", "program": split.code, "probes": split.probes}, limits, python, plan)
    (status, reason), stderr = _status(raw), raw.error or raw.stderr
    values = (raw.result or {}).get("values")
    if status == "passed" and not (isinstance(values, list) and len(values) == len(split.probes)):
        status, reason = "failed", "no_result"  # it exited 0 without running to its end (its tests never reported)
    if status != "passed" or not split.tests:
        return SandboxResult(status, raw.returncode, raw.stdout, stderr, time.monotonic() - t0, reason)
    verdicts = _compare_literals(split, values)
    if None in verdicts:  # some tests need the check process: the value holds something hashed, or the test is
        check_limits = replace(limits, wall_s=limits.check_s, cpu_s=min(limits.cpu_s, limits.check_s))
        check = _launch(
            {"mode": "verify", "imports": split.imports, "tests": split.tests, "values": values},
            check_limits,
            python,
            plan,
        )
        checked = (check.result or {}).get("verdicts")
        if check.error and not check.timed_out:  # the sandbox itself broke (a grader failure, not the program's)
            return SandboxResult(
                "error", raw.returncode, raw.stdout, stderr + "\n" + check.error, time.monotonic() - t0
            )
        if _status(check)[0] != "passed" or not isinstance(checked, list) or len(checked) != len(split.tests):
            # its values could not be rebuilt or compared within the check's budget: the program's failure
            stderr += f"\nits values could not be checked within {limits.check_s:g} s: {check.stderr[-2000:]}"
            return SandboxResult("unparseable_result", raw.returncode, raw.stdout, stderr, time.monotonic() - t0)
        verdicts = [v if v is not None else checked[i] is True for i, v in enumerate(verdicts)]
        stderr += check.stderr[-2000:]
    if not all(v is True for v in verdicts):
        status, reason = "failed", "wrong"
        stderr += "AssertionError: " + "; ".join(
            t["source"][:200] for t, v in zip(split.tests, verdicts) if v is not True
        )
    return SandboxResult(status, raw.returncode, raw.stdout, stderr, time.monotonic() - t0, reason)


def _hash_free(x, budget: list[int]) -> bool:
    """Whether an encoded value holds only scalars, lists and tuples (nothing the grader would hash), within
    ``budget`` items."""
    budget[0] -= 1
    if budget[0] < 0 or type(x) is not list or not x or x[0] not in _FAST_TAGS and x[0] not in ("l", "t"):
        return False
    return x[0] not in ("l", "t") or (len(x) == 2 and type(x[1]) is list and all(_hash_free(y, budget) for y in x[1]))


def _compare_literals(split: Split, values: list) -> list[bool | None]:
    """Tests of the form ``probe == literal`` whose value holds nothing hashed, compared here: the value rebuilt
    from plain data (exact builtin types), the literal by ast.literal_eval. None: left to the check process
    (sets and dicts, whose rebuilding could be made quadratic by colliding hashes, and every other test shape).
    Total: a value that cannot be rebuilt is False, whatever it raises."""
    verdicts: list[bool | None] = []
    for test in split.tests:
        if test["expected"] is None:
            verdicts.append(None)
            continue
        (i,) = test["probes"]
        value = values[i]
        if type(value) is list and value and value[0] == "E":
            verdicts.append(False)
            continue
        try:
            if not _hash_free(value, [ITEMS]):
                verdicts.append(None)
                continue
            verdicts.append(bool(_decode(value) == ast.literal_eval(test["expected"])))
        except Exception:  # noqa: BLE001 - the program's value, whatever it is, fails
            verdicts.append(False)
    return verdicts


def run_python(
    program: str,
    limits: SandboxLimits = SandboxLimits(),
    python: str = sys.executable,
    n_tests: int | None = None,
    setup: str = "",
    entry: Sequence[str] = (),
) -> SandboxResult:
    """Run ``program`` (Python source) confined; ``passed`` only if it ran to its end, exited 0 and every
    trailing top-level assert holds when checked outside its process. ``n_tests``: how many trailing asserts the
    program must end with (the task's tests; fewer means the code swallowed some, which fails); only those are
    checked, the candidate's own asserts before them run in its process (None: every trailing assert is a test,
    the caller vouches for all of them). ``setup``: the task's setup code the program starts with (its imports
    are trusted by the check). ``entry``: the names the task's reference solution defines (its function under
    test): where the program binds one of them over a builtin (``def sum(n)``), the tests use the program's
    binding only, as the task's own harness does. Raises SandboxUnavailable where this machine gives no accepted
    boundary."""
    plan = require_sandbox(python)
    if len(program) > MAX_PROGRAM_BYTES or len(program.encode("utf-8", "surrogatepass")) > MAX_PROGRAM_BYTES:
        return SandboxResult("too_long", None, "", f"the program is over {MAX_PROGRAM_BYTES} bytes: not graded", 0.0)
    try:
        split = split_tests(program, setup, n_tests, entry)
    except TestsTooLarge as exc:
        return SandboxResult("failed", None, "", str(exc), 0.0, "tests_too_large")
    if n_tests is not None and split.asserts < n_tests:
        return SandboxResult(
            "failed",
            None,
            "",
            f"the program ends with {split.asserts} of its {n_tests} tests "
            "as separate asserts (its code swallowed the rest)",
            0.0,
            "tests_swallowed",
        )
    return _run_split(split, limits, python, plan)


def run_many(
    programs: Sequence[str],
    limits: SandboxLimits = SandboxLimits(),
    workers: int = 2,
    n_tests: Sequence[int | None] | None = None,
    setups: Sequence[str] | None = None,
    entries: Sequence[Sequence[str]] | None = None,
) -> list[SandboxResult]:
    """Run several programs, ``workers`` at a time (each is its own process; threads only wait on them)."""
    require_sandbox()
    jobs = list(
        zip(
            programs, n_tests or [None] * len(programs), setups or [""] * len(programs), entries or [()] * len(programs)
        )
    )

    def one(job):
        t0 = time.monotonic()
        try:
            return run_python(job[0], limits, n_tests=job[1], setup=job[2], entry=job[3])
        except Exception as exc:  # noqa: BLE001 - one program never takes its batch down: a grader failure, counted
            return SandboxResult(
                "error",
                None,
                "",
                f"the grader failed on this program: {type(exc).__name__}: {str(exc)[:300]}",
                time.monotonic() - t0,
            )

    if workers <= 1 or len(jobs) <= 1:
        return [one(job) for job in jobs]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(one, jobs))
