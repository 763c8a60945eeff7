"""The code sandbox holds: hostile programs score 0 within their limit and the grader keeps working afterwards."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from es_ray.grading.code import build_program, extract_code, grade_programs
from es_ray.grading.sandbox import (DROP_FAILED_RC, NOBODY, SandboxLimits, _launch, drop_to_uid, isolation,
                                    network_isolation, run_many, run_python)

LIMITS = SandboxLimits(wall_s=5.0, cpu_s=2.0, memory_mb=512, output_bytes=64 << 10)
GOOD = "def add(a, b):\n    return a + b\n\nassert add(1, 2) == 3\n"
SYSTEM_PYTHON = "/usr/bin/python3"


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
    t0 = time.monotonic()
    res = run_python("while True:\n    pass\n", LIMITS)
    assert res.status == "timeout"
    assert time.monotonic() - t0 < LIMITS.cpu_s + 3
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
    for code in ("import subprocess\nsubprocess.run(['true'])\n", "import os\nos.system('true')\n",
                 "import os\nos.execv('/bin/true', ['true'])\n", "import pty\npty.fork()\n",
                 "import multiprocessing\nmultiprocessing.Process(target=print).start()\n",
                 "import os\nos.posix_spawn('/bin/true', ['true'], {})\n", "import ctypes\n"):
        res = run_python(code, LIMITS)
        assert res.status == "blocked", (code, res)
    assert_still_works()


def test_unbounded_allocation_hits_the_memory_limit():
    t0 = time.monotonic()
    res = run_python("chunks = []\nwhile True:\n    chunks.append(bytearray(10 ** 7))\n", LIMITS)
    assert res.status == "memory", res
    assert time.monotonic() - t0 < LIMITS.wall_s
    res = run_python("x = ' ' * (10 ** 12)\n", LIMITS)
    assert res.status == "memory"
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
    program = (f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
               "s.sendall(b'escaped')\n")
    res = run_python(program, LIMITS)
    assert res.status == "blocked" and not res.passed
    res = run_python("import urllib.request\nurllib.request.urlopen('http://127.0.0.1:%d/')\n" % port, LIMITS)
    assert not res.passed
    time.sleep(0.3)
    assert hits == []
    assert_still_works()


@pytest.mark.skipif(not network_isolation(), reason="unshare is not permitted on this machine")
def test_network_namespace_blocks_connections_without_the_audit_hook(tcp_server):
    """The kernel layer on its own: plain Python (no hook) inside the namespace cannot reach the host's loopback."""
    port, hits = tcp_server
    code = (f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=2).sendall(b'x')\n"
            "    print('connected')\nexcept OSError as e:\n    print('refused', e)\n")
    out = subprocess.run([*network_isolation(), sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=30).stdout
    assert out.startswith("refused"), out
    assert hits == []


def test_writing_outside_the_working_directory_is_refused(tmp_path):
    target = tmp_path / f"escape-{uuid.uuid4().hex}.txt"
    os.chmod(tmp_path, 0o777)  # even a world-writable directory
    for code in (f"open({str(target)!r}, 'w').write('x')\n",
                 f"import os\nfd = os.open({str(target)!r}, os.O_WRONLY | os.O_CREAT)\nos.write(fd, b'x')\n",
                 f"import pathlib\npathlib.Path({str(target)!r}).write_text('x')\n",
                 f"import os\nos.symlink('/etc/passwd', {str(target)!r})\n",
                 f"import shutil\nshutil.copy('/etc/passwd', {str(target)!r})\n",
                 "import os\nos.chdir('/tmp')\nopen('es-ray-escape.txt', 'w').write('x')\n"):
        res = run_python(code, LIMITS)
        assert res.status == "blocked", (code, res)
        assert not target.exists() and not target.is_symlink()
    assert not Path("/tmp/es-ray-escape.txt").exists()
    victim = tmp_path / "victim.txt"
    victim.write_text("keep")
    for code in (f"import os\nos.remove({str(victim)!r})\n", f"import os\nos.rename({str(victim)!r}, 'x')\n",
                 f"import os\nos.chmod({str(victim)!r}, 0o777)\n",
                 f"import shutil\nshutil.rmtree({str(tmp_path)!r})\n"):
        res = run_python(code, LIMITS)
        assert res.status == "blocked", (code, res)
        assert victim.read_text() == "keep"
    assert_still_works()


def test_its_own_directory_is_fresh_and_writable():
    code = ("import os, tempfile\nassert os.listdir('.') == []\nopen('a.txt', 'w').write('x')\n"
            "assert open('a.txt').read() == 'x'\nos.mkdir('d')\nos.rename('a.txt', 'd/b.txt')\n"
            "with tempfile.NamedTemporaryFile('w') as f:\n    f.write('y')\nprint(os.getcwd())\n")
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
    for code in ("import sys\nsys.exit(0)\nassert False\n", "import os\nos._exit(0)\nassert False\n",
                 "import sys\nsys.exit()\nassert False\n", "raise SystemExit\nassert False\n"):
        res = run_python(code, LIMITS)
        assert res.returncode == 0 and not res.passed, (code, res)


def test_many_programs_run_concurrently_and_independently():
    programs = [GOOD, "while True:\n    pass\n", "assert False\n", GOOD, "import os\nos.fork()\n"]
    results = run_many(programs, LIMITS, workers=3)
    assert [r.status for r in results] == ["passed", "timeout", "failed", "passed", "blocked"]


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists(SYSTEM_PYTHON) or drop_to_uid(SYSTEM_PYTHON) is None,
                    reason="needs root and an interpreter that nobody can run")
def test_as_root_the_program_runs_as_nobody():
    res = run_python("import os\nprint(os.getuid(), os.getgid())\nopen('/etc/es-ray-x', 'a')\n", LIMITS,
                     python=SYSTEM_PYTHON)
    assert res.stdout.split()[:2] == ["65534", "65534"]
    assert res.status == "blocked"
    res = run_python(GOOD, LIMITS, python=SYSTEM_PYTHON)
    assert res.passed


def test_isolation_reports_its_layers():
    info = isolation()
    assert "audit hook" in info["network"]
    assert set(info) == {"network", "user", "limits", "filesystem"}


def test_isolation_reports_the_user_a_program_really_runs_as():
    """Here (root, a pyenv Python under /root that nobody cannot read) the uid stays and the report says why."""
    uid = int(run_python("import os\nprint(os.getuid())\n", LIMITS).stdout)
    info = isolation()
    if uid == NOBODY:
        assert info["user"].startswith("nobody") and "nobody's permissions" in info["filesystem"]
    else:
        assert uid == os.geteuid()
        assert info["user"].startswith("unchanged") and "nobody" not in info["filesystem"]
        assert ("failed here" in info["user"]) == (uid == 0), info["user"]


def _user_namespace_root_python(tmp_path: Path) -> str:
    """/usr/bin/python3 as root of a fresh user namespace that maps no nobody: setgroups/setuid fail there."""
    wrapper = tmp_path / "python"
    wrapper.write_text(f'#!/bin/sh\nexec unshare -r {SYSTEM_PYTHON} "$@"\n')
    wrapper.chmod(0o755)
    return str(wrapper)


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists(SYSTEM_PYTHON)
                    or subprocess.run(["unshare", "-r", "true"], capture_output=True).returncode != 0,
                    reason="needs root and unshare -r")
def test_a_drop_that_fails_is_reported_and_never_passed_off_as_nobody(tmp_path):
    python = _user_namespace_root_python(tmp_path)
    assert drop_to_uid(python) is None
    info = isolation(python)
    assert info["user"].startswith("unchanged: root; the drop to nobody failed here: cannot drop to uid 65534:")
    assert "nobody" not in info["filesystem"]
    res = run_python("import os\nprint(os.getuid())\n", LIMITS, python=python)
    assert res.passed and res.stdout.split() == ["0"]  # as it says: root of the namespace, unprivileged outside
    # asked to drop and unable to, the bootstrap stops before the program runs instead of going on as root
    res = _launch("print('ran')\n", LIMITS, python, NOBODY)
    assert (res.status, res.returncode, res.stdout) == ("error", DROP_FAILED_RC, "")
    assert res.stderr.startswith("es-ray-sandbox: cannot drop to uid 65534: [Errno 1] Operation not permitted")


# -- MBPP program assembly ------------------------------------------------------------------------------------


def test_extract_code_prefers_a_python_block_with_a_definition():
    text = "Here:\n```\npip install x\n```\n```python\ndef f(x):\n    return x\n```\nDone."
    assert extract_code(text) == "def f(x):\n    return x"
    assert extract_code("```py\ndef g():\n    pass\n```") == "def g():\n    pass"
    assert extract_code("def h():\n    return 1") == "def h():\n    return 1"
    assert extract_code("```python\ndef cut_off(x):\n    return") == "def cut_off(x):\n    return"  # truncated


def test_grade_programs_scores_and_counts_failures():
    tests = ["assert add(1, 2) == 3", "assert add(0, 0) == 0"]
    programs = [build_program("def add(a, b):\n    return a + b", tests),
                build_program("def add(a, b):\n    return a - b", tests),
                build_program("def add(a, b):\n    while True:\n        pass", tests),
                build_program("import socket\nsocket.socket()\ndef add(a, b):\n    return a + b", tests),
                build_program("def f():\n    return heapq.nsmallest(1, [3, 1])[0]", ["assert f() == 1"],
                              "import heapq")]
    grades = grade_programs(programs, LIMITS, workers=2)
    assert [(g.score, g.correct, g.failure) for g in grades] == [
        (1.0, True, None), (0.0, False, None), (0.0, False, "timeout"), (0.0, False, "blocked"), (1.0, True, None)]
