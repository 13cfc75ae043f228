"""The Python tool's sandbox (scripts/sandbox.py: bubblewrap, rlimits, a user per slot): each way model-written code
might escape or exhaust the host gets an error result naming what stopped it, promptly, and leaves nothing
behind; the next call runs as if nothing happened. Real bwrap, real processes: no mocks.

Run: bash run.sh test tests/test_sandbox.py      (~30 s)
"""
import asyncio
import glob
import os
import socket
import subprocess
import tempfile
import time

import pytest

from conftest import REPO
from scripts import sandbox
from scripts.sandbox import Limits, run_python

LIMITS = Limits(wall_s=8.0, cpu_s=2, memory_mb=512, nproc=64, file_mb=16, output_bytes=16384)


def run(code: str, limits: Limits = LIMITS) -> sandbox.Result:
    return asyncio.run(run_python(code, limits))


def sandbox_processes() -> list:
    """Processes of the sandboxes' users (one per slot)."""
    uids = ",".join(str(sandbox.FIRST_UID + i) for i in range(LIMITS.slots))
    out = subprocess.run(["ps", "-u", uids, "-o", "pid=,cmd="], capture_output=True, text=True)
    return out.stdout.split("\n") if out.stdout.strip() else []


def none_left():
    """No process of a sandbox's user outlives its sandbox (its PID namespace dies with it)."""
    deadline = time.time() + 10
    while sandbox_processes() and time.time() < deadline:
        time.sleep(0.2)
    assert not sandbox_processes(), sandbox_processes()


def test_plain_code_runs_and_reports_its_failure():
    assert run("print(6 * 7)") == sandbox.Result("42\n", None, 0)
    crash = run("raise ValueError('boom')")
    assert crash.error == "exit status 1" and "ValueError: boom" in crash.output


def test_an_infinite_loop_is_stopped_by_its_cpu_limit():
    t0 = time.time()
    r = run("while True:\n    pass")
    # CPU time (SIGXCPU at cpu_s) or, on a machine too busy to give it 2 s of CPU in 8, the wall clock
    assert r.error in ("killed by signal 24 (over 2 s of CPU time)", "no end after 8 s of wall time: stopped"), r
    assert time.time() - t0 < LIMITS.wall_s + 5
    none_left()


def test_a_sleeper_is_stopped_by_the_wall_clock():
    r = run("import time\ntime.sleep(100)", Limits(wall_s=1.0))
    assert r.error == "no end after 1 s of wall time: stopped", r
    none_left()


def test_ten_gigabytes_are_refused():
    r = run("x = bytearray(10 * 2**30)\nprint('allocated')")
    assert "MemoryError" in r.output and "allocated" not in r.output and r.error == "exit status 1", r


def test_a_fork_bomb_runs_out_of_processes_and_leaves_none():
    code = ("import os, time\nn = 0\ntry:\n    while n < 1000:\n        if os.fork() == 0:\n"
            "            time.sleep(60)\n            os._exit(0)\n        n += 1\n"
            "except OSError as e:\n    print('refused after', n, e.errno)\n")
    r = run(code)
    assert r.output.startswith("refused after") and int(r.output.split()[2]) < LIMITS.nproc, r
    none_left()  # the children, still sleeping, died with the sandbox's PID namespace


def test_nothing_outside_the_scratch_directory_is_readable_or_writable():
    inside = run("import os\nopen('mine.txt', 'w').write('ok')\nprint(open('mine.txt').read(), os.getcwd())")
    assert inside.output.split() == ["ok", "/scratch"], inside
    for path in ("/etc/passwd", str(REPO / "README.md"), os.path.expanduser("~/.bashrc")):
        r = run(f"print(open({path!r}).read()[:20])")
        assert "FileNotFoundError" in r.output and r.error == "exit status 1", (path, r)
    r = run("open('/usr/escape', 'w').write('x')")
    assert "Read-only file system" in r.output, r
    assert not os.path.exists("/usr/escape")


def test_no_network_not_even_the_hosts_loopback():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    try:
        r = run(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')")
        assert "ConnectionRefusedError" in r.output and "connected" not in r.output.split("\n")[-2:], r
        r = run("import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=2)\nprint('connected')")
        assert "Network is unreachable" in r.output, r
    finally:
        server.close()


def test_megabytes_of_output_are_cut_at_the_limit():
    t0 = time.time()
    r = run("while True:\n    print('x' * 1000)")
    assert r.error == "output over 16384 bytes: cut, and the code stopped", r
    assert len(r.output) == LIMITS.output_bytes and time.time() - t0 < LIMITS.wall_s
    big = run("open('f', 'wb').write(b'0' * (100 * 2**20))")
    assert "File too large" in big.output, big
    none_left()


def test_a_burst_of_output_past_the_limit_ends_the_call():
    """A megabyte written at once fills asyncio's buffer, which then stops reading the pipe: unless
    the pipe is read to its end after the kill, the wait for the process never returns (a CI run
    hung here). Bounded, so a regression fails rather than hangs."""
    code = "import sys, time\nsys.stdout.write('x' * 2**20)\nsys.stdout.flush()\ntime.sleep(60)"
    r = asyncio.run(asyncio.wait_for(run_python(code, Limits(wall_s=120)), 60))
    assert r.error == "output over 16384 bytes: cut, and the code stopped", r
    assert len(r.output) == LIMITS.output_bytes
    none_left()


def test_a_call_its_caller_stops_waiting_for_leaves_no_process():
    """The actor bounds each environment step (actor.step_timeout_s): a sandbox that outlives the wait
    would run on with nobody reading it."""
    async def main():
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(run_python("import time\ntime.sleep(60)", Limits(wall_s=60)), 1.0)
    asyncio.run(main())
    none_left()


def test_sandboxes_at_once_each_have_their_own_process_limit():
    """A fork bomb holding its whole process limit while sixteen other calls run: each of them runs. With
    one user for every sandbox (RLIMIT_NPROC counts a user's processes) they failed to start, as tool
    calls of a run did ("bwrap: Creating new namespace failed: Resource temporarily unavailable")."""
    bomb = "import os, time\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        time.sleep(0.2)"

    async def main():
        held = asyncio.create_task(run_python(bomb, Limits(wall_s=6.0, cpu_s=5)))
        await asyncio.sleep(2.0)  # the bomb has forked to its limit
        others = await asyncio.gather(*(run_python(f"print({i})", LIMITS) for i in range(LIMITS.slots - 1)))
        return await held, others
    held, others = asyncio.run(main())
    assert held.error.startswith("no end after 6 s"), held
    assert [r.output for r in others] == [f"{i}\n" for i in range(LIMITS.slots - 1)], others
    none_left()


def test_scratch_directories_are_removed_and_the_next_call_runs():
    before = set(glob.glob(os.path.join(tempfile.gettempdir(), "pipelinerl-tool-*")))
    run("open('junk', 'wb').write(b'1' * 1000)")
    run("while True:\n    pass", Limits(wall_s=0.5))
    assert set(glob.glob(os.path.join(tempfile.gettempdir(), "pipelinerl-tool-*"))) == before
    assert run("print('still here')").output == "still here\n"


def test_the_callers_event_loop_keeps_running():
    """A slow tool never blocks the actor's loop: other work goes on while it runs."""
    async def main():
        ticks = 0

        async def tick():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.05)
                ticks += 1
        task = asyncio.ensure_future(tick())
        r = await run_python("import time\ntime.sleep(1)\nprint('done')", LIMITS)
        task.cancel()
        return r, ticks
    r, ticks = asyncio.run(main())
    assert r.output == "done\n" and ticks >= 10, (r, ticks)


def test_a_missing_interpreter_names_the_fix():
    with pytest.raises(sandbox.SandboxUnavailable, match="no interpreter at /nonexistent/python3"):
        run("print(1)", Limits(python="/nonexistent/python3"))
