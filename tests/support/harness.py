"""What the process-level tests and the benchmarks' guest helpers share (tests/examples/echo_test.py
and hostile_test.py, tests/cluster/cluster_test.py, tools/lib/bench_*_inside.py): a server process
with its log, waits with a bound, a port counter, and the kernel's count of a process's RDMA
objects (restrack, through iproute2's `rdma`).

Each user puts this folder on sys.path and imports it: `import harness`."""
import json
import os
import re
import shutil
import signal
import subprocess
import time

RDMA_KINDS = ("qp", "cq", "mr", "pd", "cm_id")


class Failure(Exception):
    pass


def check(cond, what):
    if not cond:
        raise Failure(what)


def wait_until(cond, timeout, what, interval=0.05):
    """Polls cond() until it holds; after `timeout` seconds fails naming `what` (or what())."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(interval)
    raise Failure(f"not within {timeout}s: {what() if callable(what) else what}")


def listening(port):
    """Whether a TCP socket listens on `port` here (perftest's and rdma_cm's iWARP servers)."""
    out = subprocess.run(["ss", "-Hltn", f"sport = :{port}"], capture_output=True, text=True).stdout
    return bool(out.strip())


class Ports:
    """Consecutive port numbers after `first`, one per server (a port just closed may linger)."""

    def __init__(self, first):
        self.last = first

    def next(self):
        self.last += 1
        return self.last


class Server:
    """A server process whose output goes to `log`; ready once `ready` is in it (within
    `ready_timeout` s, else it is killed and Failure). `interval`: how often the log is read
    while waiting."""

    def __init__(self, cmd, log, ready="listening on", ready_timeout=20, interval=0.05):
        self.log = log
        self.interval = interval
        self.proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT)
        try:
            self.wait_for(ready, ready_timeout)
        except Failure:
            self.end()  # never ready: not left running beside what comes next
            raise

    def text(self):
        with open(self.log) as f:
            return f.read()

    def wait_for(self, pattern, timeout, count=1):
        """Until the log holds `pattern` (a regex) `count` times; Failure if the process ends
        first or `timeout` s pass."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if len(re.findall(pattern, self.text())) >= count:
                return
            if self.proc.poll() is not None:
                raise Failure(f"server exited ({self.proc.returncode}) before '{pattern}':\n{self.text()}")
            time.sleep(self.interval)
        # The first line is what a test's summary and CI's excerpt show: how many were found,
        # and the log's last lines (a close for another reason says itself there).
        text = self.text()
        last = " | ".join(text.strip().splitlines()[-3:])[-600:]
        raise Failure(f"server: no '{pattern}' (x{count}; {len(re.findall(pattern, text))} found) within "
                      f"{timeout}s; its last lines: {last}\n{text}")

    def stop(self, sig=signal.SIGTERM, timeout=30, backtrace=True):
        """Sends `sig` (unless it ended already) and gives its exit status; if it does not end
        within `timeout` s: its threads' backtraces (gdb, when `backtrace` and installed), then
        SIGKILL and Failure."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            if backtrace and shutil.which("gdb"):
                try:  # bounded: a process stuck in the kernel can hold gdb's attach too
                    subprocess.run(["gdb", "-batch", "-p", str(self.proc.pid), "-ex", "thread apply all bt"],
                                   timeout=60)
                except subprocess.TimeoutExpired:
                    print("harness: gdb did not finish within 60 s", flush=True)
            self.proc.kill()
            raise Failure(f"server did not exit within {timeout}s of {sig.name}:\n{self.text()}")


    def end(self, grace=5):
        """SIGTERM (which tools/on-node passes on to the other node; SIGKILL would leave the
        remote process running), SIGKILL after `grace` s."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def finish(self, timeout=60):
        """For a server that ends by itself (perftest's, after one run): its exit status, or
        None when it did not end within `timeout` s and was ended (end())."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.end()
            return None


def restrack_list(kind, runner=None, where=""):
    """The kernel's `kind` objects (qp, cq, mr, pd, cm_id) as `rdma -j resource show` lists them;
    `runner(cmd)` gives (status, stdout, stderr) for another host (default: here), `where`
    names it in the Failure when the command fails."""
    cmd = ["rdma", "-j", "resource", "show", kind]
    if runner is None:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        rc, out, err = r.returncode, r.stdout, r.stderr
    else:
        rc, out, err = runner(cmd)
    check(rc == 0, f"rdma resource show {kind}{where}: {err}")
    return json.loads(out or "[]")


def process_tasks(pid):
    """The thread ids of process `pid` (restrack names the thread that made an object), or None
    once it is gone."""
    try:
        return {int(t) for t in os.listdir(f"/proc/{pid}/task")} | {pid}
    except FileNotFoundError:
        return None


def restrack(pid, kinds=RDMA_KINDS):
    """How many objects of each kind the kernel lists for process `pid` (any of its threads
    counts), or None once the process is gone. Read until two reads in a row agree (at most 5):
    echo and hostile run side by side, and a dump taken while another test makes and ends
    hundreds of QPs may miss some (with 4096 QPs the soak once saw none of its own)."""
    last = None
    for _ in range(5):
        tasks = process_tasks(pid)
        if tasks is None:
            return None
        now = {kind: sum(1 for o in restrack_list(kind) if o.get("pid") in tasks) for kind in kinds}
        if now == last:
            break
        last = now
    return now


def registered_bytes(pid):
    """How many bytes process `pid` has registered (the lengths of its memory regions), or None
    once it is gone."""
    tasks = process_tasks(pid)
    if tasks is None:
        return None
    return sum(int(o.get("mrlen", 0)) for o in restrack_list("mr") if o.get("pid") in tasks)
