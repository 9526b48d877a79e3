"""The stand-in's container launcher: ``python podinit.py SPEC.json``, started by the kubelet.

Runs one container of a Pod in namespaces of its own, as a container runtime does,
with nothing changed on the host::

    kubelet ── podinit (host PID namespace: relays signals, exits with the container's code)
                 └─ fork ─ PID 1 of a new PID namespace: builds the root, chroots, execs argv

podinit writes the PID of the container's PID 1 to ``pid_file`` once that process
has exec'd the command (its root in place), so what enters the container through
that PID (exec probes, ``kubectl exec``) always sees the container's filesystem.

- mount namespace (private propagation): the root is a tmpfs whose top-level entries
  bind the host's (recursively, except the directories above the root itself). A
  directory on the way to a mount target the host lacks (``/etc/pdserve``, ``/models``,
  ``/run/secrets/...``) is mirrored instead: a tmpfs directory whose entries bind the
  host's one by one, so the target can be made without touching the host. Then every
  mount of the spec (volumes, /etc/hosts, /etc/resolv.conf, /dev/shm, /tmp, ...) is
  bound over its target, read-only where asked; a fresh /proc is mounted; chroot.
- UTS namespace: the Pod's hostname. IPC namespace: SysV IPC of its own.
- PID namespace: the command is PID 1, as in a container. When it exits the kernel
  kills the rest of the namespace; both processes die (PR_SET_PDEATHSIG) when their
  parent does, so nothing outlives the kubelet, even a killed test run.

The network stays the host's: the Pod's own loopback address comes from the socket
shim (``netshim.c``) that the spec's environment preloads. Spec (JSON): root,
hostname, mounts [{source, target, readonly}], cwd, argv, env, pid_file, parent_pid.
Standard library only.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import select
import signal
import socket
import stat
import sys

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC, CLONE_NEWPID = 0x00020000, 0x04000000, 0x08000000, 0x20000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
PR_SET_PDEATHSIG = 1
RELAYED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)

libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = (ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p)


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    def enc(text: str | None) -> bytes | None:
        return None if text is None else text.encode()

    _check(libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)), f"mount {source} on {target}")


def bind(source: str, target: str, *, recursive: bool = True, readonly: bool = False) -> None:
    _mount(source, target, None, MS_BIND | (MS_REC if recursive else 0))
    if readonly:
        _mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY)


def _ancestors(path: str) -> list[str]:
    """``/a/b/c`` -> ``["/", "/a", "/a/b"]``."""
    parts = path.strip("/").split("/")[:-1]
    return ["/"] + ["/" + "/".join(parts[:i + 1]) for i in range(len(parts))]


def _populate(host_dir: str, stage_dir: str, mirrored: set[str], root: str) -> None:
    """Fill ``stage_dir`` (a tmpfs directory) with the entries of ``host_dir``."""
    for name in sorted(os.listdir(host_dir)):
        host, stage = os.path.join(host_dir, name), os.path.join(stage_dir, name)
        try:
            if os.path.islink(host):
                os.symlink(os.readlink(host), stage)
            elif os.path.isdir(host):
                os.mkdir(stage, stat.S_IMODE(os.stat(host).st_mode))
                if host in mirrored:
                    _populate(host, stage, mirrored, root)
                elif host != "/proc":  # a fresh one is mounted for the PID namespace
                    above_root = root == host or root.startswith(host + "/")
                    bind(host, stage, recursive=not above_root)
            else:
                open(stage, "w").close()
                bind(host, stage)
        except OSError as exc:
            print(f"podinit: {host} left out of the container: {exc}", file=sys.stderr)


def build_root(spec: dict) -> str:
    root = spec["root"]
    os.makedirs(root, exist_ok=True)
    _mount("tmpfs", root, "tmpfs", 0, "mode=755")
    mounts = [(os.path.realpath(m["target"]), m) for m in spec["mounts"]]
    mirrored = {a for target, _ in mounts if not os.path.lexists(target) for a in _ancestors(target)}
    _populate("/", root, mirrored, root)
    for target, m in sorted(mounts, key=lambda item: item[0].count("/")):
        dest = root + target
        if not os.path.lexists(dest):
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            if os.path.isdir(m["source"]):
                os.mkdir(dest)
            else:
                open(dest, "w").close()
        bind(m["source"], dest, readonly=bool(m.get("readonly")))
    os.makedirs(root + "/proc", exist_ok=True)
    _mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    return root


def run_container(spec: dict, parent_alive: int) -> None:
    """PID 1 of the Pod's PID namespace: never returns."""
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if select.select([parent_alive], [], [], 0)[0]:  # EOF: podinit died before prctl
        os._exit(137)
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    root = build_root(spec)
    socket.sethostname(spec["hostname"])
    os.chroot(root)
    os.makedirs(spec["cwd"], exist_ok=True)
    os.chdir(spec["cwd"])
    os.execvpe(spec["argv"][0], spec["argv"], spec["env"])


def main(spec_path: str) -> int:
    with open(spec_path) as f:
        spec = json.load(f)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != spec["parent_pid"]:  # the kubelet died before prctl
        return 137
    _check(libc.unshare(CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWPID), "unshare")
    alive_r, alive_w = os.pipe()  # never written: EOF tells the child that podinit is gone
    started_r, started_w = os.pipe()  # close-on-exec: EOF once the child execs (or dies)
    pid = os.fork()
    if pid == 0:
        os.close(alive_w)
        os.close(started_r)
        try:
            run_container(spec, alive_r)
        except BaseException as exc:  # noqa: BLE001 - reported as the container's failure
            print(f"podinit: cannot start {spec['argv']!r}: {exc}", file=sys.stderr, flush=True)
        os._exit(128)
    os.close(started_w)

    def relay(signum, _frame) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)

    for sig in RELAYED_SIGNALS:
        signal.signal(sig, relay)
    os.read(started_r, 1)  # the pid file appears only once the container's root is in place
    with open(spec["pid_file"] + ".tmp", "w") as f:
        f.write(str(pid))
    os.replace(spec["pid_file"] + ".tmp", spec["pid_file"])
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
