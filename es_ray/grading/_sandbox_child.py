"""The sandboxed side of es_ray.grading.sandbox: confine this process, then run a program or check its values.

Run as ``python -I -S -B -c <this file's text>`` inside the namespaces the parent chose; the configuration comes
on stdin, results go to the file descriptor it names (a file the parent opened). Two modes:

* ``run``: the candidate's code, then each probe (an expression of the tests that calls the candidate's code);
  every probe's value is encoded as plain data (exact builtin types only) and written there. This process never
  decides whether a test passed: whatever the program does to this process can change only the values it reports.
* ``verify``: no candidate code. The tests' own imports, then each test with the probes replaced by the decoded
  values; the list of booleans goes back the same way. Decoding builds builtin objects, so a value cannot bring its own
  ``__eq__``.

Confinement, in order (each step only where the parent's configuration says the kernel allows it): rlimits; a
size-limited tmpfs mounted on the working directory and a private /dev/shm (mount namespace); Landlock (reads
only from the interpreter and system directories, writes only in the working directory, no TCP, no signals or
abstract sockets outside this domain); every capability dropped (as root) or the drop to an unprivileged uid; the
audit hook. The parent refuses to grade where none of Landlock or the uid drop is available.
"""

import builtins
import json
import os
import resource
import sys

MARK = "es-ray-sandbox: blocked"
DROP_MARK = "es-ray-sandbox: cannot drop to uid"
CONFINE_MARK = "es-ray-sandbox: cannot confine"
CONFINE_RC = 97
LANDLOCK_FS = (1 << 13, 1 << 14, 1 << 15, 1 << 15, 1 << 16, 1 << 16, 1 << 16)  # handled fs rights by ABI 1..7
READ_RIGHTS = 1 | 4 | 8  # EXECUTE, READ_FILE, READ_DIR
FILE_RIGHTS = 1 | 2 | 4 | (1 << 14) | (1 << 15)  # the rights that apply to a regular file
SYSTEM_DIRS = ("/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin", "/etc/localtime", "/dev/urandom", "/dev/zero")


def _die(mark, why):
    sys.stderr.write("%s: %s\n" % (mark, why))
    sys.stderr.flush()
    os._exit(CONFINE_RC)


def _rlimits(lim):
    cpu = max(1, int(-(-lim["cpu_s"] // 1)))
    for name, soft, hard in (("RLIMIT_CPU", cpu, cpu + 1), ("RLIMIT_AS", lim["memory_mb"] << 20, None),
                             ("RLIMIT_FSIZE", lim["output_bytes"], None), ("RLIMIT_CORE", 0, None),
                             ("RLIMIT_NOFILE", lim["max_open_files"], None),
                             ("RLIMIT_NPROC", lim["max_processes"], None)):
        resource.setrlimit(getattr(resource, name), (soft, soft if hard is None else hard))


def _confine(cfg):
    """Mounts, Landlock and privileges; returns the working directory. Exits (CONFINE_RC) on any failure."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    work = cfg["work"]
    try:  # read before Landlock, which leaves /proc unreadable where there is no PID namespace
        last_cap = int(open("/proc/sys/kernel/cap_last_cap").read())
    except (OSError, ValueError):
        last_cap = 63

    def check(ok, what):
        if not ok:
            _die(CONFINE_MARK, "%s: %s" % (what, os.strerror(ctypes.get_errno())))

    if cfg["mount_ns"]:  # the parent's util-linux unshare made every mount private already
        check(libc.mount(b"tmpfs", work.encode(), b"tmpfs", 0x2 | 0x4,  # nosuid, nodev
                         ("size=%dk,mode=0700" % (cfg["disk_kb"],)).encode()) == 0, "mount tmpfs on " + work)
        check(libc.mount(b"tmpfs", b"/dev/shm", b"tmpfs", 0x2 | 0x4 | 0x8, b"size=64k,mode=1777") == 0,
              "mount tmpfs on /dev/shm")
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
    if os.geteuid() == 0 and cfg["drop_to"] is not None:
        uid = cfg["drop_to"]
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            if os.getresuid() != (uid,) * 3 or os.getresgid() != (uid,) * 3:
                raise OSError("uid/gid are %r/%r after the drop" % (os.getresuid(), os.getresgid()))
        except OSError as exc:  # never run the program as root when the drop was asked for
            _die(DROP_MARK, "%d: %s" % (uid, exc))
    elif os.geteuid() == 0:  # root without capabilities: no mount, no DAC override, no kill, no ptrace
        for cap in range(last_cap + 1):
            libc.prctl(24, cap, 0, 0, 0)  # PR_CAPBSET_DROP: exec cannot regain them
        header = (ctypes.c_uint32 * 2)(0x20080522, 0)
        data = (ctypes.c_uint32 * 6)()
        check(cfg["capset"] is not None and libc.syscall(cfg["capset"], ctypes.byref(header), ctypes.byref(data)) == 0,
              "capset")
    for name in [m for m in sys.modules if m == "ctypes" or m.startswith(("ctypes.", "_ctypes"))]:
        del sys.modules[name]  # so that `import ctypes` reaches the audit hook
    return os.path.realpath(os.getcwd())


def _audit_hook(root):
    """Refuse the common escapes fast and visibly; the kernel layers above are the boundary."""
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
    blocked_prefixes = ("socket.", "ctypes.", "subprocess.", "os.fork", "os.forkpty", "os.system", "os.exec",
                        "os.posix_spawn", "os.spawn", "os.kill", "os.killpg", "signal.pthread_kill",
                        "resource.setrlimit", "resource.prlimit", "gc.get_referrers",
                        "gc.get_referents", "gc.get_objects", "urllib.", "http.client.", "ftplib.", "smtplib.",
                        "poplib.", "imaplib.", "nntplib.", "telnetlib.", "webbrowser.", "pty.")
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
                sys.stderr.write("%s %s\n" % (MARK, event))
            except Exception:
                pass
        raise PermissionError("%s: %s is not allowed" % (MARK, event))

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

    sys.addaudithook(hook)


# -- values as plain data ---------------------------------------------------------------------------------------

_DUNDERS = ("__eq__", "__ne__", "__hash__", "__iter__", "__len__", "__getitem__", "__lt__", "__le__", "__gt__",
            "__ge__", "__bool__", "__contains__")


def _encode(v, depth=0, budget=None):
    """Exact builtin types (and the collections/iterator types tests compare against) as tagged JSON."""
    import collections
    import itertools
    budget = budget if budget is not None else [200000]
    budget[0] -= 1
    if depth > 64 or budget[0] < 0:
        raise ValueError("value too deep or too large")
    t, enc = type(v), (lambda x: _encode(x, depth + 1, budget))
    if v is None:
        return ["n"]
    if t in (bool, str):
        return ["b" if t is bool else "s", v]
    if t is int:
        return ["i", str(v)]
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
        return ["Frac", str(v.numerator), str(v.denominator)]
    if issubclass(t, tuple) and not any(d in vars(k) for k in t.__mro__[:-2] for d in _DUNDERS):
        return ["t", [enc(x) for x in tuple.__iter__(v)]]  # a namedtuple compares as a tuple
    if t.__module__ in ("builtins", "itertools") and hasattr(t, "__next__"):  # generators, map, zip, ...
        items = list(itertools.islice(v, 100001))
        if len(items) > 100000:
            raise ValueError("iterator longer than 100000 items")
        return ["I", [enc(x) for x in items]]
    raise TypeError("a test value of type %s.%s cannot be compared outside the program" % (t.__module__,
                                                                                        t.__qualname__))


def _decode(x, depth=0):
    import collections
    if depth > 70 or type(x) is not list or not x or type(x[0]) is not str:
        raise ValueError("malformed value")
    tag, args, dec = x[0], x[1:], (lambda y: _decode(y, depth + 1))
    scalar = {"n": lambda: None, "b": lambda: bool(args[0]) if type(args[0]) is bool else None,
              "s": lambda: args[0] if type(args[0]) is str else None, "i": lambda: int(args[0]),
              "f": lambda: float(args[0]), "c": lambda: complex(float(args[0]), float(args[1])),
              "y": lambda: bytes.fromhex(args[0]), "Y": lambda: bytearray.fromhex(args[0]),
              "r": lambda: range(int(args[0]), int(args[1]), int(args[2])),
              "Dec": lambda: __import__("decimal").Decimal(args[0]),  # imported only when used: fractions costs 40 ms
              "Frac": lambda: __import__("fractions").Fraction(int(args[0]), int(args[1]))}
    if tag in scalar:
        out = scalar[tag]()
        if out is None and tag != "n":
            raise ValueError("malformed value")
        return out
    if type(args[0]) is not list:
        raise ValueError("malformed value")
    seqs = {"l": list, "t": tuple, "S": set, "F": frozenset, "Q": collections.deque, "I": lambda xs: iter(list(xs)),
            "dict_keys": lambda xs: dict.fromkeys(xs).keys(),
            "dict_values": lambda xs: dict(enumerate(xs)).values()}
    if tag in seqs:
        return seqs[tag](dec(y) for y in args[0])
    maps = {"d": dict, "C": lambda kv: collections.Counter(dict(kv)), "O": collections.OrderedDict,
            "D": lambda kv: collections.defaultdict(None, kv), "dict_items": lambda kv: dict(kv).items()}
    if tag in maps:
        pairs = [(dec(k), dec(v)) for k, v in args[0]]
        return maps[tag](pairs)
    raise ValueError("unknown value tag")


# -- the two modes ----------------------------------------------------------------------------------------------

def _run(cfg, out):
    """The candidate's code, then its probes; only values leave this process."""
    encode, dumps, write = _encode, json.dumps, out.write
    glb = {"__name__": "__main__", "__builtins__": builtins}
    exec(compile(cfg["program"], "program.py", "exec"), glb)
    values = []
    for src in cfg["probes"]:
        try:
            values.append(encode(eval(compile(src, "test", "eval"), glb)))
        except BaseException as exc:  # noqa: BLE001 - the program's own failure, reported as a value
            if isinstance(exc, SystemExit):
                raise
            values.append(["E", "%s: %s" % (type(exc).__name__, str(exc)[:200])])
    write(dumps({"values": values}) + "\n")
    out.flush()


def _verify(cfg, out):
    """The tests' imports, then each test over the decoded values: one boolean per test."""
    glb = {"__name__": "__main__", "__builtins__": builtins}
    for stmt in cfg["imports"]:
        try:
            exec(compile(stmt, "imports", "exec"), glb)
        except Exception:  # noqa: BLE001 - a test that needs a missing module fails, the others still count
            pass
    values = cfg["values"]
    verdicts = []
    for test in cfg["tests"]:
        scope = dict(glb)
        try:
            for i in test["probes"]:
                if values[i][0] == "E":
                    raise ValueError(values[i][1])
                scope["__probe_%d" % i] = _decode(values[i])
            verdicts.append(bool(eval(compile(test["expr"], "test", "eval"), scope)))
        except Exception as exc:  # noqa: BLE001
            sys.stderr.write("test %r: %s: %s\n" % (test["source"][:200], type(exc).__name__, str(exc)[:200]))
            verdicts.append(False)
    out.write(json.dumps({"verdicts": verdicts}) + "\n")
    out.flush()


def _reap(child):
    """As init of the namespace: wait for the program, pass on how it ended (128 + signal when killed)."""
    if child == 0:
        return
    while True:
        pid, status = os.wait()
        if pid == child:
            os._exit(128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status))


def main():
    cfg = json.loads(sys.stdin.read())
    sys.stdin.close()
    if os.getpid() == 1:  # the PID namespace's init ignores signals it has no handler for: SIGXCPU among them
        _reap(os.fork())
    out = os.fdopen(cfg["result_fd"], "w")
    _rlimits(cfg["limits"])
    try:
        root = _confine(cfg)
    except Exception as exc:  # noqa: BLE001 - never run the program half-confined
        _die(CONFINE_MARK, "%s: %s" % (type(exc).__name__, exc))
    sys.dont_write_bytecode = True
    _audit_hook(root)
    (_run if cfg["mode"] == "run" else _verify)(cfg, out)


if __name__ == "__main__":  # run with -c; the grader imports this file only for _decode
    main()
