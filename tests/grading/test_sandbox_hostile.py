"""Hostile programs, one per class of issue 33, through the real MBPP path (build_program, run_python,
grade_programs), each with every layer and again with one layer switched off, to show which layer holds it."""

from __future__ import annotations

import dataclasses
import os
import shutil
import socket
import tempfile
import threading
import time
from pathlib import Path

import pytest

import es_ray.grading.sandbox as sandbox
from es_ray.grading.code import build_program, grade_programs
from es_ray.grading.sandbox import SandboxLimits, run_python
from paths import FIXTURES

HOSTILE = FIXTURES / "hostile"
LIMITS = SandboxLimits(wall_s=5.0, cpu_s=2.0, memory_mb=512, output_bytes=64 << 10, check_s=2.0)
GOOD = build_program("def add(a, b):\n    return a + b", ["assert add(1, 2) == 3"])
MARGIN_S = 3.0  # process starts and teardown on a loaded 2-core machine
# without the minimal root the dedicated uid cannot read a Python under /root (0700): root without capabilities
OFF = {
    "seccomp": {"seccomp": ""},
    "minimal root": {"jail": (), "drop_to": None},
    "audit hook": {"hook": False},
    "landlock": {"landlock": 0},
    "dedicated uid": {"drop_to": None},
}


def hostile(name: str, defeat_hook: bool = False, **subst: str) -> str:
    text = (HOSTILE / f"{name}.py").read_text()
    if "_forge(" in text:
        text = (HOSTILE / "_pipe.py").read_text() + text
    if "_report(" in text:
        text = (HOSTILE / "_meminfo.py").read_text() + text
    for key, value in subst.items():
        text = text.replace(key, value)
    return ((HOSTILE / "defeat_hook.py").read_text() if defeat_hook else "") + text


@pytest.fixture
def layer_off(monkeypatch):
    """``layer_off(name)``: this machine's plan with one layer switched off (see OFF)."""
    real = sandbox.sandbox_plan

    def switch(name: str):
        plan = dataclasses.replace(real(), **OFF[name])
        monkeypatch.setattr(sandbox, "sandbox_plan", lambda python=None: plan)

    yield switch
    monkeypatch.setattr(sandbox, "sandbox_plan", real)


def test_the_audit_hook_is_defeated_from_pure_python_and_seccomp_still_kills_exec(layer_off):
    res = run_python(hostile("exec_shell", defeat_hook=True), LIMITS)
    assert "HOOK_OFF" in res.stdout and res.status == "escape_attempt" and "ESCAPED" not in res.stdout, res
    layer_off("seccomp")  # the hook is off and seccomp too: the shell runs (as the dedicated uid, in the jail)
    res = run_python(hostile("exec_shell", defeat_hook=True), LIMITS)
    assert "ESCAPED" in res.stdout and "uid=0" not in res.stdout, res


@pytest.fixture
def unix_server(tmp_path):
    path = tmp_path / "raylet"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(path))
    srv.listen(4)
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
                hits.append(conn.recv(100) or b"<connected>")

    th = threading.Thread(target=serve, daemon=True)
    th.start()
    os.chmod(tmp_path, 0o777)
    os.chmod(path, 0o777)  # even a socket anyone may connect to
    yield str(path), hits
    stop.set()
    th.join(2)
    srv.close()


@pytest.mark.parametrize("off", [None, "minimal root", "seccomp", "audit hook"])
def test_host_unix_sockets_are_out_of_reach(unix_server, layer_off, off):
    path, hits = unix_server
    if off:
        layer_off(off)
    res = run_python(hostile("host_unix_socket", defeat_hook=True, SOCKET_PATH=path), LIMITS)
    time.sleep(0.3)
    assert hits == [] and "ESCAPED" not in res.stdout, res
    # which layer holds it: seccomp kills socket(); without seccomp the path does not exist in the minimal root
    assert res.status == ("passed" if off == "seccomp" else "escape_attempt"), res
    if off == "seccomp":
        assert "No such file" in res.stdout


def test_with_seccomp_and_the_minimal_root_off_the_socket_is_reached(unix_server, monkeypatch):
    """The attack is live: only those two layers stand between it and the host's socket."""
    path, hits = unix_server
    plan = dataclasses.replace(sandbox.sandbox_plan(), seccomp="", **OFF["minimal root"])
    monkeypatch.setattr(sandbox, "sandbox_plan", lambda python=None: plan)
    res = run_python(hostile("host_unix_socket", defeat_hook=True, SOCKET_PATH=path), LIMITS)
    time.sleep(0.3)
    assert hits == [b"ESCAPED"], res


@pytest.fixture
def ray_session():
    """A Ray-like session directory anyone may look into (tmp_path's parents are private to root)."""
    top = Path(tempfile.mkdtemp(prefix="es-ray-test-ray-", dir="/tmp"))
    os.chmod(top, 0o755)
    session = top / "session_latest" / "sockets"
    session.mkdir(parents=True)
    yield session
    shutil.rmtree(top)


@pytest.mark.parametrize("off", [None, "minimal root"])
def test_host_directories_do_not_exist_for_the_program(ray_session, layer_off, off):
    if off:
        layer_off(off)
    res = run_python(hostile("host_paths_visible", HOST_DIR=str(ray_session)), LIMITS)
    assert res.passed, res
    assert res.stdout.split()[0] == ("VISIBLE" if off else "hidden"), res  # the minimal root is what hides it


@pytest.mark.parametrize("off", [None, "seccomp"])
def test_a_second_process_is_killed(layer_off, off):
    if off:
        layer_off(off)
    res = run_python(hostile("fork_over_limit", defeat_hook=True), LIMITS)
    if off:  # per-process limits would then apply per child: seccomp is what makes one process the program
        assert "FORKED" in res.stdout, res
    else:
        assert res.status == "escape_attempt" and "FORKED" not in res.stdout, res


def test_memory_over_the_limit_in_threads_is_the_whole_programs():
    code = (
        "import threading\nkeep = []\ndef grab():\n    keep.append(bytearray(200 << 20))\n"
        "ts = [threading.Thread(target=grab) for _ in range(4)]\n[t.start() for t in ts]\n[t.join() for t in ts]\n"
        "print(len(keep))\n"
    )
    res = run_python(code, LIMITS)  # 4 x 200 MB against 512 MB: the address space is shared
    assert res.stdout.strip() in ("", "0", "1", "2"), res


@pytest.mark.parametrize("off", [None, "dedicated uid"])
def test_threads_are_counted_for_the_dedicated_uid(layer_off, off):
    if os.geteuid() != 0 or "-r" in sandbox.namespaces():
        pytest.skip("the dedicated uid needs real root")
    if off:
        layer_off(off)
    res = run_python(hostile("thread_bomb"), LIMITS)
    n = int(res.stdout.split()[1])
    if off:  # root is exempt from RLIMIT_NPROC: the uid is what bounds it
        assert n > LIMITS.max_processes, res
    else:
        assert n < LIMITS.max_processes, res


CRASH = [
    "crash_snan",
    "crash_fake_fraction",
    "crash_fake_decimal",
    "crash_deep_brackets",
    "crash_infinity",
    "hash_collision_set",
    "forged_marks",
    "forged_record",
    "builtin_name",
    "comprehension_eq",
    "unittest_main",
]


def test_a_batch_of_crash_values_scores_zero_with_reasons_and_goes_on():
    limits = dataclasses.replace(LIMITS, output_bytes=2 << 20)
    programs = [hostile(name) for name in CRASH] + [GOOD]
    t0 = time.monotonic()
    grades = grade_programs(programs, limits, workers=2)
    elapsed = time.monotonic() - t0
    got = {name: (g.score, g.failure) for name, g in zip(CRASH, grades)}
    assert grades[-1].correct, grades[-1]
    assert all(g.score == 0.0 for g in grades[:-1]), got
    assert got["crash_deep_brackets"][1] == got["crash_infinity"][1] == "unparseable_result", got
    assert got["hash_collision_set"][1] == "unparseable_result", got
    for name in (
        "crash_snan",
        "crash_fake_fraction",
        "crash_fake_decimal",
        "forged_marks",
        "forged_record",
        "builtin_name",
        "comprehension_eq",
        "unittest_main",
    ):
        assert got[name] == (0.0, None), (name, got)  # a wrong program, not a grader failure
    # the grader's own time per program stays within the wall limit, the check's and a margin
    assert elapsed < len(programs) * (limits.wall_s + limits.check_s + MARGIN_S) / 2, elapsed


def test_a_collision_set_costs_the_grader_at_most_the_check_budget():
    limits = dataclasses.replace(LIMITS, output_bytes=2 << 20)
    t0 = time.monotonic()
    res = run_python(hostile("hash_collision_set"), limits)
    assert res.status == "unparseable_result", res
    assert time.monotonic() - t0 < limits.check_s + MARGIN_S


def test_the_record_cannot_be_reached_or_forged():
    res = run_python(hostile("forged_record"), LIMITS)
    assert res.status == "failed", res
    assert "WROTE" not in res.stdout and res.stdout.count("refused") == 3, res
    res = run_python(hostile("forged_marks"), LIMITS)
    assert res.status == "failed" and res.returncode == 97, res  # neither "error" nor "blocked"


@pytest.mark.parametrize("off", ["audit hook", "landlock", "dedicated uid"])
def test_each_other_layer_switched_off_leaves_the_syscall_layer_holding(layer_off, off):
    layer_off(off)
    for name in ("exec_shell", "fork_over_limit"):
        res = run_python(hostile(name, defeat_hook=off != "audit hook"), LIMITS)
        assert res.status == "escape_attempt", (off, name, res)
    assert run_python(GOOD, LIMITS).passed


@pytest.mark.parametrize(
    "arch,header,prefixes",
    [
        ("x86_64", "/usr/include/x86_64-linux-gnu/asm/unistd_64.h", ("__NR_",)),
        ("aarch64", "/usr/include/asm-generic/unistd.h", ("__NR_", "__NR3264_")),
    ],
)
def test_the_seccomp_tables_match_the_kernel_headers(arch, header, prefixes):
    import re

    from es_ray.grading.seccomp import SYSCALLS, build_filter

    if not os.path.exists(header):
        pytest.skip(f"{header} is not installed")
    text = Path(header).read_text()
    ref = {m.group(2): int(m.group(3)) for m in re.finditer(r"#define\s+(%s)(\w+)\s+(\d+)" % "|".join(prefixes), text)}
    assert {k: v for k, v in SYSCALLS[arch].items() if ref.get(k) != v} == {}
    assert len(build_filter(arch)) % 8 == 0 and len(build_filter(arch)) // 8 < 4096
    with pytest.raises(ValueError, match="supports"):
        build_filter("riscv64")


# -- second round: attacks on the init, the check and the grader itself ------------------------------------------


def test_the_init_cannot_be_ended_by_a_signal():
    """SIGINT to pid 1 through a pidfd (no audit event, so with the hook on) or kill -1 ended the init before its
    record: status error, the program's failure counted as the grader's. The init keeps no handler, and a PID
    namespace's init gets no signal from inside it that it has no handler for."""
    for defeat in (False, True):
        res = run_python(hostile("signal_init", defeat_hook=defeat), LIMITS)
        assert res.status == "failed" and "sent" in res.stdout, res


@pytest.mark.parametrize("off", [None, "seccomp"])
def test_the_inits_limits_are_out_of_reach(layer_off, off):
    """prlimit on pid 1 (the same uid) lowered the init's file-size limit so its record was never written."""
    if off:
        layer_off(off)
    res = run_python(hostile("prlimit_init", defeat_hook=True), LIMITS)
    if off:  # the attack is live: the filter is what holds it
        assert "LOWERED" in res.stdout and res.status == "error", res
    else:
        assert res.status == "escape_attempt" and "LOWERED" not in res.stdout, res


@pytest.mark.parametrize("name,n_tests", [("own_assert_rebinds", 2), ("own_assert_forges", 1)])
def test_the_candidates_own_asserts_never_run_in_the_check(name, n_tests):
    """The candidate's code may end with asserts of its own, just before the task's tests. Taken as tests, the
    ones with only trusted names ran in the check process, where they rebound sorted and math.isclose or wrote
    the verdicts: the wrong program passed. Only the task's n_tests asserts are tests now."""
    program = hostile(name)
    res = run_python(program, LIMITS, n_tests=n_tests, setup="import math")
    assert res.status == "failed", res
    # with every trailing assert a test (no n_tests: the caller vouches for them all) the attack is live
    assert run_python(program, LIMITS, setup="import math").passed


def test_tests_too_deep_or_too_large_fail_the_program_and_the_batch_goes_on():
    """An assert 400 additions deep raised RecursionError out of grade_programs (the whole batch lost); a test
    of 25,000 syntax nodes cost the grader seconds outside every limit."""
    deep = hostile("deep_own_assert", DEEP="1 + " * 400 + "1")
    wide = "def f(x):\n    return x\n\n\nassert f([" + "1, " * 25_000 + "]) == 1\n"
    t0 = time.monotonic()
    grades = grade_programs([deep, GOOD, deep, wide], LIMITS, workers=2, n_tests=[None, None, 1, None])
    assert time.monotonic() - t0 < LIMITS.wall_s + MARGIN_S
    assert [(g.score, g.failure) for g in grades] == [(0.0, None), (1.0, None), (0.0, None), (0.0, None)], grades
    assert "too deep" in run_python(deep, LIMITS).stderr
    assert "syntax nodes" in run_python(wide, LIMITS).stderr


def test_too_deep_is_the_graders_bound_not_the_interpreters_recursion_limit():
    """The depth refusal held only while the grading process kept Python's default recursion limit; a host that
    raised it (a library in the same process) let a 400-deep test through to the visitors. The bound is now the
    grader's own (MAX_TEST_DEPTH), whatever the limit."""
    import sys

    from es_ray.grading.verdict import MAX_TEST_DEPTH, TestsTooLarge, split_tests

    deep = hostile("deep_own_assert", DEEP="1 + " * 400 + "1")
    limit = sys.getrecursionlimit()
    try:
        for raised in (limit, 100_000):
            sys.setrecursionlimit(raised)
            with pytest.raises(TestsTooLarge, match=f"more than {MAX_TEST_DEPTH} levels"):
                split_tests(deep)
    finally:
        sys.setrecursionlimit(limit)
    shallow = hostile("deep_own_assert", DEEP="1 + " * (MAX_TEST_DEPTH // 2) + "1")
    assert split_tests(shallow).asserts == 2


def test_the_program_holds_nothing_of_the_graders():
    """Its descriptors: /dev/null, its output files, its pipe (fd 0 was the grader's drained stdin pipe); and
    the record's nonce, which was in the init's frames above the program (four places)."""
    res = run_python(hostile("inherited_fds"), LIMITS)
    fds = [line.split()[1:] for line in res.stdout.splitlines() if line.startswith("FD ")]
    assert res.passed and [kind for _, kind in fds] == ["chr", "reg", "reg", "fifo"], res
    assert "NONCES 0" in res.stdout, res


# attacks that held before this round too; each scores 0 for the reason given
HELD = {
    "exec_memfd": "escape_attempt",
    "io_uring": "escape_attempt",
    "confusable_builtin": None,
    "exc_str_raises": None,
    "recursive_result": None,
    "close_std": None,
}


def test_a_batch_of_the_second_rounds_attacks_scores_zero_and_stays_bounded():
    names = [*HELD, "signal_init", "prlimit_init", "own_assert_rebinds", "own_assert_forges", "deep_own_assert"]
    programs = [
        hostile(n, defeat_hook=n in ("exec_memfd", "io_uring", "prlimit_init"), DEEP="1 + " * 400 + "1") for n in names
    ] + [GOOD]
    n_tests = [None] * len(HELD) + [None, None, 2, 1, 1, None]
    t0 = time.monotonic()
    grades = grade_programs(programs, LIMITS, workers=2, n_tests=n_tests, setups=["import math"] * len(programs))
    elapsed = time.monotonic() - t0
    got = {n: (g.score, g.failure) for n, g in zip(names, grades)}
    want = {
        **{n: (0.0, why) for n, why in HELD.items()},
        "signal_init": (0.0, None),
        "prlimit_init": (0.0, "escape_attempt"),
        "own_assert_rebinds": (0.0, None),
        "own_assert_forges": (0.0, None),
        "deep_own_assert": (0.0, None),
    }
    assert got == want and grades[-1].correct, (got, grades[-1])
    assert elapsed < len(programs) * (LIMITS.wall_s + LIMITS.check_s + MARGIN_S) / 2, elapsed


# -- third round: failure kinds the program cannot choose, kernel memory, correct programs, the grader's own time --


@pytest.mark.parametrize("signame", ["SIGSYS", "SIGKILL", "SIGXFSZ", "SIGXCPU"])
@pytest.mark.parametrize("defeat", [False, True])
def test_a_signal_the_program_raises_on_itself_is_its_own_failure(signame, defeat):
    """raise_signal(SIGSYS) was escape_attempt, SIGKILL and SIGXCPU timeout, SIGXFSZ output_limit: the kind came
    from the exit signal alone. Now from the jail's observations only (no listener notification, no CPU or file
    at its limit): failed, reason self_signal."""
    res = run_python(hostile("self_signal", defeat_hook=defeat, SIGNUM=signame), LIMITS)
    assert (res.status, res.reason) == ("failed", "self_signal"), res
    assert res.returncode == -getattr(__import__("signal"), signame), res


def test_output_limit_needs_the_bytes_written_not_a_hole_up_to_the_cap():
    """A file truncated up to output_bytes has that st_size with nothing written: stdout (the grader's file) and a
    file in the work dir so were output_limit for a program that then exited 3. Now the bytes must be there (no
    hole before the cap; a tmpfs's pages); writing them is still output_limit."""
    sparse = hostile("sparse_output", CAP=str(LIMITS.output_bytes))
    res = run_python(sparse, LIMITS)
    assert (res.status, res.reason) == ("failed", "exit 3"), res
    writes = {"stdout": ("os.ftruncate(1, ", "os.write(1, b'x' * "), "a file": ("f.truncate(", "f.write(b'x' * ")}
    for where, (hole, write) in writes.items():
        res = run_python(sparse.replace(hole, write), LIMITS)
        assert res.status == "output_limit", (where, res)


def test_a_refused_call_just_before_the_exit_is_still_seen():
    """A thread's chroot, then os._exit(0) at once: the exit withdrew the pending notification before the init read
    it, and the correct program passed (1-2 of 8 runs per spacing, loaded 2-core machine). exit_group now waits for
    the init, which takes the notifications queued before it first."""
    for wait in ("0", "0.0002", "0.002") * 4:
        res = run_python(hostile("exit_race", WAIT=wait), LIMITS)
        assert res.status == "escape_attempt", (wait, res)
    assert run_python(GOOD, LIMITS).passed
    res = run_python("import os\nos._exit(5)\n", LIMITS)
    assert (res.status, res.reason, res.returncode) == ("failed", "exit 5", 5), res


def test_printed_marks_are_the_programs_words():
    """MemoryError on stderr was memory; the hook's mark (with its nonce, which the program can read) was blocked."""
    res = run_python(hostile("forged_memory"), LIMITS)
    assert (res.status, res.reason) == ("failed", "exit 1") and "MemoryError" in res.stderr, res
    res = run_python(hostile("forged_marks"), LIMITS)
    assert (res.status, res.reason) == ("failed", "exit 97"), res


@pytest.mark.parametrize("off", [None, "audit hook"])
def test_a_refused_call_is_seen_by_the_init_not_read_from_the_signal(layer_off, off):
    """escape_attempt now comes from the filter's listener, which the init holds: the refused call is not run."""
    if off:
        layer_off(off)
    res = run_python(hostile("exec_shell", defeat_hook=True), LIMITS)
    assert res.status == "escape_attempt" and "ESCAPED" not in res.stdout, res
    assert res.returncode == -9, res  # the init killed it on the notification


def test_a_value_too_deep_is_unparseable_whatever_the_recursion_limit():
    """With the grading process's recursion limit at 2000, a 1,200-level value passed the grader's parse and broke
    the check's init (status error, counted as the grader's). Both parse it with the same bounded parse now."""
    import sys

    limit = sys.getrecursionlimit()
    try:
        sys.setrecursionlimit(2000)
        res = run_python(hostile("deep_json_value"), LIMITS)
    finally:
        sys.setrecursionlimit(limit)
    assert res.status == "unparseable_result", res


def _slab_shmem_kb() -> int:
    fields = dict(line.split(":", 1) for line in open("/proc/meminfo"))
    return sum(int(fields[k].split()[0]) for k in ("Slab", "Shmem"))


KERNEL_MEMORY_BOUND_KB = 64 << 10
"""What one program may add to the host's slab + shmem while it runs (measured by the program itself, /proc/meminfo
is not namespaced) and what may be left after it: the work tmpfs's disk_inodes (1,024) bound it to a few MiB; the
rest of the bound is the noise of a shared machine. Before: 992 MiB (xattrs) and 273 MiB (symlinks)."""


@pytest.mark.parametrize("name,off", [("xattr_flood", None), ("xattr_flood", "seccomp"), ("symlink_flood", None)])
def test_kernel_memory_of_a_program_is_bounded_and_given_back(layer_off, name, off):
    if off:  # without the filter the xattrs are set: nr_inodes is then what bounds them (the tmpfs's inode space)
        layer_off(off)
    before = _slab_shmem_kb()
    res = run_python(hostile(name, defeat_hook=True), dataclasses.replace(LIMITS, wall_s=20.0, cpu_s=10.0))
    after = _slab_shmem_kb()
    grew = [line.split() for line in res.stdout.splitlines() if line.startswith("GREW")]
    assert res.passed and grew, res
    during_kb, made = int(grew[0][1]), int(grew[0][3])
    assert during_kb < KERNEL_MEMORY_BOUND_KB, res
    assert after - before < KERNEL_MEMORY_BOUND_KB, (before, after)
    if name == "xattr_flood" and not off:
        assert made == 0 and "STOPPED 95" in res.stdout, res  # EOPNOTSUPP from the filter
    elif name == "xattr_flood" and "STOPPED 95" in res.stdout:  # a kernel before 6.6: no user xattrs on tmpfs
        assert made == 0, res
    else:
        assert 0 < made <= 16 * LIMITS.disk_inodes and "STOPPED 28" in res.stdout, res  # ENOSPC: out of inodes


@pytest.mark.parametrize("name,made_before", [("sysv_shm_flood", "segments 10"), ("sysv_msg_flood", "messages 32000")])
def test_sysv_ipc_objects_hold_no_kernel_memory_outside_the_limits(layer_off, name, made_before):
    """A SysV shm segment outlives its shmdt and a message queue needs no descriptor: 640 MiB of shmem (over the
    program's memory_mb) and 250 MiB of queued messages, no process's, until the IPC namespace was freed after the
    grader returned. The filter answers shmget, msgget and semget ENOSYS; without it the attack is live."""
    limits = dataclasses.replace(LIMITS, wall_s=20.0, cpu_s=10.0)
    before = _slab_shmem_kb()
    res = run_python(hostile(name, defeat_hook=True), limits)
    after = _slab_shmem_kb()
    grew = [line.split() for line in res.stdout.splitlines() if line.startswith("GREW")]
    assert res.passed and grew, res
    assert "STOPPED 38" in res.stdout and int(grew[0][3]) == 0, res  # ENOSYS from the filter
    assert int(grew[0][1]) < KERNEL_MEMORY_BOUND_KB and after - before < KERNEL_MEMORY_BOUND_KB, (res, before, after)
    layer_off("seccomp")
    res = run_python(hostile(name, defeat_hook=True), limits)
    assert res.passed and "GREW" in res.stdout and made_before in res.stdout, res


def test_memfd_and_pipe_memory_is_bounded_by_the_open_files_limit():
    """memfd files live on the kernel's own tmpfs (not the jail's): each is bounded by RLIMIT_FSIZE, so a program
    holds at most max_open_files x output_bytes of them (64 MiB at the defaults), freed with its descriptors."""
    limits = dataclasses.replace(LIMITS, wall_s=20.0, cpu_s=10.0, output_bytes=1 << 20)
    res = run_python(hostile("memfd_flood", defeat_hook=True), limits)
    grew = [line.split() for line in res.stdout.splitlines() if line.startswith("GREW")]
    assert res.passed and grew and "STOPPED" not in res.stdout, res
    assert int(grew[0][3]) <= limits.max_open_files * (limits.output_bytes >> 16), res
    assert int(grew[0][1]) < KERNEL_MEMORY_BOUND_KB, res


def test_negative_dentries_on_the_host_binds_are_bounded_by_the_cpu_limit():
    """Misses under the read-only binds of /usr leave negative dentries in the host's cache. They are reclaimable
    (SReclaimable), and the CPU limit bounds how many one program makes: counted here (dentry-state's
    nr_negative, shared machine) and stated in docs/security.md."""

    def negative():
        return int(open("/proc/sys/fs/dentry-state").read().split()[4])

    before = negative()
    res = run_python(hostile("negative_dentries"), dataclasses.replace(LIMITS, wall_s=20.0, cpu_s=10.0))
    grew = negative() - before
    assert res.passed and "MISSED 200000" in res.stdout, res
    assert grew < 400_000, grew  # at most one per miss (and others' on this machine)


@pytest.mark.parametrize(
    "name,entry",
    [
        ("formfeed_string", ()),
        ("big_factorial", ()),
        ("long_result", ()),
        ("builtin_sum", ("sum",)),
        ("truthy_match", ()),
    ],
)
def test_correct_programs_are_not_scored_zero_by_the_harness(name, entry):
    res = run_python(hostile(name), LIMITS, n_tests=None, entry=entry)
    assert res.passed, res


def test_a_task_function_named_like_a_builtin_uses_the_programs_binding_only_for_that_task():
    """entry comes from the task's reference solution (task_functions); without it the two-way check still
    holds, and a builtin name the task does not define is still checked both ways."""
    from es_ray.grading.verdict import task_functions

    assert task_functions("def sum(n):\n    return n\n\ndef helper():\n    pass\n") == ("sum",)
    assert run_python(hostile("builtin_sum"), LIMITS).status == "failed"  # no entry: the builtin reading fails
    # the task's function is sum; the program's max still gets both readings (it returns its first argument)
    wrong = "def sum(n):\n    return 6\n\ndef max(a, b):\n    return a\n\nassert sum(123) == max(1, 6)\n"
    assert run_python(wrong, LIMITS, entry=("sum",)).passed is False
    assert run_python(hostile("builtin_name"), LIMITS, entry=("sum",)).status == "failed"


def test_a_candidate_over_the_size_cap_is_too_long_before_any_parse():
    from es_ray.grading.sandbox import MAX_PROGRAM_BYTES

    program = GOOD + "#" * MAX_PROGRAM_BYTES
    t0 = time.monotonic()
    grades = grade_programs([program, GOOD], LIMITS)
    assert [(g.score, g.failure) for g in grades] == [(0.0, "too_long"), (1.0, None)], grades
    assert time.monotonic() - t0 < LIMITS.wall_s + MARGIN_S


def test_split_tests_is_linear_in_the_candidates_size():
    """185 KB took 3.3 s in split_tests: its cost now grows linearly (ratio of 4x the size within 8x the time)."""
    from es_ray.grading.verdict import split_tests

    def cost(n):
        program = "def f(x):\n    return x\n" + "y = [1, 2, 3]\n" * n + "assert f(1) == 1\n" * 50
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            split_tests(program, "", 50)
            best = min(best, time.perf_counter() - t0)
        return best

    assert cost(8000) < 8 * cost(2000)


def test_a_batch_of_the_third_rounds_attacks_scores_a_kind_it_did_not_choose():
    names = ["self_signal", "forged_memory", "forged_marks", "deep_json_value", "xattr_flood", "symlink_flood"]
    programs = [hostile(n, defeat_hook=True, SIGNUM="SIGSYS") for n in names] + [GOOD]
    t0 = time.monotonic()
    grades = grade_programs(programs, LIMITS, workers=2)
    elapsed = time.monotonic() - t0
    got = {n: (g.score, g.failure) for n, g in zip(names, grades)}
    assert grades[-1].correct, grades[-1]
    assert got == {
        "self_signal": (0.0, None),
        "forged_memory": (0.0, None),
        "forged_marks": (0.0, None),
        "deep_json_value": (0.0, "unparseable_result"),
        "xattr_flood": (1.0, None),
        "symlink_flood": (1.0, None),
    }, got
    assert elapsed < len(programs) * (LIMITS.wall_s + LIMITS.check_s + MARGIN_S) / 2, elapsed


def test_a_truth_test_of_a_wrong_value_still_fails():
    """``assert f(x)`` probes bool(f(x)): a falsy value fails, and a program's own bool is checked both ways."""
    assert run_python(hostile("truthy_match").replace('"ac"', '"abbb"'), LIMITS).status == "failed"
    forged = "def bool(x):\n    return True\n\ndef f():\n    return 0\n\nassert bool(f())\n"
    assert run_python(forged, LIMITS).status == "failed"


def test_setup_that_uses_the_tasks_own_class_runs_after_the_candidate():
    """MBPP 367 and 927: the setup builds trees of the task's Node class; run before the candidate, every correct
    program failed with a NameError. Its imports still come first (the candidate and the check may use them)."""
    code = "class Node:\n    def __init__(self, v):\n        self.v = v\n\ndef value(n):\n    return math.floor(n.v)\n"
    program = build_program(code, ["assert value(root) == 3"], "import math\nroot = Node(3.5)")
    assert program.index("import math") < program.index("class Node") < program.index("root = Node")
    assert run_python(program, LIMITS, n_tests=1, setup="import math\nroot = Node(3.5)").passed
