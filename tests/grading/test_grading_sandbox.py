"""The code sandbox holds: hostile programs score 0 within their limit and the grader keeps working afterwards."""

from __future__ import annotations

import dataclasses
import os
import resource
import signal
import socket
import subprocess
import sys
import sysconfig
import threading
import time
import uuid
from pathlib import Path

import pytest

from es_ray.grading.code import build_program, extract_code, grade_programs
import es_ray.grading.sandbox as sandbox
from es_ray.grading.sandbox import (
    BLOCKED_MARK,
    SandboxLimits,
    SandboxUnavailable,
    isolation,
    network_isolation,
    run_many,
    run_python,
    sandbox_plan,
)
from paths import FIXTURES

LIMITS = SandboxLimits(wall_s=5.0, cpu_s=2.0, memory_mb=512, output_bytes=64 << 10)
GOOD = "def add(a, b):\n    return a + b\n\nassert add(1, 2) == 3\n"


def assert_still_works():
    res = run_python(GOOD, LIMITS)
    assert res.passed, res


def test_a_correct_program_passes_and_a_wrong_one_fails():
    assert run_python(GOOD, LIMITS).status == "passed"
    res = run_python("assert 1 + 1 == 3\n", LIMITS)
    assert res.status == "failed" and "AssertionError" in res.stderr
    res = run_python("print('hello')\n", LIMITS)
    assert res.passed and res.stdout.strip() == "hello"  # the harness token is not shown


def test_infinite_loop_is_stopped_by_the_cpu_limit():
    """RLIMIT_CPU counts CPU seconds: on a loaded machine (load 22 on these 2 cores) the loop gets a fraction of a
    core and its 2 CPU seconds take 10-12 s of wall time, so a wall-time bound of cpu_s + 3 failed there while
    the sandbox did what it should. What shows the CPU limit stopped it is the signal (SIGXCPU, not the wall
    clock's SIGKILL) and the CPU time the sandbox used, whatever the load; the wall limit is set out of its way."""
    limits = dataclasses.replace(LIMITS, wall_s=60.0)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    res = run_python("while True:\n    pass\n", limits)
    elapsed = time.monotonic() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    assert res.status == "timeout" and res.returncode == -signal.SIGXCPU, res
    # its CPU budget, plus the start-up's (rusage samples CPU time by ticks: 1.96 s seen for a 2 s limit)
    assert 0.9 * limits.cpu_s <= cpu < limits.cpu_s + 1.5, cpu
    assert elapsed < limits.wall_s
    assert_still_works()


def test_sleeping_forever_is_stopped_by_the_wall_clock():
    limits = SandboxLimits(wall_s=1.5, cpu_s=5.0)
    t0 = time.monotonic()
    res = run_python("import time\ntime.sleep(1000)\n", limits)
    assert res.status == "timeout"
    assert time.monotonic() - t0 < limits.wall_s + 2
    assert_still_works()


def test_fork_bomb_scores_zero_and_leaves_no_process():
    marker = f"es-ray-fork-{uuid.uuid4().hex}"
    program = f"import os\nMARK = {marker!r}\nwhile True:\n    os.fork()\n"
    t0 = time.monotonic()
    res = run_python(program, LIMITS)
    assert res.status in ("blocked", "timeout", "failed") and not res.passed
    assert time.monotonic() - t0 < LIMITS.wall_s + 2
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert marker not in ps
    # every other way to start a process is refused too
    for code in (
        "import subprocess\nsubprocess.run(['true'])\n",
        "import os\nos.system('true')\n",
        "import os\nos.execv('/bin/true', ['true'])\n",
        "import pty\npty.fork()\n",
        "import multiprocessing\nmultiprocessing.Process(target=print).start()\n",
        "import os\nos.posix_spawn('/bin/true', ['true'], {})\n",
        "import ctypes\n",
    ):
        res = run_python(code, LIMITS)
        # refused by the hook (its mark), counted as the program's failure: the kind is never read from stderr
        assert res.status == "failed" and BLOCKED_MARK in res.stderr, (code, res)
    assert_still_works()


def test_unbounded_allocation_hits_the_memory_limit():
    t0 = time.monotonic()
    res = run_python("chunks = []\nwhile True:\n    chunks.append(bytearray(10 ** 7))\n", LIMITS)
    assert res.status == "memory", res
    assert time.monotonic() - t0 < LIMITS.wall_s
    # refused whole at once: no counter of the jail's saw its memory grow, so it is the program's own failure (its
    # MemoryError is words on its stderr, which the kind is never read from)
    res = run_python("x = ' ' * (10 ** 12)\n", LIMITS)
    assert res.status == "failed" and res.reason == "exit 1" and "MemoryError" in res.stderr, res
    assert_still_works()


@pytest.fixture
def tcp_server():
    """A listening socket on loopback that records whether anyone connected."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    srv.settimeout(0.2)
    hits: list[bytes] = []
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                continue
            with conn:
                conn.settimeout(1)
                try:
                    hits.append(conn.recv(100) or b"<connected>")
                except OSError:
                    hits.append(b"<connected>")

    th = threading.Thread(target=serve, daemon=True)
    th.start()
    yield srv.getsockname()[1], hits
    stop.set()
    th.join(2)
    srv.close()


def test_network_connection_is_refused(tcp_server):
    port, hits = tcp_server
    # the server works from outside the sandbox
    with socket.create_connection(("127.0.0.1", port), timeout=2) as c:
        c.sendall(b"probe")
    deadline = time.monotonic() + 2
    while not hits and time.monotonic() < deadline:
        time.sleep(0.05)
    assert hits == [b"probe"]
    hits.clear()
    program = f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\ns.sendall(b'escaped')\n"
    res = run_python(program, LIMITS)
    assert res.status == "failed" and BLOCKED_MARK in res.stderr and not res.passed
    res = run_python("import urllib.request\nurllib.request.urlopen('http://127.0.0.1:%d/')\n" % port, LIMITS)
    assert not res.passed
    time.sleep(0.3)
    assert hits == []
    assert_still_works()


@pytest.mark.skipif(not network_isolation(), reason="unshare is not permitted on this machine")
def test_network_namespace_blocks_connections_without_the_audit_hook(tcp_server):
    """The kernel layer on its own: plain Python (no hook) inside the namespace cannot reach the host's loopback."""
    port, hits = tcp_server
    code = (
        f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=2).sendall(b'x')\n"
        "    print('connected')\nexcept OSError as e:\n    print('refused', e)\n"
    )
    out = subprocess.run(
        [*network_isolation(), sys.executable, "-c", code], capture_output=True, text=True, timeout=30
    ).stdout
    assert out.startswith("refused"), out
    assert hits == []


def test_writing_outside_the_working_directory_is_refused(tmp_path):
    target = tmp_path / f"escape-{uuid.uuid4().hex}.txt"
    os.chmod(tmp_path, 0o777)  # even a world-writable directory
    for code in (
        f"open({str(target)!r}, 'w').write('x')\n",
        f"import os\nfd = os.open({str(target)!r}, os.O_WRONLY | os.O_CREAT)\nos.write(fd, b'x')\n",
        f"import pathlib\npathlib.Path({str(target)!r}).write_text('x')\n",
        f"import os\nos.symlink('/etc/passwd', {str(target)!r})\n",
        f"import shutil\nopen('src', 'w').write('x')\nshutil.copy('src', {str(target)!r})\n",
        "import os\nos.chdir('/tmp')\nopen('es-ray-escape.txt', 'w').write('x')\n",
    ):
        res = run_python(code, LIMITS)
        assert res.status == "failed" and BLOCKED_MARK in res.stderr, (code, res)
        assert not target.exists() and not target.is_symlink()
    assert not Path("/tmp/es-ray-escape.txt").exists()
    victim = tmp_path / "victim.txt"
    victim.write_text("keep")
    for code in (
        f"import os\nos.remove({str(victim)!r})\n",
        f"import os\nos.rename({str(victim)!r}, 'x')\n",
        f"import os\nos.chmod({str(victim)!r}, 0o777)\n",
        f"import shutil\nshutil.rmtree({str(tmp_path)!r})\n",
    ):
        res = run_python(code, LIMITS)
        assert res.status == "failed" and BLOCKED_MARK in res.stderr, (code, res)
        assert victim.read_text() == "keep"
    assert_still_works()


def test_its_own_directory_is_fresh_and_writable():
    code = (
        "import os, tempfile\nassert os.listdir('.') == []\nopen('a.txt', 'w').write('x')\n"
        "assert open('a.txt').read() == 'x'\nos.mkdir('d')\nos.rename('a.txt', 'd/b.txt')\n"
        "with tempfile.NamedTemporaryFile('w') as f:\n    f.write('y')\nprint(os.getcwd())\n"
    )
    first, second = run_python(code, LIMITS), run_python(code, LIMITS)
    assert first.passed and second.passed, (first, second)
    assert first.stdout != second.stdout  # a new directory every run
    assert not Path(first.stdout.strip()).exists()  # and removed afterwards


def test_output_is_capped():
    res = run_python("while True:\n    print('x' * 1000)\n", LIMITS)
    assert res.status == "output_limit"
    assert len(res.stdout) <= LIMITS.output_bytes
    assert_still_works()


def test_exiting_early_does_not_pass():
    for code in (
        "import sys\nsys.exit(0)\nassert False\n",
        "import os\nos._exit(0)\nassert False\n",
        "import sys\nsys.exit()\nassert False\n",
        "raise SystemExit\nassert False\n",
    ):
        res = run_python(code, LIMITS)
        assert res.returncode == 0 and not res.passed, (code, res)


def test_many_programs_run_concurrently_and_independently():
    programs = [GOOD, "while True:\n    pass\n", "assert False\n", GOOD, "import os\nos.fork()\n"]
    results = run_many(programs, LIMITS, workers=3)
    assert [r.status for r in results] == ["passed", "timeout", "failed", "passed", "failed"]
    assert BLOCKED_MARK in results[4].stderr, results[4]


def test_isolation_reports_its_layers():
    info = isolation()
    assert "audit hook" in info["network"]
    assert set(info) == {"refused", "syscalls", "network", "user", "limits", "filesystem", "signals", "verdict"}
    assert "seccomp" in info["syscalls"] and "minimal read-only root" in info["filesystem"]
    assert info["refused"] is None  # CI machines (root, Landlock or a working drop) must grade


def test_as_root_the_program_runs_as_a_dedicated_uid_without_capabilities():
    """As root the program never keeps uid 0: it runs as one of the dedicated uids, with every capability gone
    (bounding set included), inside the seccomp filter."""
    if os.geteuid() != 0 or "-r" in sandbox.namespaces():
        pytest.skip("needs real root")
    code = (
        "import os\nprint(*os.getresuid(), *os.getresgid())\nfor line in open('/proc/self/status'):\n"
        "    if line.startswith(('CapEff', 'CapBnd', 'Seccomp:', 'NoNewPrivs')):\n        print(line.split()[1])\n"
    )
    res = run_python(code, LIMITS)
    assert res.passed, res
    ids = res.stdout.split()[:6]
    assert len(set(ids)) == 1 and sandbox.UID_BASE <= int(ids[0]) < sandbox.UID_BASE + sandbox.UID_SLOTS, res
    assert res.stdout.split()[6:] == ["0" * 16, "0" * 16, "1", "2"], res  # CapEff, CapBnd, NoNewPrivs, Seccomp
    assert "dedicated uid" in isolation()["user"]


def test_concurrent_programs_get_different_uids():
    code = "import os, time\ntime.sleep(0.5)\nprint(os.getuid())\n"
    uids = [r.stdout.strip() for r in run_many([code] * 3, LIMITS, workers=3)]
    if os.geteuid() == 0 and "-r" not in sandbox.namespaces():
        assert len(set(uids)) == 3 and "0" not in uids, uids


@pytest.fixture
def no_landlock(monkeypatch):
    """This machine as one without Landlock: the jail, seccomp and the uid drop remain."""
    monkeypatch.setattr(sandbox, "landlock_abi", lambda: 0)
    sandbox.sandbox_plan.cache_clear()
    yield
    sandbox.sandbox_plan.cache_clear()


@pytest.fixture
def no_namespaces(monkeypatch):
    """This machine as one where unshare is not permitted (a container with the default seccomp profile)."""
    monkeypatch.setattr(sandbox, "namespaces", lambda: ())
    sandbox.sandbox_plan.cache_clear()
    yield
    sandbox.sandbox_plan.cache_clear()


def test_without_landlock_the_jail_still_holds(no_landlock, tmp_path):
    os.chmod(tmp_path, 0o777)
    target = tmp_path / "escape"
    res = run_python(f"import os\nprint(os.path.exists({str(tmp_path)!r}))\nopen('/etc/es-ray-x', 'a')\n", LIMITS)
    assert res.stdout.split()[:1] == ["False"] and not res.passed, res  # the host's directories do not exist
    res = run_python(f"open({str(target)!r}, 'w')\n", LIMITS)
    assert not res.passed and not target.exists()
    assert run_python(GOOD, LIMITS).passed


@pytest.mark.skipif(
    os.geteuid() != 0 or subprocess.run(["unshare", "-r", "true"], capture_output=True).returncode,
    reason="needs root and unshare -r",
)
def test_a_failed_drop_refuses_to_grade(tmp_path):
    """An interpreter that runs as root of its own user namespace (which owns neither the mount namespace nor any
    other uid): the confinement fails before any program runs, and grading refuses, naming what to set up."""
    wrapper = tmp_path / "python"
    wrapper.write_text(f'#!/bin/sh\nexec unshare -r {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    plan = sandbox_plan(str(wrapper))
    assert plan.refused and "did not run confined here: es-ray-sandbox: cannot confine" in plan.refused, plan
    assert isolation(str(wrapper))["refused"] == plan.refused
    with pytest.raises(SandboxUnavailable, match="unprivileged_userns_clone"):
        run_python("print('ran')\n", LIMITS, python=str(wrapper))


def test_without_namespaces_grading_refuses(no_namespaces):
    with pytest.raises(SandboxUnavailable, match="no namespaces: unshare is not permitted"):
        run_many([GOOD, GOOD], LIMITS)


# -- hostile programs: one per reward hack found in review ---------------------------------------------------------


def test_frame_walking_finds_no_pass_signal():
    """Everything the harness holds is readable from the program's frames; none of it makes a test pass: exiting
    0 after forging a result line, or after reading every frame, still fails an unknown-answer test."""
    walk = (
        "import sys, os\nf = sys._getframe()\nseen = []\nwhile f is not None:\n"
        "    seen += [v for v in f.f_locals.values() if isinstance(v, str) and len(v) == 32]\n"
        "    f = f.f_back\nprint('\\n'.join(seen))\nsys.stdout.flush()\n"
    )  # what beat the old token check
    forge = (
        "import sys, os, json\nf = sys._getframe()\nwhile f is not None:\n    cfg = f.f_locals.get('cfg')\n"
        "    if isinstance(cfg, dict) and 'result_fd' in cfg:\n        fd = cfg['result_fd']\n"
        "        os.write(fd, (json.dumps({'values': [['b', True]] * len(cfg['probes']),"
        " 'verdicts': [True] * 9}) + '\\n').encode())\n        os._exit(0)\n    f = f.f_back\n"
    )
    tests = "assert secret_answer(7) == 1234567\nassert secret_answer(8) == 7654321\n"
    wrong = "def secret_answer(x):\n    return 0\n"
    for code in (walk + "os._exit(0)\n" + tests, forge + tests, forge + wrong + tests):
        res = run_python(code, LIMITS)
        assert not res.passed, (code, res)
    assert_still_works()


def test_an_object_equal_to_everything_fails():
    for ret in (
        "type('A', (), {'__eq__': lambda s, o: True, '__hash__': lambda s: 0})()",
        "type('L', (list,), {'__eq__': lambda s, o: True})()",  # a builtin subclass with its own __eq__
        "type('T', (tuple,), {'__iter__': lambda s: iter((1, 2))})()",
        "float('nan')",
    ):
        code = f"def f(x):\n    return {ret}\nassert f(1) == (1, 2)\n"
        res = run_python(code, LIMITS)
        assert res.status == "failed", (ret, res)
    # the comparison is done apart: monkeypatching it in the program changes nothing
    res = run_python(
        "import math\nmath.isclose = lambda *a, **k: True\nimport builtins\nbuiltins.sorted = lambda x: "
        "[1, 2]\ndef f():\n    return 9.0\nassert math.isclose(f(), 1.0)\n",
        LIMITS,
    )
    assert res.status == "failed"
    set_test, isclose_test = "assert set(f(1)) == set([1, 2])\n", "assert math.isclose(f(1)[0], 1.5)\n"
    for rebind, test in (
        ("from operator import truth as set\n", set_test),
        ("import operator as set\n", set_test),
        ("import types\nmath = types.SimpleNamespace(isclose=lambda *a, **k: True)\n", isclose_test),
        ("class math:\n    isclose = staticmethod(lambda *a, **k: True)\n", isclose_test),
    ):
        res = run_python(rebind + "def f(x):\n    return [9]\n" + test, LIMITS)
        assert res.status == "failed", (rebind, res)
    res = run_python(
        "def f():\n    return [2, 1]\nimport builtins\nbuiltins.sorted = lambda x: [7]\nassert sorted(f()) == [1, 2]\n",
        LIMITS,
    )
    assert res.passed, res
    # values the tests legitimately compare against cross faithfully
    res = run_python(
        "import collections\ndef f():\n    return collections.Counter('aab')\ndef g():\n"
        "    return map(int, '12')\ndef h():\n    return collections.namedtuple('P', 'x y')(1, 2)\n"
        "assert f() == {'a': 2, 'b': 1}\nassert list(g()) == [1, 2]\nassert h() == (1, 2)\n"
        "assert g() != [1, 2]\nassert isinstance(f(), dict)\n",
        LIMITS,
    )
    assert res.passed, res
    res = run_python(
        "class P:\n    def __init__(s, a):\n        s.x = a\n    def twice(s):\n        return 2 * s.x\n"
        "assert P(1).x == 1\nassert P(2).twice() == 4\nassert [P(3).x][0] == 3\n",
        LIMITS,
    )
    assert res.passed, res  # a program's object never crosses; its attributes and methods' results do


def test_dir_fd_writes_outside_are_refused_by_the_kernel(tmp_path):
    """os.open(..., dir_fd=) passes the audit hook's path check (the path is relative); the kernel refuses it."""
    if not sandbox_plan().landlock and sandbox_plan().drop_to is None:
        pytest.skip("needs Landlock or the uid drop")
    os.chmod(tmp_path, 0o777)
    purelib = Path(sysconfig.get_paths()["purelib"])
    code = (
        f"import os\nfor d, name in (({str(tmp_path)!r}, 'escape.txt'), ({str(purelib)!r}, 'es_ray_evil.pth'),"
        f" ({str(purelib)!r}, 'es_ray_evil/__init__.py')):\n"
        "    try:\n        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)\n"
        "        if '/' in name:\n            os.mkdir(name.split('/')[0], dir_fd=fd)\n"
        "        w = os.open(name, os.O_WRONLY | os.O_CREAT, dir_fd=fd)\n        os.write(w, b'import os')\n"
        "        print('wrote', name)\n    except OSError as e:\n        print('refused', name, e.errno)\n"
    )
    res = run_python(code, LIMITS)
    assert "wrote" not in res.stdout and res.stdout.count("refused") == 3, res
    assert not (tmp_path / "escape.txt").exists()
    assert not (purelib / "es_ray_evil.pth").exists() and not (purelib / "es_ray_evil").exists()


def test_site_packages_and_project_files_are_not_writable():
    purelib = Path(sysconfig.get_paths()["purelib"])
    init = Path(sandbox.__file__).parent / "__init__.py"
    before = init.read_bytes()
    for target in (purelib / "es_ray_evil.pth", init):
        res = run_python(f"open({str(target)!r}, 'a').write('import os')\n", LIMITS)
        assert not res.passed, res
    assert not (purelib / "es_ray_evil.pth").exists() and init.read_bytes() == before


def test_signals_cannot_reach_the_grader():
    got = []
    old = signal.signal(signal.SIGUSR1, lambda *a: got.append(a))
    try:
        me = os.getpid()
        code = (
            "import os, signal\nout = []\nfor pid in (%d, os.getppid(), 1):\n    try:\n"
            "        fd = os.pidfd_open(pid)\n        signal.pidfd_send_signal(fd, signal.SIGUSR1)\n"
            "        out.append('sent %%d' %% pid)\n    except OSError as e:\n        out.append('no %%d' %% pid)\n"
            "print(out)\n" % me
        )
        res = run_python(code, LIMITS)
        time.sleep(0.3)
        assert got == [], res
        assert "sent %d" % me not in res.stdout
    finally:
        signal.signal(signal.SIGUSR1, old)


def test_the_graders_environment_and_proc_are_out_of_sight(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_es_ray_test_secret")
    me = os.getpid()
    code = (
        "import os\nprint(dict(os.environ))\nfor p in ('/proc/%d/environ', '/proc/%d/cmdline', "
        "'/proc/' + str(os.getppid()) + '/environ', '/proc/1/environ'):\n    try:\n"
        "        print(open(p, 'rb').read())\n    except OSError as e:\n        print('no', p)\n"
        "print(sorted(os.listdir('/proc'))[:5])\n" % (me, me)
    )
    res = run_python(code, LIMITS)
    assert "hf_es_ray_test_secret" not in res.stdout + res.stderr
    assert set(eval(res.stdout.splitlines()[0])) <= {"PATH", "HOME", "TMPDIR", "LANG", "PYTHONHASHSEED", "LC_CTYPE"}


def test_no_leftovers_in_dev_shm_and_a_disk_quota():
    name = f"es-ray-{uuid.uuid4().hex}"
    code = (
        f"try:\n    open('/dev/shm/{name}', 'wb').write(b'x' * (1 << 20))\nexcept OSError as e:\n"
        "    print('refused', e.errno)\nfrom multiprocessing import shared_memory\ntry:\n"
        f"    shared_memory.SharedMemory(name='{name}b', create=True, size=1 << 20)\nexcept Exception as e:\n"
        "    print('refused', type(e).__name__)\n"
    )
    run_python(code, LIMITS)
    assert not [p for p in Path("/dev/shm").iterdir() if p.name.startswith(name)]
    if not sandbox_plan().mount_ns:
        pytest.skip("the disk quota needs a mount namespace")
    fill = (
        "import errno\nn = 0\ntry:\n    for i in range(100):\n        open('f%d' % i, 'wb').write(b'x' * 60000)\n"
        "        n += 1\nexcept OSError as e:\n    print('full', n, e.errno == errno.ENOSPC)\n"
    )
    res = run_python(fill, SandboxLimits(wall_s=5.0, cpu_s=2.0, disk_mb=1, output_bytes=64 << 10))
    assert res.stdout.split()[:1] == ["full"] and res.stdout.split()[2] == "True", res
    assert int(res.stdout.split()[1]) < 20


@pytest.mark.parametrize("layers", ["all", "no landlock"])
def test_each_kernel_layer_holds_on_its_own(layers, tmp_path, monkeypatch):
    """The jail, the PID namespace and seccomp without Landlock (an older kernel) hold the same attacks."""
    if layers == "no landlock":
        monkeypatch.setattr(sandbox, "landlock_abi", lambda: 0)
    os.chmod(tmp_path, 0o777)  # even a world-writable directory
    sandbox.sandbox_plan.cache_clear()
    monkeypatch.setenv("HF_TOKEN", "hf_es_ray_layer_secret")
    got = []
    old = signal.signal(signal.SIGUSR1, lambda *a: got.append(a))
    shm = f"es-ray-{uuid.uuid4().hex}"
    attack = (
        f"import os, signal\nout = []\ntry:\n    fd = os.open({str(tmp_path)!r}, os.O_RDONLY | os.O_DIRECTORY)\n"
        "    os.close(os.open('escape', os.O_WRONLY | os.O_CREAT, dir_fd=fd))\n    out.append('wrote')\n"
        "except OSError:\n    pass\ntry:\n"
        f"    if b'hf_es_ray' in open('/proc/{os.getpid()}/environ', 'rb').read():\n"
        "        out.append('secret')\n"
        f"except OSError:\n    pass\ntry:\n    signal.pidfd_send_signal(os.pidfd_open({os.getpid()}), "
        "signal.SIGUSR1)\n    out.append('signalled')\nexcept OSError:\n    pass\n"
        f"try:\n    os.close(os.open('/dev/shm/{shm}', os.O_WRONLY | os.O_CREAT))\nexcept OSError:\n    pass\n"
        "print(out)\n"
    )
    try:
        res = run_python(attack, LIMITS)
        time.sleep(0.3)
    finally:
        signal.signal(signal.SIGUSR1, old)
        sandbox.sandbox_plan.cache_clear()
    assert res.passed and res.stdout.strip() == "[]", res
    assert got == [] and not (tmp_path / "escape").exists() and not Path(f"/dev/shm/{shm}").exists()


# -- MBPP program assembly ------------------------------------------------------------------------------------


def test_extract_code_prefers_a_python_block_with_a_definition():
    text = "Here:\n```\npip install x\n```\n```python\ndef f(x):\n    return x\n```\nDone."
    assert extract_code(text) == "def f(x):\n    return x"
    assert extract_code("```py\ndef g():\n    pass\n```") == "def g():\n    pass"
    assert extract_code("def h():\n    return 1") == "def h():\n    return 1"
    assert extract_code("```python\ndef cut_off(x):\n    return") == "def cut_off(x):\n    return"  # truncated


def test_grade_programs_scores_and_counts_failures():
    tests = ["assert add(1, 2) == 3", "assert add(0, 0) == 0"]
    programs = [
        build_program("def add(a, b):\n    return a + b", tests),
        build_program("def add(a, b):\n    return a - b", tests),
        build_program("def add(a, b):\n    while True:\n        pass", tests),
        build_program("import socket\nsocket.socket()\ndef add(a, b):\n    return a + b", tests),
        build_program("def f():\n    return heapq.nsmallest(1, [3, 1])[0]", ["assert f() == 1"], "import heapq"),
    ]
    grades = grade_programs(programs, LIMITS, workers=2)
    assert [(g.score, g.correct, g.failure) for g in grades] == [
        (1.0, True, None),
        (0.0, False, None),
        (0.0, False, "timeout"),
        (0.0, False, None),
        (1.0, True, None),
    ]


def test_mbpp_refuses_to_load_where_programs_cannot_be_confined(no_namespaces):
    from es_ray.core.config import TaskConfig
    from es_ray.tasks import load_task
    from es_ray.tasks.base import TaskLoadError

    fixture = FIXTURES / "mbpp.jsonl"
    with pytest.raises(TaskLoadError, match="task mbpp: the MBPP code sandbox cannot confine programs here"):
        load_task(TaskConfig(name="mbpp", path=str(fixture), eval_size=0))
