"""The sandboxed side of es_ray.grading.sandbox: confine this process, then run a program or check its values.

Run as ``python -I -S -B -c <this file's text>`` inside the namespaces the parent chose; the configuration comes
on stdin. This process (the namespace's init) confines itself, then forks the one process that runs untrusted
code, and only it writes the result record, to a descriptor that the forked process closes before anything of
the program runs. Two modes for that process:

* ``run``: the candidate's code, then each probe (an expression of the tests that calls the candidate's code);
  every probe's value is encoded as plain data (exact builtin types only) and written to a pipe.
* ``verify``: no candidate code. The tests' own imports, then each test with the probes replaced by the decoded
  values; the list of booleans goes back the same way. Decoding builds builtin objects, so a value cannot bring
  its own ``__eq__``.

The record this process writes carries the run's nonce, how the forked process ended (exit status or signal,
read by ``wait4``), and this process's own observations, which the program cannot write: the system call the
seccomp filter refused (a notification on the filter's listener, which only this process holds; it then kills the
program's process), the CPU time and peak memory the kernel counted (``wait4``'s rusage, the peak virtual size
sampled from /proc), whether a file in the working directory reached the file-size limit, and at most
``output_bytes`` of what came through the pipe, as a string; the grader parses that string with its own bounds.
The program can write anything into its pipe (that is the same as computing other values) but cannot reach the
record: the descriptor is closed in its process, this process is not dumpable (no ``/proc/1/mem`` or
``/proc/1/fd`` without CAP_SYS_PTRACE) and ptrace is
refused by the filter.

Confinement, in order: the minimal root (a tmpfs with the interpreter, the system libraries, a fresh /proc,
private /tmp, /dev/shm and a size-limited working directory, then ``pivot_root``), Landlock, the drop to the
grader's dedicated uid (as root) or of every capability (root of a user namespace); then, in the forked
process, rlimits, the seccomp filter (es_ray/grading/seccomp.py, built by the grader) and the audit hook.
"""

# Every other import stays in the function that needs it: this file runs as the sandbox's init (python -I -S),
# where each import is start-up time, and a module already in sys.modules is one the program gets without the audit
# hook seeing its import.
import builtins
import json
import os
import re
import resource
import select
import signal
import sys

MARK = "es-ray-sandbox: blocked"
DROP_MARK = "es-ray-sandbox: cannot drop to uid"
CONFINE_MARK = "es-ray-sandbox: cannot confine"
CONFINE_RC = 97
LANDLOCK_FS = (1 << 13, 1 << 14, 1 << 15, 1 << 15, 1 << 16, 1 << 16, 1 << 16)  # handled fs rights by ABI 1..7
READ_RIGHTS = 1 | 4 | 8  # EXECUTE, READ_FILE, READ_DIR
FILE_RIGHTS = 1 | 2 | 4 | (1 << 14) | (1 << 15)  # the rights that apply to a regular file
ITEMS = 1_000_000
"""Items a value may hold to cross, and at most one per MIN_ITEM_BYTES of ``output_bytes`` (a value with more
cannot fit the pipe: it fails at once as too large, not after encoding it all)."""
MIN_ITEM_BYTES = 5  # ["n"] and its comma
MAX_JSON_DEPTH = 160
"""Nesting of a result line: a value is at most 64 levels deep, two JSON levels each, in two levels of record."""
INPUT_DEPTH = MAX_JSON_DEPTH + 4
"""This process's configuration: the values the grader parsed (at most MAX_JSON_DEPTH) inside two levels."""
PEAK_SAMPLE_MS = 20
"""How often the init samples the program's peak virtual size (VmPeak) while it runs."""
ROOT_INODES = 128
"""Inodes of the minimal root's own tmpfs (its directories, device files and links; read-only once pivoted)."""
SYSTEM_DIRS = ("/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin", "/etc/localtime", "/dev/urandom", "/dev/zero")


_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")


def _no_constant(name):
    raise ValueError("%s is not a JSON value" % name)


def bounded_loads(text, max_depth):
    """``json.loads`` that is total and never recurses past ``max_depth``: the nesting is measured first by a
    linear scan (strings removed, then brackets counted), so the interpreter's recursion limit, which a host
    process may have raised, never decides. No NaN or Infinity. Raises ValueError on anything else."""
    if not isinstance(text, str):
        raise ValueError("not text")
    depth = deepest = 0
    for c in _NOT_BRACKET.sub("", _STRING.sub("", text)):
        depth += 1 if c in "[{" else -1
        if depth > deepest:
            deepest = depth
            if deepest > max_depth:
                raise ValueError("nested deeper than %d levels" % max_depth)
    try:
        return json.loads(text, parse_constant=_no_constant)
    except (RecursionError, MemoryError) as exc:
        raise ValueError("%s while parsing" % type(exc).__name__)


def _die(mark, why):
    sys.stderr.write("%s: %s\n" % (mark, why))
    sys.stderr.flush()
    os._exit(CONFINE_RC)


def _rlimits(lim):
    cpu = max(1, int(-(-lim["cpu_s"] // 1)))
    for name, soft, hard in (
        ("RLIMIT_CPU", cpu, cpu + 1),
        ("RLIMIT_AS", lim["memory_mb"] << 20, None),
        ("RLIMIT_FSIZE", lim["output_bytes"], None),
        ("RLIMIT_CORE", 0, None),
        ("RLIMIT_NOFILE", lim["max_open_files"], None),
        ("RLIMIT_NPROC", lim["max_processes"], None),
    ):
        resource.setrlimit(getattr(resource, name), (soft, soft if hard is None else hard))


MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC = 1, 2, 4, 8, 32, 4096, 16384
MNT_DETACH = 2


def _jail(libc, check, jail):
    """Build the minimal root the parent planned (es_ray.grading.sandbox._jail_ops) on a tmpfs and pivot into
    it: nothing of the host is reachable by path afterwards (no socket, no Ray session dir, no other work dir)."""
    root = jail["root"]

    def mount(src, dst, fstype, flags, data):
        check(
            libc.mount(src and src.encode(), dst.encode(), fstype and fstype.encode(), flags, data and data.encode())
            == 0,
            "mount %s on %s" % (fstype or src, dst),
        )

    if root:  # else (only in the tests that switch the minimal root off) the mounts go over the host's tree
        mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=256k,nr_inodes=%d,mode=0755" % ROOT_INODES)
    for op in jail["ops"]:
        kind, path = op[0], op[1]
        dst = root + path
        if kind == "symlink":
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            os.symlink(op[2], dst)
            continue
        if kind == "file":
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            open(dst, "w").close()
        else:
            os.makedirs(dst, exist_ok=True)
        if kind in ("bind", "file"):
            mount(path, dst, None, MS_BIND | MS_REC, None)
            # a remount keeps the source's locked flags (a user namespace may not clear them) and adds read-only
            keep = op[2] | (os.statvfs(path).f_flag & (MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC))
            mount(None, dst, None, MS_BIND | MS_REMOUNT | keep, None)
        elif kind == "proc":
            mount("proc", dst, "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
        else:  # tmpfs
            mount("tmpfs", dst, "tmpfs", MS_NOSUID | MS_NODEV, op[2])
    if not root:
        return
    os.chdir(root)
    check(libc.syscall(jail["pivot_root"], b".", b".") == 0, "pivot_root")
    check(libc.umount2(b".", MNT_DETACH) == 0, "detach the host's root")
    os.chdir("/")
    mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV, None)


def _confine(cfg):
    """Mounts, Landlock and privileges; returns the working directory. Raises on any failure."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    work = cfg["work"]
    try:  # read before Landlock, which leaves /proc unreadable where there is no PID namespace
        last_cap = int(open("/proc/sys/kernel/cap_last_cap").read())
    except (OSError, ValueError):
        last_cap = 63

    def check(ok, what):
        if not ok:
            raise OSError("%s: %s" % (what, os.strerror(ctypes.get_errno())))

    if cfg.get("jail"):
        _jail(libc, check, cfg["jail"])
    os.chdir(work)
    abi = cfg["landlock"]
    if abi:

        class Attr(ctypes.Structure):
            _fields_ = [("fs", ctypes.c_uint64), ("net", ctypes.c_uint64), ("scoped", ctypes.c_uint64)]

        class Beneath(ctypes.Structure):
            _pack_ = 1
            _fields_ = [("allowed", ctypes.c_uint64), ("fd", ctypes.c_int32)]

        fs_all = LANDLOCK_FS[min(abi, 7) - 1] - 1
        attr = Attr(fs_all, 3 if abi >= 4 else 0, 3 if abi >= 6 else 0)  # TCP bind+connect; abstract sockets+signals
        size = ctypes.sizeof(attr) if abi >= 6 else (16 if abi >= 4 else 8)
        ruleset = libc.syscall(444, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
        check(ruleset >= 0, "landlock_create_ruleset")
        exe_dir = os.path.dirname(os.path.realpath(sys.executable))
        rules = [(p, READ_RIGHTS) for p in (sys.base_prefix, sys.prefix, exe_dir, *SYSTEM_DIRS)]
        rules += [("/dev/null", READ_RIGHTS | 2), (work, fs_all)]
        if cfg["pid_ns"]:
            rules.append(("/proc", READ_RIGHTS))  # a fresh proc: this namespace's processes only
        for path, rights in rules:
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                continue
            if not os.path.isdir(path):
                rights &= FILE_RIGHTS
            rule = Beneath(rights & fs_all, fd)
            check(libc.syscall(445, ruleset, 1, ctypes.byref(rule), 0) == 0, "landlock_add_rule " + path)
            os.close(fd)
        check(libc.prctl(38, 1, 0, 0, 0) == 0, "PR_SET_NO_NEW_PRIVS")
        check(libc.syscall(446, ruleset, 0) == 0, "landlock_restrict_self")
        os.close(ruleset)
    if os.geteuid() == 0:
        for cap in range(last_cap + 1):
            libc.prctl(24, cap, 0, 0, 0)  # PR_CAPBSET_DROP: exec cannot regain them
    if os.geteuid() == 0 and cfg["drop_to"] is not None:
        uid = cfg["drop_to"]
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            if os.getresuid() != (uid,) * 3 or os.getresgid() != (uid,) * 3:
                raise OSError("uid/gid are %r/%r after the drop" % (os.getresuid(), os.getresgid()))
        except OSError as exc:  # never run the program as root when the drop was asked for
            raise OSError("%s %d: %s" % (DROP_MARK, uid, exc))
    elif os.geteuid() == 0:  # root of a user namespace without capabilities: no mount, no DAC override
        header = (ctypes.c_uint32 * 2)(0x20080522, 0)
        data = (ctypes.c_uint32 * 6)()
        check(
            cfg["capset"] is not None and libc.syscall(cfg["capset"], ctypes.byref(header), ctypes.byref(data)) == 0,
            "capset",
        )
    return os.path.realpath(os.getcwd())


def _audit_hook(root, mark_nonce):
    """Refuse the common escapes fast and visibly; the kernel layers (seccomp, the jail, Landlock) are the
    boundary. Its mark carries a nonce of its own: the program can read it, so a forged mark only changes which
    reason a failing program is counted under."""
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
    blocked_prefixes = (
        "socket.",
        "ctypes.",
        "subprocess.",
        "os.fork",
        "os.forkpty",
        "os.system",
        "os.exec",
        "os.posix_spawn",
        "os.spawn",
        "os.kill",
        "os.killpg",
        "signal.pthread_kill",
        "resource.setrlimit",
        "resource.prlimit",
        "gc.get_referrers",
        "gc.get_referents",
        "gc.get_objects",
        "urllib.",
        "http.client.",
        "ftplib.",
        "smtplib.",
        "poplib.",
        "imaplib.",
        "nntplib.",
        "telnetlib.",
        "webbrowser.",
        "pty.",
    )
    path_events = {
        "os.remove": 1,
        "os.rmdir": 1,
        "os.mkdir": 1,
        "os.chmod": 1,
        "os.chown": 1,
        "os.truncate": 1,
        "os.utime": 1,
        "os.chflags": 1,
        "os.lchflags": 1,
        "os.setxattr": 1,
        "os.removexattr": 1,
        "shutil.rmtree": 1,
        "os.rename": 2,
        "os.link": 2,
        "os.symlink": 2,
    }
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
                sys.stderr.write("%s [%s] %s\n" % (MARK, mark_nonce, event))
            except Exception:
                pass
        raise PermissionError("%s: %s is not allowed" % (MARK, event))

    def hook(event, args):
        if event == "open":
            if args[2] & write_flags and not inside(args[0]):
                deny("write outside the working directory")
        elif event in path_events:
            for p in args[: path_events[event]]:
                if not inside(p):
                    deny(event + " outside the working directory")
        elif event == "import" and args[0] in ("_ctypes", "ctypes", "_posixsubprocess"):
            deny("import " + args[0])
        elif event.startswith(blocked_prefixes):
            deny(event)

    sys.addaudithook(hook)


# -- values as plain data ---------------------------------------------------------------------------------------

_DUNDERS = (
    "__eq__",
    "__ne__",
    "__hash__",
    "__iter__",
    "__len__",
    "__getitem__",
    "__lt__",
    "__le__",
    "__gt__",
    "__ge__",
    "__bool__",
    "__contains__",
)


def _encode(v, depth=0, budget=None):
    """Exact builtin types (and the collections/iterator types tests compare against) as tagged JSON."""
    import collections
    import itertools

    budget = budget if budget is not None else [ITEMS]
    budget[0] -= 1
    if depth > 64 or budget[0] < 0:
        raise ValueError("value too deep or too large")
    t, enc = type(v), (lambda x: _encode(x, depth + 1, budget))
    if v is None:
        return ["n"]
    if t in (bool, str):
        return ["b" if t is bool else "s", v]
    if t is int:  # hexadecimal: no digit limit (str(v) refuses more than 4,300 digits) and linear
        return ["i", format(v, "x")]
    if t is float:
        return ["f", repr(v)]
    if t is complex:
        return ["c", repr(v.real), repr(v.imag)]
    if t in (bytes, bytearray):
        return ["y" if t is bytes else "Y", v.hex()]
    if t is range:
        return ["r", v.start, v.stop, v.step]
    simple = {list: "l", tuple: "t", set: "S", frozenset: "F", collections.deque: "Q"}
    if t in simple:
        return [simple[t], [enc(x) for x in v]]
    maps = {dict: "d", collections.Counter: "C", collections.OrderedDict: "O", collections.defaultdict: "D"}
    if t in maps:
        return [maps[t], [[enc(k), enc(x)] for k, x in dict.items(v)]]
    if t.__name__ in ("dict_keys", "dict_values", "dict_items") and t.__module__ == "builtins":
        return [t.__name__, [enc(x) for x in v]]
    if t.__module__ == "decimal" and t.__name__ == "Decimal":
        return ["Dec", str(v)]
    if t.__module__ == "fractions" and t.__name__ == "Fraction":
        return ["Frac", format(v.numerator, "x"), format(v.denominator, "x")]
    if issubclass(t, tuple) and not any(d in vars(k) for k in t.__mro__[:-2] for d in _DUNDERS):
        return ["t", [enc(x) for x in tuple.__iter__(v)]]  # a namedtuple compares as a tuple
    if t.__module__ in ("builtins", "itertools") and hasattr(t, "__next__"):  # generators, map, zip, ...
        items = list(itertools.islice(v, ITEMS + 1))
        if len(items) > ITEMS:
            raise ValueError("iterator longer than %d items" % ITEMS)
        return ["I", [enc(x) for x in items]]
    raise TypeError(
        "a test value of type %s.%s cannot be compared outside the program" % (t.__module__, t.__qualname__)
    )


def _int(x):
    if type(x) is not int:
        raise ValueError("malformed value")
    return x


def _decode(x, depth=0):
    import collections

    if depth > 70 or type(x) is not list or not x or type(x[0]) is not str:
        raise ValueError("malformed value")
    tag, args, dec = x[0], x[1:], (lambda y: _decode(y, depth + 1))
    scalar = {
        "n": lambda: None,
        "b": lambda: bool(args[0]) if type(args[0]) is bool else None,
        "s": lambda: args[0] if type(args[0]) is str else None,
        "i": lambda: int(args[0], 16),
        "f": lambda: float(args[0]),
        "c": lambda: complex(float(args[0]), float(args[1])),
        "y": lambda: bytes.fromhex(args[0]),
        "Y": lambda: bytearray.fromhex(args[0]),
        "r": lambda: range(_int(args[0]), _int(args[1]), _int(args[2])),
        "Dec": lambda: __import__("decimal").Decimal(args[0]),  # imported only when used: fractions costs 40 ms
        "Frac": lambda: __import__("fractions").Fraction(int(args[0], 16), int(args[1], 16)),
    }
    if tag in scalar:
        out = scalar[tag]()
        if out is None and tag != "n":
            raise ValueError("malformed value")
        return out
    if type(args[0]) is not list:
        raise ValueError("malformed value")
    seqs = {
        "l": list,
        "t": tuple,
        "S": set,
        "F": frozenset,
        "Q": collections.deque,
        "I": lambda xs: iter(list(xs)),
        "dict_keys": lambda xs: dict.fromkeys(xs).keys(),
        "dict_values": lambda xs: dict(enumerate(xs)).values(),
    }
    if tag in seqs:
        return seqs[tag](dec(y) for y in args[0])
    maps = {
        "d": dict,
        "C": lambda kv: collections.Counter(dict(kv)),
        "O": collections.OrderedDict,
        "D": lambda kv: collections.defaultdict(None, kv),
        "dict_items": lambda kv: dict(kv).items(),
    }
    if tag in maps:
        pairs = [(dec(k), dec(v)) for k, v in args[0]]
        return maps[tag](pairs)
    raise ValueError("unknown value tag")


# -- the two modes ----------------------------------------------------------------------------------------------


def _run(cfg, out):
    """The candidate's code, then its probes; only values leave this process."""
    dumps, write = json.dumps, out.write
    items = min(ITEMS, cfg["limits"]["output_bytes"] // MIN_ITEM_BYTES)

    def encode(value):
        return _encode(value, 0, [items])

    glb = {"__name__": "__main__", "__builtins__": builtins}
    exec(compile(cfg["program"], "program.py", "exec"), glb)

    def failure(exc):
        if isinstance(exc, SystemExit):
            raise exc
        return ["E", "%s: %s" % (type(exc).__name__, str(exc)[:200])]

    def safe_encode(value):
        try:
            return encode(value)
        except BaseException as exc:  # noqa: BLE001 - a value that cannot cross fails its test
            return failure(exc)

    values = []
    for probe in cfg["probes"]:
        if isinstance(probe, dict):  # a comprehension or lambda: each site's values in order
            sites = [[] for _ in range(probe["sites"])]

            def site(k, value, sites=sites):
                if len(sites[k]) < items:
                    sites[k].append(safe_encode(value))
                return value

            glb["__es_site"] = site
            try:
                eval(compile(probe["record"], "test", "eval"), glb)
            except BaseException as exc:  # noqa: BLE001 - the outcome here is not the verdict; the sites are
                if isinstance(exc, SystemExit):
                    raise
            values.append(["R", sites])
            continue
        try:
            values.append(encode(eval(compile(probe, "test", "eval"), glb)))
        except BaseException as exc:  # noqa: BLE001 - the program's own failure, reported as a value
            values.append(failure(exc))
    write(dumps({"values": values}) + "\n")
    out.flush()


def _replayer(values, test):
    """``__es_replay(i, k)``: the next recorded value of site k of probe i, rebuilt; it raises when the program
    recorded an error there or fewer values than the check asks for."""
    queues = {}
    for i in test["probes"]:
        v = values[i]
        if v[0] == "R":
            if len(v) != 2 or type(v[1]) is not list or any(type(q) is not list for q in v[1]):
                raise ValueError("malformed recording")
            queues[i] = [iter(q) for q in v[1]]

    def replay(i, k):
        item = next(queues[i][k], None)
        if item is None:
            raise ValueError("the program's process recorded fewer values than the check needs")
        if item[0] == "E":
            raise ValueError(item[1])
        return _decode(item)

    return replay


def _verify(cfg, out):
    """The tests' imports, then each test over the decoded values: one boolean per test."""
    glb = {"__name__": "__main__", "__builtins__": builtins}
    for stmt in cfg["imports"]:
        try:
            exec(compile(stmt, "imports", "exec"), glb)
        except BaseException:  # noqa: BLE001 - a missing module, or one that exits on import (unittest.__main__):
            pass  # the tests that need it fail, the others still count
    values = cfg["values"]
    verdicts = []
    for test in cfg["tests"]:
        scope = dict(glb)
        try:
            for i in test["probes"]:
                if values[i][0] == "E":
                    raise ValueError(values[i][1])
                if values[i][0] != "R":
                    scope["__probe_%d" % i] = _decode(values[i])
            scope["__es_replay"] = _replayer(values, test)
            verdicts.append(bool(eval(compile(test["expr"], "test", "eval"), scope)))
        except Exception as exc:  # noqa: BLE001
            sys.stderr.write("test %r: %s: %s\n" % (test["source"][:200], type(exc).__name__, str(exc)[:200]))
            verdicts.append(False)
    out.write(json.dumps({"verdicts": verdicts}) + "\n")
    out.flush()


def _seccomp(program, nr, sock):
    """Install the grader's filter (es_ray/grading/seccomp.py) on this process and its future threads, with a
    listener for the calls it refuses; the listener goes to the init over ``sock`` and is closed here before any
    program code runs (a program holding it could answer its own refused calls)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)

    class Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]

    prog = Prog(len(program) // 8, program)
    if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
        _die(CONFINE_MARK, "no_new_privs: %s" % os.strerror(ctypes.get_errno()))
    listener = libc.syscall(nr, 1, 1 << 3, ctypes.byref(prog))  # SET_MODE_FILTER, FLAG_NEW_LISTENER
    if listener < 0:
        _die(CONFINE_MARK, "seccomp listener: %s" % os.strerror(ctypes.get_errno()))
    import _socket

    try:
        sock.sendmsg([b"L"], [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, listener.to_bytes(4, sys.byteorder))])
    finally:
        os.close(listener)


def _untrusted(cfg, root, result_fd, write_fd, sock):
    """The forked process: the program (or the check) under rlimits, seccomp and the audit hook."""
    os.close(result_fd)
    _rlimits(cfg["limits"])
    if hasattr(sys, "set_int_max_str_digits"):
        sys.set_int_max_str_digits(0)  # a test may print or compare an int of any size (the CPU limit bounds it)
    try:
        if cfg["seccomp"]:  # always, but in the tests that switch one layer off
            _seccomp(bytes.fromhex(cfg["seccomp"]), cfg["seccomp_nr"], sock)
    finally:
        sock.close()
    for name in [m for m in sys.modules if m == "ctypes" or m.startswith(("ctypes.", "_ctypes"))]:
        del sys.modules[name]  # so that `import ctypes` reaches the audit hook
    sys.dont_write_bytecode = True
    if cfg["mark_nonce"]:
        _audit_hook(root, cfg["mark_nonce"])
    (_run if cfg["mode"] == "run" else _verify)(cfg, os.fdopen(write_fd, "w"))


def _vm_peak_kb(child):
    try:
        with open("/proc/%d/status" % child, "rb") as f:
            for line in f:
                if line.startswith(b"VmPeak:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _notification(listener):
    """(system call number, notification id, first argument) of a seccomp notification, or None where the
    notifying thread is already gone."""
    import fcntl

    buf = bytearray(80)  # struct seccomp_notif, zeroed as the kernel requires
    try:
        fcntl.ioctl(listener, 0xC0502100, buf, True)  # SECCOMP_IOCTL_NOTIF_RECV
    except OSError:
        return None
    # id (8), pid and flags (4+4), then seccomp_data: nr (4), arch (4), instruction pointer (8), args (8 each)
    return (
        int.from_bytes(buf[16:20], sys.byteorder, signed=True),
        int.from_bytes(buf[0:8], sys.byteorder),
        int.from_bytes(buf[32:40], sys.byteorder),
    )


def _let_go(listener, nid):
    """Let a notified call (the exit) run as the filter would have allowed it; False where the kernel cannot
    (SECCOMP_USER_NOTIF_FLAG_CONTINUE needs Linux 5.5)."""
    import fcntl

    resp = nid.to_bytes(8, sys.byteorder) + bytes(12) + (1).to_bytes(4, sys.byteorder)  # id, val, error, flags
    try:
        fcntl.ioctl(listener, 0xC0182101, bytearray(resp), True)  # SECCOMP_IOCTL_NOTIF_SEND
    except OSError as exc:
        return exc.errno == 2  # ENOENT: the thread is gone already (the exit goes on)
    return True


def _take(listener, exit_nr):
    """One round on the listener: (refused call number or None, exit status asked for where the exit could not be
    let go). An ``exit_group`` first takes every notification queued before it: a refused call a thread made just
    before the process exits is seen, not withdrawn by the exit."""
    got = _notification(listener)
    if got is None or got[0] != exit_nr:
        return (got[0] if got else None), None
    exits, ready = [got], select.poll()
    ready.register(listener, select.POLLIN)
    while ready.poll(0):
        more = _notification(listener)
        if more is None:
            break
        if more[0] != exit_nr:
            return more[0], None
        exits.append(more)
    if all(_let_go(listener, nid) for _, nid, _ in exits):
        return None, None
    return None, got[2] & 0xFF


def _collect(read_fd, child, cap, listener, exit_nr=None):
    """Read at most ``cap`` bytes of the pipe (the rest is drained and counted) while answering the seccomp
    listener (a refused call: recorded, the program's process killed) and sampling its peak virtual size every
    ``PEAK_SAMPLE_MS``, until the program's process has ended (its pidfd, else a poll of ``wait4``); its wait
    status and rusage."""
    chunks, size, refused, peak, exit_asked = [], 0, None, 0, None
    poller = select.poll()
    poller.register(read_fd, select.POLLIN)
    pipe_open, ended = True, False
    if listener is not None:
        poller.register(listener, select.POLLIN)
    try:
        pidfd = os.pidfd_open(child)
        poller.register(pidfd, select.POLLIN)
    except (AttributeError, OSError):  # Linux < 5.3: poll wait4 instead
        pidfd = None

    def read():
        nonlocal size, pipe_open
        block = os.read(read_fd, 1 << 16)
        if not block:
            poller.unregister(read_fd)
            pipe_open = False
        elif size < cap:
            chunks.append(block[: cap - size])
        size += len(block)

    while not ended and refused is None:
        for fd, ev in poller.poll(PEAK_SAMPLE_MS):
            if fd == read_fd:
                read()
            elif fd == pidfd:
                ended = True
            elif ev & select.POLLIN:
                nr, asked = _take(listener, exit_nr)
                if nr is not None and refused is None:
                    refused = nr
                    os.kill(child, signal.SIGKILL)
                elif asked is not None:  # a kernel without FLAG_CONTINUE: the exit is done here, its status kept
                    exit_asked = asked
                    os.kill(child, signal.SIGKILL)
            else:  # the filter has no process left
                poller.unregister(listener)
        peak = max(peak, _vm_peak_kb(child))
        if pidfd is None and not pipe_open:
            ended = os.waitid(os.P_PID, child, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    while pipe_open:  # what the program wrote before it ended (no writer is left: this ends)
        read()
    _, status, usage = os.wait4(child, 0)
    text = b"".join(chunks).decode("utf-8", errors="replace")
    if exit_asked is not None and refused is None:
        status = exit_asked << 8  # as the kernel would have encoded the exit the init ended for it
    return text, size > cap, status, usage, refused, peak


def _file_at_cap(cap, budget=4096):
    """Whether a file under the working directory (this process's cwd) reached the file-size limit with as many
    bytes written (a file truncated up to it is a hole: no pages, no ``output_limit``): walked
    without recursion and without following links, at most ``budget`` entries (the tmpfs holds fewer inodes)."""
    stack = ["."]
    while stack and budget > 0:
        try:
            with os.scandir(stack.pop()) as it:
                for entry in it:
                    budget -= 1
                    if entry.is_dir(follow_symlinks=False):
                        stack.append(entry.path)
                    elif entry.is_file(follow_symlinks=False):
                        st = entry.stat(follow_symlinks=False)
                        if st.st_size >= cap and st.st_blocks * 512 >= cap:  # written: a tmpfs counts its pages
                            return True
        except OSError:
            continue
    return False


def main():
    try:
        cfg = bounded_loads(sys.stdin.read(), INPUT_DEPTH)
    except ValueError as exc:  # the grader bounds what it sends by the same measure: this is its failure
        _die(CONFINE_MARK, "configuration: %s" % exc)
    # nothing of the grader's reaches the program: the drained stdin pipe becomes /dev/null, the nonce is not in
    # cfg and the forked process clears its copy of the record (what keeps the program from the record is the
    # descriptor it closes; the nonce tells a stale or foreign line)
    null = os.open("/dev/null", os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    result_fd = cfg["result_fd"]
    record = {"nonce": cfg.pop("nonce")}
    # as the PID namespace's init this process gets only the signals it has a handler for from inside: Python's
    # SIGINT handler would let the program end it (kill or pidfd_send_signal on pid 1) before it writes the record
    signal.signal(signal.SIGINT, signal.SIG_DFL)

    def report(**fields):
        os.write(result_fd, (json.dumps(dict(record, **fields)) + "\n").encode())
        os._exit(0)

    try:
        root = _confine(cfg)
        import ctypes

        if ctypes.CDLL(None).prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE 0: the program cannot read this one
            raise OSError("PR_SET_DUMPABLE")
        read_fd, write_fd = os.pipe()
        import _socket  # not socket.py: 10-20 ms of imports per run

        mine, theirs = _socket.socketpair(_socket.AF_UNIX, _socket.SOCK_STREAM)  # the seccomp listener comes back
        child = os.fork()
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - never run the program half-confined
        sys.stderr.write("%s: %s: %s\n" % (CONFINE_MARK, type(exc).__name__, exc))
        report(stage="confine", error="%s: %s" % (type(exc).__name__, str(exc)[:500]))
    if child == 0:
        os.close(read_fd)
        mine.close()
        record.clear()  # the program can walk up to this frame
        try:
            _untrusted(cfg, root, result_fd, write_fd, theirs)
        except SystemExit:
            raise
        except BaseException:  # noqa: BLE001 - the program's own exception: traceback, exit 1
            sys.__excepthook__(*sys.exc_info())  # in C: no import, which the jail may not allow by then
            sys.exit(1)
        sys.exit(0)
    os.close(write_fd)
    theirs.close()
    listener = None
    if cfg["seccomp"]:
        try:
            _, anc, _, _ = mine.recvmsg(1, _socket.CMSG_LEN(4))
            for level, kind, data in anc:
                if level == _socket.SOL_SOCKET and kind == _socket.SCM_RIGHTS and len(data) >= 4:
                    listener = int.from_bytes(data[:4], sys.byteorder)
        except OSError:
            pass
    mine.close()
    lim = cfg["limits"]
    text, over, status, usage, refused, peak = _collect(
        read_fd, child, lim["output_bytes"], listener, cfg.get("exit_nr")
    )
    code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else None
    report(
        stage="done",
        exit=code,
        signal=os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
        result=text,
        over=over,
        refused=refused,
        listener=listener is not None,
        cpu_s=usage.ru_utime + usage.ru_stime,
        peak_kb=max(peak, usage.ru_maxrss),
        file_at_cap=code != 0 and _file_at_cap(lim["output_bytes"]),
    )


if __name__ == "__main__":  # run with -c; the grader imports this file only for _decode
    main()
