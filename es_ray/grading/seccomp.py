"""The seccomp-bpf filter the code sandbox installs before a program's first instruction (docs/security.md).

Built here as classic BPF bytes with ``struct`` (no libseccomp needed) and installed by the sandboxed process
itself (es_ray/grading/_sandbox_child.py) with ``PR_SET_NO_NEW_PRIVS`` and ``PR_SET_SECCOMP``, after its own
confinement and before it compiles the program. The kernel applies it to every later instruction of that process
and of every thread it starts; nothing the program does to the interpreter can remove it.

What it refuses, and why a code task never needs it:

* a second process (``fork``, ``vfork``, ``clone`` without ``CLONE_THREAD``) or a new program (``execve``,
  ``execveat``): every limit (RLIMIT_AS, RLIMIT_CPU, the output cap) is per process, so one process is also the
  whole program; threads share its address space and CPU account.
* sockets of any family (``socket``, ``socketpair``, ``connect``, ``bind``, ``listen``, ``accept``): CPython's
  start-up opens none, and a pathname unix socket is the one kind neither the network namespace nor Landlock
  separates.
* reading or changing other processes (``ptrace``, ``process_vm_*``, ``pidfd_getfd``, ``kcmp``; ``prlimit64``
  with a pid: the namespace's init runs as the same uid, and a lowered limit would stop it writing the record),
  kernel attack surface with no use here (``bpf``, ``io_uring_*``, ``userfaultfd``, ``perf_event_open``, ``keyctl``),
  the filesystem view and namespaces (``mount`` and the new mount API, ``umount2``, ``pivot_root``, ``chroot``,
  ``setns``, ``unshare``) and administration (modules, kexec, reboot, swap, clocks, quotas, handles).

A refused call is not run: the kernel stops the calling thread and notifies the namespace's init
(``SECCOMP_RET_USER_NOTIF``; the init holds the filter's listener, the program's process closed its copy before any
program code ran), which records the call's number and kills the process. ``escape_attempt`` is counted from that
notification only: a program that raises SIGSYS on itself produced no notification and is ``failed``
(``self_signal``). ``clone3`` answers ENOSYS instead, so that glibc falls back to ``clone``, whose flags a filter can
read (``clone3`` passes them in memory). A call made under another ABI than the filter's (x32 on x86_64, a foreign
audit arch) is refused the same way.

Extended attributes (``setxattr``, ``lsetxattr``, ``fsetxattr``, ``setxattrat``) answer EOPNOTSUPP, as on a file
system without them: a tmpfs keeps ``user.*`` xattrs in kernel memory outside its ``size=`` (shutil's copy2 ignores
the error). The SysV IPC ``shmget``, ``msgget`` and ``semget`` answer ENOSYS (``NO_SYSV_IPC``): their objects hold
kernel memory outside every rlimit until the IPC namespace dies.

``exit_group`` notifies the init too, which first takes every notification queued before it and then lets the exit
go on (``SECCOMP_USER_NOTIF_FLAG_CONTINUE``): a thread's refused call just before the process exits was otherwise
withdrawn by the exit before the init could read it, and the program passed without ``escape_attempt``.
"""

from __future__ import annotations

import os
import struct

AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
X32_SYSCALL_BIT = 0x40000000
CLONE_THREAD = 0x00010000
RET_KILL_PROCESS = 0x80000000
RET_USER_NOTIF = 0x7FC00000
RET_ALLOW = 0x7FFF0000
RET_ENOSYS = 0x00050000 | 38  # SECCOMP_RET_ERRNO | ENOSYS
RET_ENOTSUP = 0x00050000 | 95  # SECCOMP_RET_ERRNO | EOPNOTSUPP
RET_DENY = RET_USER_NOTIF
"""What a refused call gets: the init is notified, records it and kills the process (escape_attempt)."""
SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_NEW_LISTENER = 1, 1 << 3
SECCOMP_IOCTL_NOTIF_RECV = 0xC0502100  # _IOWR('!', 0, struct seccomp_notif), 80 bytes
NOTIF_SIZE = 80
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2

# BPF opcodes: load word at absolute offset, jump if equal / greater-or-equal / any bit set, return constant
_LD_ABS, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06
# struct seccomp_data: int nr; u32 arch; u64 instruction_pointer; u64 args[6] (the low word first: little endian)
_NR, _ARCH, _ARG0_LOW, _ARG0_HIGH = 0, 4, 16, 20

NO_XATTR = ("setxattr", "lsetxattr", "fsetxattr", "setxattrat")
NO_SYSV_IPC = ("shmget", "msgget", "semget")
"""Answered ENOSYS, as by a kernel built without SysV IPC: a segment, queue or semaphore set holds kernel memory
that no descriptor, mapping or rlimit counts (a shm segment outlives its ``shmdt``) until the IPC namespace dies."""
UNIFIED = {"setxattrat": 463}
"""Calls added after the tables' headers, numbered alike on every architecture (the unified numbering from 424)."""
DENIED = (
    "socket",
    "socketpair",
    "connect",
    "bind",
    "listen",
    "accept",
    "accept4",
    "fork",
    "vfork",
    "execve",
    "execveat",
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "pidfd_getfd",
    "kcmp",
    "bpf",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "userfaultfd",
    "perf_event_open",
    "keyctl",
    "add_key",
    "request_key",
    "mount",
    "umount2",
    "pivot_root",
    "chroot",
    "setns",
    "unshare",
    "open_tree",
    "move_mount",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "mount_setattr",
    "init_module",
    "finit_module",
    "delete_module",
    "kexec_load",
    "kexec_file_load",
    "reboot",
    "swapon",
    "swapoff",
    "acct",
    "syslog",
    "settimeofday",
    "clock_settime",
    "clock_adjtime",
    "adjtimex",
    "sethostname",
    "setdomainname",
    "quotactl",
    "name_to_handle_at",
    "open_by_handle_at",
    "lookup_dcookie",
    "fanotify_init",
    "personality",
    "modify_ldt",
    "iopl",
    "ioperm",
    "vhangup",
    "move_pages",
    "process_madvise",
)

SYSCALLS = {
    "x86_64": dict(
        socket=41,
        connect=42,
        accept=43,
        bind=49,
        listen=50,
        socketpair=53,
        clone=56,
        fork=57,
        vfork=58,
        execve=59,
        ptrace=101,
        syslog=103,
        personality=135,
        vhangup=153,
        modify_ldt=154,
        pivot_root=155,
        adjtimex=159,
        chroot=161,
        acct=163,
        settimeofday=164,
        mount=165,
        umount2=166,
        swapon=167,
        swapoff=168,
        reboot=169,
        sethostname=170,
        setdomainname=171,
        iopl=172,
        ioperm=173,
        init_module=175,
        delete_module=176,
        quotactl=179,
        lookup_dcookie=212,
        clock_settime=227,
        kexec_load=246,
        add_key=248,
        request_key=249,
        keyctl=250,
        unshare=272,
        move_pages=279,
        accept4=288,
        perf_event_open=298,
        fanotify_init=300,
        name_to_handle_at=303,
        open_by_handle_at=304,
        clock_adjtime=305,
        setns=308,
        process_vm_readv=310,
        process_vm_writev=311,
        kcmp=312,
        finit_module=313,
        kexec_file_load=320,
        bpf=321,
        execveat=322,
        userfaultfd=323,
        io_uring_setup=425,
        io_uring_enter=426,
        io_uring_register=427,
        open_tree=428,
        move_mount=429,
        fsopen=430,
        fsconfig=431,
        fsmount=432,
        fspick=433,
        clone3=435,
        pidfd_getfd=438,
        process_madvise=440,
        mount_setattr=442,
        prlimit64=302,
        setxattr=188,
        lsetxattr=189,
        fsetxattr=190,
        seccomp=317,
        shmget=29,
        semget=64,
        msgget=68,
        exit_group=231,
    ),
    # the generic table: no fork, vfork, modify_ldt, iopl or ioperm
    "aarch64": dict(
        lookup_dcookie=18,
        umount2=39,
        mount=40,
        pivot_root=41,
        chroot=51,
        vhangup=58,
        quotactl=60,
        acct=89,
        personality=92,
        unshare=97,
        kexec_load=104,
        init_module=105,
        delete_module=106,
        clock_settime=112,
        syslog=116,
        ptrace=117,
        reboot=142,
        sethostname=161,
        setdomainname=162,
        settimeofday=170,
        adjtimex=171,
        socket=198,
        socketpair=199,
        bind=200,
        listen=201,
        accept=202,
        connect=203,
        add_key=217,
        request_key=218,
        keyctl=219,
        clone=220,
        execve=221,
        swapon=224,
        swapoff=225,
        move_pages=239,
        perf_event_open=241,
        accept4=242,
        fanotify_init=262,
        name_to_handle_at=264,
        open_by_handle_at=265,
        clock_adjtime=266,
        setns=268,
        process_vm_readv=270,
        process_vm_writev=271,
        kcmp=272,
        finit_module=273,
        bpf=280,
        execveat=281,
        userfaultfd=282,
        kexec_file_load=294,
        io_uring_setup=425,
        io_uring_enter=426,
        io_uring_register=427,
        open_tree=428,
        move_mount=429,
        fsopen=430,
        fsconfig=431,
        fsmount=432,
        fspick=433,
        clone3=435,
        pidfd_getfd=438,
        process_madvise=440,
        mount_setattr=442,
        prlimit64=261,
        setxattr=5,
        lsetxattr=6,
        fsetxattr=7,
        seccomp=277,
        msgget=186,
        semget=190,
        shmget=194,
        exit_group=94,
    ),
}


def _ins(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)  # struct sock_filter


def build_filter(machine: str | None = None) -> bytes:
    """The filter for ``machine`` (``os.uname().machine``) as packed ``struct sock_filter`` entries; ValueError
    names the supported ones where there is no table."""
    machine = machine or os.uname().machine
    if machine not in SYSCALLS:
        raise ValueError(f"no seccomp syscall table for {machine!r}; the sandbox supports {sorted(SYSCALLS)}")
    nr = {**UNIFIED, **SYSCALLS[machine]}
    prog = [_ins(_LD_ABS, _ARCH), _ins(_JEQ, AUDIT_ARCH[machine], jt=1), _ins(_RET, RET_DENY), _ins(_LD_ABS, _NR)]
    if machine == "x86_64":
        prog += [_ins(_JGE, X32_SYSCALL_BIT, jf=1), _ins(_RET, RET_DENY)]
    # clone: a thread (CLONE_THREAD in the flags, the first argument on both arches) is allowed, a process not
    prog += [
        _ins(_JEQ, nr["clone"], jf=4),
        _ins(_LD_ABS, _ARG0_LOW),
        _ins(_JSET, CLONE_THREAD, jf=1),
        _ins(_RET, RET_ALLOW),
        _ins(_RET, RET_DENY),
    ]
    prog += [_ins(_JEQ, nr["clone3"], jf=1), _ins(_RET, RET_ENOSYS)]
    # prlimit64 on this process only (pid 0, what glibc's getrlimit/setrlimit pass): on the namespace's init, the
    # same uid, a lowered RLIMIT_FSIZE or RLIMIT_CPU would stop it writing the record
    prog += [
        _ins(_JEQ, nr["prlimit64"], jf=6),
        _ins(_LD_ABS, _ARG0_LOW),
        _ins(_JEQ, 0, jf=2),
        _ins(_LD_ABS, _ARG0_HIGH),
        _ins(_JEQ, 0, jt=1),
        _ins(_RET, RET_DENY),
        _ins(_RET, RET_ALLOW),
    ]
    for name in NO_XATTR:
        prog += [_ins(_JEQ, nr[name], jf=1), _ins(_RET, RET_ENOTSUP)]
    # the process's exit waits for the init: it takes the refused calls queued before it, then lets it go on
    prog += [_ins(_JEQ, nr["exit_group"], jf=1), _ins(_RET, RET_USER_NOTIF)]
    for name in NO_SYSV_IPC:
        prog += [_ins(_JEQ, nr[name], jf=1), _ins(_RET, RET_ENOSYS)]
    for name in DENIED:
        if name in nr:
            prog += [_ins(_JEQ, nr[name], jf=1), _ins(_RET, RET_DENY)]
    prog.append(_ins(_RET, RET_ALLOW))
    return b"".join(prog)
