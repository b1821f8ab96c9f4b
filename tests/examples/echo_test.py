#!/usr/bin/env python3
"""The echo server and client (examples/echo_server/, echo_client.cpp) as processes, on a
real RDMA device, under normal use and abuse.

    echo_test.py BUILD_DIR [CASE...]

Needs a device (tools/softroce-vm runs it in the Soft-RoCE VM): exits 77 (SKIP) without one.
Every case starts its own server on its own port at $RINGVERBS_ADDR (the VM's address), with
$ECHO_SERVER_ARGS added to its options when set (e.g. "--mode busy").
Resources the server holds are counted from outside: its QPs and MRs with the iproute2 `rdma`
tool (the kernel's restrack, per pid), its fds in /proc/PID/fd.
"""
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))
import harness  # noqa: E402  (tests/support/harness.py)
from harness import Failure, check, wait_until  # noqa: E402

BUILD = os.path.abspath(sys.argv[1])
SERVER = os.path.join(BUILD, "examples", "echo_server")
CLIENT = os.path.join(BUILD, "examples", "echo_client")
ADDR = os.environ.get("RINGVERBS_ADDR", "")
TMP = tempfile.mkdtemp(prefix="echo_test.")


class NotApplicable(Exception):
    """The case needs what this transport lacks: reported as such, never as passed."""


IWARP = os.environ.get("RINGVERBS_TRANSPORT") == "iwarp"


def needs_rnr():
    if IWARP:
        raise NotApplicable("iWARP has no RNR: a SEND that finds no receive posted ends the connection")


def have_device():
    return os.path.isdir("/sys/class/infiniband") and os.listdir("/sys/class/infiniband")


class Server(harness.Server):
    def __init__(self, port, *args, address=None, wrapper=()):
        """`wrapper`: a command line the server runs under (e.g. prlimit), which execs it."""
        self.port = port
        super().__init__([*wrapper, SERVER, "--address", address or ADDR, "--port", str(port), *args],
                         os.path.join(TMP, f"server.{port}.log"))

    def rdma_counts(self, kinds=harness.RDMA_KINDS):
        """The server's objects in the kernel's restrack, by kind."""
        counts = harness.restrack(self.proc.pid, kinds)
        check(counts is not None, f"the server exited ({self.proc.poll()}):\n{self.text()}")
        return counts

    def rdma_objects(self, kind):
        """How many `kind` (qp, mr) objects the kernel's restrack lists for the server."""
        return self.rdma_counts((kind,))[kind]

    def fds(self):
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))


def client(port, *args, timeout=600):
    """Runs a client to its end: (exit status, stdout, stderr)."""
    r = subprocess.run([CLIENT, "--address", ADDR, "--port", str(port), *args], capture_output=True, text=True,
                       timeout=timeout)
    return r.returncode, r.stdout, r.stderr


def start_client(port, *args):
    log = os.path.join(TMP, f"client.{port}.{time.monotonic_ns()}.log")
    p = subprocess.Popen([CLIENT, "--address", ADDR, "--port", str(port), *args], stdout=open(log, "w"),
                         stderr=subprocess.STDOUT)
    p.log = log
    return p


def text_of(p):
    with open(p.log) as f:
        return f.read()


def verified(stdout):
    m = re.search(r"(\d+) of (\d+) messages \((\d+) bytes\) echoed and verified", stdout)
    check(m, f"no verified count in the client's output:\n{stdout}")
    return int(m.group(1)), int(m.group(2)), int(m.group(3))


def connect_summary(stdout):
    """The client's connect summary: (established, clients, at a time, retried attempts, failures)."""
    m = re.search(r"(\d+) of (\d+) connection\(s\) established, (\d+) set up at a time: connect p50 [\d.]+ ms, "
                  r"p99 [\d.]+ ms; (\d+) retried attempt\(s\); connect failures: (.*)", stdout)
    check(m, f"no connect summary in the client's output:\n{stdout}")
    return int(m.group(1)), int(m.group(2)), int(m.group(3)), int(m.group(4)), m.group(5)


def json_of(stdout):
    line = next((l for l in stdout.splitlines() if l.startswith("{")), None)
    check(line, f"no JSON line in the client's output:\n{stdout}")
    return json.loads(line)


# --- the cases ----------------------------------------------------------------------------
# A wait for a close's reason gives it 60 s: more than the server's grace (30 s) for the client's
# DISCONNECTED after an echo send it cut off, which siw in a loaded guest once delivered more
# than 10 s late (the grace was 10 s then, and the close named the failed send instead).

def case_sixteen_clients():
    """16 connections x 10,000 messages, every byte verified, in one client process."""
    s = Server(19001, *os.environ.get("ECHO_SERVER_ARGS", "").split())
    counts = []
    try:
        rc, out, err = client(s.port, "--clients", "16", "--count", "10000", "--inflight", "4", "--size", "256")
        print(out + err, end="")
        check(rc == 0, f"client exit {rc}")
        got, want, nbytes = verified(out)
        check(got == want == 160000 and nbytes == 160000 * 256, f"verified {got} of {want}")
        check(connect_summary(out)[:2] == (16, 16), "16 of 16 connected")
        # (Linux 6.1's Soft-RoCE may leave a few receives unflushed: the server says so and
        # waits 5 s for them before it lets the QP go.)
        closed = r"closed \(the client disconnected[^\n]* after (\d+) messages"
        s.wait_for(closed, 60, count=16)
        # The server counts a message once its echo's send completed. The client has every
        # reply, but may disconnect before the server's QP got the ACK of the last ones (6.12's
        # rxe acknowledges from a work queue): up to --inflight sends of a connection then end
        # flushed, not counted.
        counts = [int(n) for n in re.findall(closed, s.text())]
        check(all(10000 - 4 <= n <= 10000 for n in counts), f"server counts {counts}")
    finally:
        check(s.stop() == 0, "server exit status")
    check(f"16 connection(s) served, {sum(counts)} messages" in s.text(), "server summary")


def case_killed_client():
    """kill -9 of a client mid-stream: the server releases its QP, MR and fds and keeps serving
    (--no-srq: each connection has its own MR)."""
    s = Server(19002, "--no-srq")
    try:
        # One client first: whatever the server opens once (per device) is open by then.
        rc, out, err = client(s.port, "--count", "10")
        check(rc == 0, f"first client: {out}{err}")
        wait_until(lambda: s.rdma_objects("qp") == 0, 30, "the first client's QP destroyed")
        base_fds = s.fds()
        check(s.rdma_objects("mr") == 0, "no MR between clients")
        # The doomed client's 2 connections first, then the steady one: started together, the
        # steady client's 20,000 messages could be done before the doomed one connected (seen on
        # siw beside the hostile flood: "3 connections open" never true, 2 QPs).
        doomed = start_client(s.port, "--count", "100000000", "--inflight", "8", "--clients", "2")
        wait_until(lambda: s.rdma_objects("qp") == 2, 30,
                   lambda: f"the doomed client's 2 connections open ({s.rdma_objects('qp')} QPs):\n{text_of(doomed)}")
        # Its QP is there from its connect to its end, 20,000 round trips later (seconds).
        steady = start_client(s.port, "--count", "20000", "--inflight", "2")
        wait_until(lambda: s.rdma_objects("qp") == 3, 30,
                   lambda: f"3 connections open ({s.rdma_objects('qp')} QPs):\n{text_of(steady)}")
        check(s.rdma_objects("mr") == 3, "one MR per connection")
        time.sleep(1)  # mid-stream
        doomed.kill()
        doomed.wait()
        s.wait_for(r"closed \(the client disconnected", 60, count=2)
        rc = steady.wait(600)
        out = text_of(steady)
        print(out, end="")
        check(rc == 0, f"the other client failed ({rc})")
        check(verified(out)[0] == 20000, "the other client's messages")
        s.wait_for(r"closed \(the client disconnected", 60, count=3)
        wait_until(lambda: s.rdma_objects("qp") == 0, 30, "the server's QPs all destroyed")
        check(s.rdma_objects("mr") == 0, "the server's MRs all deregistered")
        check(s.fds() == base_fds, f"server fds {s.fds()}, {base_fds} before")
        print(f"killed client: server back to 0 QPs, 0 MRs, {base_fds} fds")
    finally:
        check(s.stop() == 0, "server exit status")


def case_killed_client_reason():
    """kill -9 of a client mid-stream, four times per way of serving (own receives at --depth 64
    and 2, the SRQ): each connection closes as "the client disconnected". Before (siw, 8 kills
    each): --depth 1 closed 5 of 8 as "ibv_post_recv: never flushed by the device" (a receive
    posted after the error, which siw never flushes) and 1 with no reason at all (DISCONNECTED,
    then a send cut off: nobody closed); --no-srq 1 of 8 as "ibv_post_send(SEND): Transport
    endpoint is not connected"."""
    port = 19600
    wrong = []
    # --depth 2, not 1, beside one message in flight: on iWARP (no RNR) the client's next message
    # may arrive before the server posted its one receive again, which ends the connection
    # (siw: "local work queue catastrophic error"); echo_client warns of it.
    for args, inflight in ((["--no-srq"], "8"), (["--no-srq", "--depth", "2"], "1"), ([], "8")):
        for _ in range(4):
            port += 1
            s = Server(port, *args)
            try:
                c = start_client(port, "--count", "100000000", "--inflight", inflight)
                # Connected (a slow start under load: 1 s was not always enough), then mid-stream.
                wait_until(lambda: s.rdma_objects("qp") >= 1 or c.poll() is not None, 30,
                           "the client's connection")
                check(c.poll() is None, f"the client ended before the kill: {text_of(c)}")
                time.sleep(0.5)
                c.kill()
                c.wait()
                # Within the server's bounds: DISCONNECTED's grace after a send cut off (30 s),
                # the disconnect's (2 s) and the flushes' (5 s).
                s.wait_for(r"closed \(", 60)
                wrong += [f"{' '.join(args) or 'SRQ'}: {why}" for why in
                          re.findall(r"closed \((.*)\) after \d+ messages", s.text())
                          if not why.startswith("the client disconnected")]
            finally:
                check(s.stop() == 0, "server exit status")
    check(not wrong, f"connections closed for another reason: {wrong}")
    print("killed client: 12 connections, each closed as 'the client disconnected'")


def case_oversized():
    """A message larger than the server's receives: an error on that connection only, named as
    such, with the shared receive queue and with --no-srq (whose disconnect watch lets the CQ
    name the failure before it closes for the client's disconnect)."""
    # --no-srq on IB/RoCE only: siw may end the QP (its "local work queue catastrophic error")
    # before the receive's own error completion, so the server sees the client's end first.
    for port, args in ((19003, ()),) + (() if IWARP else ((19022, ("--no-srq",)),)):
        s = Server(port, "--max-size", "1024", *args)
        try:
            good = start_client(s.port, "--count", "3000", "--size", "1024")
            rc, out, err = client(s.port, "--count", "10", "--size", "4096")
            print(err, end="")
            check(rc == 1, f"oversized client exit {rc}")
            check("the server takes 1024" in err, "the client's error names the server's limit")
            named = r"closed \(a message larger than 1024 bytes \(receive failed: "
            if IWARP:
                # siw may end the QP ("local work queue catastrophic error", an async event the
                # runtime routes to that QP) before its receive's error completion is read; the
                # client's disconnect then closes the connection first.
                named = f"(?:{named}|device \\S+: local work queue catastrophic error)"
            s.wait_for(named, 30)
            check(good.wait(600) == 0, "the well-behaved client failed:\n" + text_of(good))
            check(verified(text_of(good))[0] == 3000, "well-behaved client's messages")
            wait_until(lambda: s.rdma_objects("qp") == 0, 30, "the server's QPs all destroyed")
        finally:
            check(s.stop() == 0, "server exit status")


def case_flood():
    """A client keeping 4x more messages in flight than the server posts receives (RNR flow
    control: slow on rxe, hence few messages) next to a polite one: both get every message back,
    verified."""
    needs_rnr()
    s = Server(19008, "--depth", "16", "--no-srq")
    try:
        polite = start_client(s.port, "--count", "2000", "--size", "512")
        rc, out, err = client(s.port, "--count", "400", "--inflight", "64", "--size", "1024")
        print(out + err, end="")
        check(rc == 0 and verified(out)[0] == 400, f"flooding client ({rc})")
        check(polite.wait(600) == 0 and verified(text_of(polite))[0] == 2000, "polite client:\n" + text_of(polite))
    finally:
        check(s.stop() == 0, "server exit status")


def case_refused_unreachable_no_device():
    """Clear errors: nothing listens, no route, no such device, address in use, bad options."""
    rc, out, err = client(19004, "--count", "1")
    print(err, end="")
    check(rc == 1 and "Connection refused" in err and "nothing listens" in err, "refusal")
    check("attempts)" not in err and connect_summary(out)[3:] == (0, "no_listener 1"), "refused at once, not retried")
    r = subprocess.run([CLIENT, "--address", "198.19.0.1", "--port", "19004"], capture_output=True, text=True,
                       timeout=60)
    print(r.stderr, end="")
    check(r.returncode == 1 and "cannot reach 198.19.0.1" in r.stderr and "unreachable" in r.stderr, "no route")
    r = subprocess.run([CLIENT, "--address", ADDR, "--device", "nope"], capture_output=True, text=True, timeout=60)
    check(r.returncode == 1 and "no RDMA device called 'nope'" in r.stderr, "no such device")
    r = subprocess.run([SERVER, "--device", "nope"], capture_output=True, text=True, timeout=60)
    check(r.returncode == 1 and "no RDMA device called 'nope'" in r.stderr, "server: no such device")
    s = Server(19005)
    try:
        r = subprocess.run([SERVER, "--address", ADDR, "--port", "19005"], capture_output=True, text=True, timeout=60)
        print(r.stderr, end="")
        check(r.returncode == 1 and "Address already in use" in r.stderr, "address in use")
    finally:
        check(s.stop() == 0, "server exit status")
    for exe in (SERVER, CLIENT):
        r = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=60)
        check(r.returncode == 0 and "usage:" in r.stdout and "--port" in r.stdout, f"{exe} --help")
        r = subprocess.run([exe, "--port", "x"], capture_output=True, text=True, timeout=60)
        check(r.returncode == 2 and "--port wants a number" in r.stderr, f"{exe}: bad option")


def case_client_interrupted():
    """SIGINT stops a client mid-stream with a clean disconnect; the server goes on."""
    s = Server(19006)
    try:
        c = start_client(s.port, "--count", "100000000", "--inflight", "4")
        wait_until(lambda: s.rdma_objects("qp") == 1, 30, "connected")
        time.sleep(1)
        c.send_signal(signal.SIGINT)
        rc = c.wait(60)
        print(text_of(c), end="")
        check(rc == 130, f"interrupted client exit {rc}")
        check("interrupted after" in text_of(c), "the client says it was interrupted")
        s.wait_for(r"closed \(the client disconnected", 60)
        rc, out, err = client(s.port, "--count", "500")
        check(rc == 0 and verified(out)[0] == 500, "the server serves the next client")
    finally:
        check(s.stop() == 0, "server exit status")


def case_server_shutdown():
    """SIGTERM with connections open: every one closed, the server exits 0, clients told."""
    s = Server(19007, *os.environ.get("ECHO_SERVER_ARGS", "").split())
    c = start_client(s.port, "--count", "100000000", "--inflight", "4", "--clients", "3")
    wait_until(lambda: s.rdma_objects("qp") == 3, 30,
               lambda: f"3 connections open ({s.rdma_objects('qp')} QPs); client:\n{text_of(c)}")
    time.sleep(1)
    check(s.stop(signal.SIGTERM) == 0, "server exit status after SIGTERM")
    text = s.text()
    check(text.count("closed (the server is shutting down") == 3, "3 connections closed by the shutdown")
    check("shut down: 3 connection(s) served" in text, "server summary")
    rc = c.wait(60)
    out = text_of(c)
    print(out, end="")
    check(rc == 1 and out.count("the server closed the connection after") == 3, f"client told ({rc})")


def case_max_connections():
    """--max-connections 4: of 8 clients at once (one attempt each) 4 are served and 4 rejected
    with the server's reason; with 4 held open, more attempts are rejected, no resources made for them; the server
    goes on serving."""
    s = Server(19009, "--max-connections", "4")
    busy = "the server rejected the connection: busy: 4 connections, the server's limit"
    try:
        # 8 connections in one process, long enough that none ends before the last request.
        rc, out, err = client(s.port, "--clients", "8", "--count", "5000", "--connect-attempts", "1")
        print(out + err, end="")
        check(rc == 1, f"8 clients against 4: exit {rc}")
        check(err.count(busy) == 4, f"4 connections rejected with the reason ({err.count(busy)})")
        got, want, _ = verified(out)
        check(got == 4 * 5000 and want == 8 * 5000, f"4 connections served: {got} of {want} verified")
        check(connect_summary(out) == (4, 8, 8, 0, "busy 4"), "summary: 4 of 8 connected, 4 busy")
        s.wait_for(r"request from \S+ rejected \(busy: 4 connections", 30, count=4)
        s.wait_for(r"closed \(the client disconnected", 60, count=4)
        wait_until(lambda: s.rdma_objects("qp") == 0, 30, "the server's QPs all destroyed")
        # 4 held open, then 3 more attempts.
        held = start_client(s.port, "--count", "100000000", "--inflight", "2", "--clients", "4")
        wait_until(lambda: s.rdma_objects("qp") == 4, 30,
                   lambda: f"4 connections open ({s.rdma_objects('qp')} QPs); client:\n{text_of(held)}")
        rc, out, err = client(s.port, "--clients", "3", "--count", "10", "--connect-attempts", "1")
        print(err, end="")
        check(rc == 1 and err.count(busy) == 3, f"3 more attempts rejected with the reason ({rc})")
        s.wait_for(r"rejected \(busy: 4 connections", 30, count=7)
        check(s.rdma_objects("qp") == 4, f"nothing made for the rejected ({s.rdma_objects('qp')} QPs)")
        check(held.poll() is None, "the held connections go on")
        held.send_signal(signal.SIGINT)
        rc = held.wait(60)
        check(rc == 130, f"held client exit {rc}:\n{text_of(held)}")
        s.wait_for(r"closed \(the client disconnected", 60, count=8)
        # Slots are free again once the connections' resources are released.
        wait_until(lambda: s.rdma_objects("qp") == 0, 30, "the held connections' QPs destroyed")
        rc, out, err = client(s.port, "--clients", "4", "--count", "500")
        check(rc == 0 and verified(out)[0] == 2000, f"the server serves 4 again ({rc}):\n{out}{err}")
    finally:
        check(s.stop() == 0, "server exit status")
    check("7 request(s) rejected as busy" in s.text(), "server summary counts the rejects")


def case_idle_timeout():
    """--idle-timeout 4: a client frozen mid-stream (SIGSTOP) is dropped with the reason in the
    server's log, and after SIGCONT says the server closed the connection (promptly, also on
    iWARP); a busy client is not (4 s, not 2: a busy client stalled 2 s in a loaded 2-vCPU
    guest would read as idle)."""
    s = Server(19010, "--idle-timeout", "4")
    try:
        frozen = start_client(s.port, "--count", "100000000", "--inflight", "2")
        wait_until(lambda: s.rdma_objects("qp") == 1, 30, lambda: f"connected; client:\n{text_of(frozen)}")
        time.sleep(0.5)  # mid-stream
        frozen.send_signal(signal.SIGSTOP)
        try:
            s.wait_for(r"closed \(idle: no message for 4 s \(--idle-timeout 4\)\) after \d+ messages", 60)
            wait_until(lambda: s.rdma_objects("qp") == 0, 30, "the idle connection's QP destroyed")
        finally:
            frozen.send_signal(signal.SIGCONT)
            resumed = time.monotonic()
        rc = frozen.wait(60)
        told = time.monotonic() - resumed
        out = text_of(frozen)
        print(out, end="")
        print(f"the frozen client ended {told:.1f} s after SIGCONT")
        check(rc == 1 and "the server closed the connection after" in out, f"the frozen client told ({rc})")
        # From rdma_cm's DISCONNECTED, not its --reply-timeout (30 s): on siw the receives and
        # sends it posts after SIGCONT go to a QP the kernel failed already, and never complete.
        check(told < 20, f"the frozen client took {told:.1f} s after SIGCONT")
        # A client that keeps sending for longer than the timeout stays connected.
        busy = start_client(s.port, "--count", "100000000", "--inflight", "2")
        wait_until(lambda: s.rdma_objects("qp") == 1, 30, lambda: f"connected; client:\n{text_of(busy)}")
        time.sleep(6)
        check(busy.poll() is None, f"a busy client was dropped:\n{text_of(busy)}")
        busy.send_signal(signal.SIGINT)
        rc = busy.wait(60)
        check(rc == 130, f"busy client exit {rc}:\n{text_of(busy)}")
        s.wait_for(r"closed \(the client disconnected", 60)
        check(s.text().count("closed (idle") == 1, "only the frozen client closed as idle")
    finally:
        check(s.stop() == 0, "server exit status")


def case_shared_receive_queue():
    """The shared receive queue (the default): 16 connections x 2,000 messages through one SRQ,
    verified; the registered memory is the pool's, whatever the connections; a killed client's
    QP goes and the others go on; SIGINT with 2 connections open closes them, tells the client,
    exits 0."""
    s = Server(19013, "--srq-depth", "256")
    try:
        check("a shared receive queue of 256 buffers" in s.text(), "the listen line names the srq")
        victim = start_client(s.port, "--clients", "1", "--count", "100000000", "--inflight", "4")
        wait_until(lambda: s.rdma_objects("qp") == 1, 30, "the victim's QP")
        time.sleep(0.5)
        victim.kill()
        victim.wait()
        rc, out, err = client(s.port, "--clients", "16", "--count", "2000", "--inflight", "4", "--size", "256")
        print(out + err, end="")
        check(rc == 0, f"client exit {rc}")
        got, want, nbytes = verified(out)
        check(got == want == 32000 and nbytes == 32000 * 256, f"verified {got} of {want}")
        # Any reason, parentheses in it too: the killed victim's may be "the client disconnected
        # (a request was cut off in flight)" (a CI run waited 60 s for a 17th close it had).
        s.wait_for(r"closed \(.*\) after \d+ messages", 60, count=17)
        wait_until(lambda: s.rdma_objects("qp") == 0, 30, lambda: f"{s.rdma_objects('qp')} QPs left")
        # One MR (the shared pool), not one per connection.
        check(s.rdma_objects("mr") == 1, f"{s.rdma_objects('mr')} MRs registered")
        # A client still sending when the server stops is closed and told.
        lingering = start_client(s.port, "--clients", "2", "--count", "100000000", "--inflight", "4")
        wait_until(lambda: s.rdma_objects("qp") == 2, 30, "the lingering client's QPs")
        time.sleep(0.5)
    finally:
        status = s.stop(signal.SIGINT)
        check(status == 0, f"server exit status {status}:\n{s.text()}")
    lingering.wait(60)
    check("the server closed the connection" in text_of(lingering), text_of(lingering))
    check("19 connection(s) served" in s.text(), "server summary")


def case_connect_concurrency():
    """64 connections set up 8 at a time (--connect-concurrency 8): all connected and verified,
    the connect summary printed (and in --json)."""
    s = Server(19011)
    try:
        rc, out, err = client(s.port, "--clients", "64", "--connect-concurrency", "8", "--count", "200", "--json")
        print(out + err, end="")
        check(rc == 0, f"client exit {rc}")
        got, want, _ = verified(out)
        check(got == want == 64 * 200, f"verified {got} of {want}")
        established, clients, at_a_time, _, failures = connect_summary(out)
        check((established, clients, at_a_time, failures) == (64, 64, 8, "none"), "64 of 64 connected, 8 at a time")
        j = json_of(out)
        check(j["connected"] == 64 and j["connect_concurrency"] == 8 and j["connect_failures"] == {}, f"JSON: {j}")
        check(0 < j["connect_p50_ms"] <= j["connect_p99_ms"], f"JSON connect times: {j}")
        s.wait_for(r"closed \(the client disconnected", 60, count=64)
    finally:
        check(s.stop() == 0, "server exit status")
    check("64 connection(s) served" in s.text(), "server summary")


def case_busy_retry():
    """--max-connections 2 with 2 held open: connections rejected as busy are retried with backoff
    and, while the 2 stay, reported as busy after --connect-attempts; once they go, retrying ones
    are served; 4 short clients at once against 2 slots are all served in the end."""
    s = Server(19012, "--max-connections", "2")
    busy = "the server rejected the connection: busy: 2 connections, the server's limit"
    rejects = r"rejected \(busy: 2 connections"
    try:
        held = start_client(s.port, "--count", "100000000", "--inflight", "2", "--clients", "2")
        wait_until(lambda: s.rdma_objects("qp") == 2, 30,
                   lambda: f"2 connections open ({s.rdma_objects('qp')} QPs); client:\n{text_of(held)}")
        # Bounded: 3 attempts each while the slots stay taken, then the reason.
        rc, out, err = client(s.port, "--clients", "2", "--count", "10", "--connect-attempts", "3", "--json")
        print(out + err, end="")
        check(rc == 1 and err.count(busy + " (3 attempts)") == 2, f"2 connections busy after 3 attempts ({rc})")
        check(connect_summary(out) == (0, 2, 2, 4, "busy 2"), "summary: 0 of 2, 4 retries, busy 2")
        check(json_of(out)["connect_failures"] == {"busy": 2}, "JSON failures by reason")
        s.wait_for(rejects, 30, count=6)
        # Retrying while the slots are taken; served once the held connections go.
        waiting = start_client(s.port, "--clients", "2", "--count", "300", "--connect-attempts", "20")
        s.wait_for(rejects, 30, count=8)  # both rejected at least once
        check(waiting.poll() is None, f"the retrying client gave up:\n{text_of(waiting)}")
        held.send_signal(signal.SIGINT)
        check(held.wait(60) == 130, f"held client:\n{text_of(held)}")
        rc = waiting.wait(600)
        out = text_of(waiting)
        print(out, end="")
        check(rc == 0 and verified(out)[0] == 600, f"the retrying client served ({rc})")
        established, _, _, retried, failures = connect_summary(out)
        check(established == 2 and retried >= 2 and failures == "none", "2 of 2 connected after retries")
        # 4 short clients at once against 2 slots: the 2 rejected come back once 2 are done.
        wait_until(lambda: s.rdma_objects("qp") == 0, 30, "the server's QPs all destroyed")
        before = len(re.findall(rejects, s.text()))
        rc, out, err = client(s.port, "--clients", "4", "--count", "300", "--connect-attempts", "20")
        print(out + err, end="")
        check(rc == 0 and verified(out)[0] == 1200, f"4 clients against 2 slots all served ({rc})")
        established, _, _, retried, failures = connect_summary(out)
        check(established == 4 and failures == "none", "4 of 4 connected")
        rejected = len(re.findall(rejects, s.text())) - before
        check(retried >= rejected >= 2, f"every reject retried ({retried} retries, {rejected} rejects)")
    finally:
        check(s.stop() == 0, "server exit status")


def case_threads():
    """--threads 2: 16 connections spread over both threads, every message verified; SIGTERM
    with connections open on both threads closes every one, tells the client, and exits 0."""
    s = Server(19014, "--threads", "2")
    try:
        check("2 thread(s)" in s.text(), "the listen line names the threads")
        rc, out, err = client(s.port, "--clients", "16", "--count", "2000", "--inflight", "4", "--size", "256")
        print(out + err, end="")
        check(rc == 0, f"client exit {rc}")
        got, want, _ = verified(out)
        check(got == want == 32000, f"verified {got} of {want}")
        s.wait_for(r"closed \(the client disconnected", 60, count=16)
        per_thread = [len(re.findall(rf"resources released \(thread {t}\)", s.text())) for t in (0, 1)]
        print(f"connections per thread: {per_thread}")
        check(sum(per_thread) == 16 and min(per_thread) >= 4, f"spread over both threads: {per_thread}")
        lingering = start_client(s.port, "--clients", "4", "--count", "100000000", "--inflight", "2")
        wait_until(lambda: s.rdma_objects("qp") == 4, 30, lambda: f"4 connections open; client:\n{text_of(lingering)}")
        time.sleep(0.5)
    finally:
        status = s.stop(signal.SIGTERM)
        check(status == 0, f"server exit status {status}:\n{s.text()}")
    text = s.text()
    closed = [len(re.findall(rf"closed \(the server is shutting down[^\n]*\(thread {t}\)", text)) for t in (0, 1)]
    check(closed == [2, 2], f"the shutdown closed 2 connections on each thread: {closed}")
    check("shut down: 20 connection(s) served" in text, "server summary")
    check(lingering.wait(60) == 1 and text_of(lingering).count("the server closed the connection") == 4,
          f"client told:\n{text_of(lingering)}")


def case_many_connections():
    """512 connections at once (64 being set up at a time), 20 messages each, every one verified;
    then the server's QPs, CQs, MRs, PDs and cm_ids are back to what one client left (the
    kernel's restrack), and it serves the next client."""
    s = Server(19015)
    try:
        rc, out, err = client(s.port, "--count", "10")
        check(rc == 0, f"first client: {out}{err}")
        s.wait_for(r"closed \(the client disconnected", 60)
        wait_until(lambda: s.rdma_objects("qp") == 0, 30, "the first client's QP destroyed")
        baseline = s.rdma_counts()
        start = time.monotonic()
        rc, out, err = client(s.port, "--clients", "512", "--count", "20", "--size", "64", "--json")
        print(err + "\n".join(l for l in out.splitlines() if not l.startswith("echo_client: connection")))
        check(rc == 0, f"client exit {rc}")
        got, want, _ = verified(out)
        check(got == want == 512 * 20, f"verified {got} of {want}")
        check(connect_summary(out)[:2] == (512, 512), "512 of 512 connected")
        s.wait_for(r"closed \(the client disconnected", 120, count=513)
        wait_until(lambda: s.rdma_counts() == baseline, 60,
                   lambda: f"restrack {s.rdma_counts()}, {baseline} before the 512")
        print(f"512 connections in {time.monotonic() - start:.1f} s; restrack back to {baseline}")
        rc, out, err = client(s.port, "--count", "100")
        check(rc == 0 and verified(out)[0] == 100, "the server serves the next client")
    finally:
        check(s.stop() == 0, "server exit status")


def case_rnr_peer():
    """A raw librdmacm client that sends and never posts a receive: the server's echo runs out of
    RNR retries and closes that connection with a line naming RNR; a client next to it is
    verified and the server goes on."""
    needs_rnr()
    s = Server(19016)
    try:
        good = start_client(s.port, "--count", "3000", "--inflight", "2")
        peer = subprocess.Popen([os.path.join(BUILD, "tests", "examples", "rnr_peer"), ADDR, str(s.port), "60"],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        s.wait_for(r"closed \(echo send failed: [^\n]*RNR", 60)
        check(good.wait(600) == 0 and verified(text_of(good))[0] == 3000, "the client next to it:\n" + text_of(good))
        peer.kill()
        print(peer.communicate()[0], end="")
        print(next(l for l in s.text().splitlines() if "RNR" in l))
        rc, out, err = client(s.port, "--count", "100")
        check(rc == 0 and verified(out)[0] == 100, "the server serves the next client")
    finally:
        check(s.stop() == 0, "server exit status")


def memlock_limited(limit):
    """A wrapper (for Server) that runs the server under RLIMIT_MEMLOCK `limit` bytes, without
    CAP_IPC_LOCK: as root (in the VM) the kernel would let it pin any amount of memory."""
    return ["prlimit", f"--memlock={limit}", "setpriv", "--inh-caps=-ipc_lock", "--bounding-set=-ipc_lock"]


def set_memlock(s, limit):
    """Raises the running server's RLIMIT_MEMLOCK (from outside: prlimit(2), as root)."""
    resource.prlimit(s.proc.pid, resource.RLIMIT_MEMLOCK, (limit, limit))


def check_rejected_for_memory(s, count):
    """One client whose connection the server cannot set up (its SRQ pool's ibv_reg_mr fails with
    ENOMEM): rejected with the reason, logged (`count` such lines by now), the server goes on."""
    rc, out, err = client(s.port, "--count", "10", "--connect-attempts", "1")
    print(err, end="")
    check(rc == 1 and re.search(r"the server rejected the connection: [^\n]*ibv_reg_mr[^\n]*Cannot allocate memory",
                                err), f"the client is told why ({rc}):\n{out}{err}")
    s.wait_for(r"request from \S+ rejected \([^\n]*ibv_reg_mr[^\n]*Cannot allocate memory", 30, count=count)
    check(s.proc.poll() is None, f"the server exited ({s.proc.returncode}):\n{s.text()}")


def case_setup_failure():
    """The first client's set-up fails for real: on 0.0.0.0 nothing is made before it, and its
    thread's shared receive pool (16 MiB) cannot be registered under a 1 MiB RLIMIT_MEMLOCK
    (ENOMEM). Each such request is rejected with the verb and errno, the server goes on, serves
    the next client once the limit is raised, and exits 0 on SIGTERM."""
    # Bound to the device's address, it makes that pool before it announces it listens: it cannot start.
    r = subprocess.run([*memlock_limited(1 << 20), SERVER, "--address", ADDR, "--port", "19017"], capture_output=True,
                       text=True, timeout=60)
    print(r.stderr, end="")
    check(r.returncode == 1 and re.search(r"ibv_reg_mr[^\n]*Cannot allocate memory", r.stderr),
          f"bound to {ADDR}, the server exits 1 naming the verb ({r.returncode}):\n{r.stdout}{r.stderr}")
    s = Server(19017, address="0.0.0.0", wrapper=memlock_limited(1 << 20))
    try:
        check_rejected_for_memory(s, 1)
        check_rejected_for_memory(s, 2)  # nothing half-made was kept from the first
        set_memlock(s, resource.RLIM_INFINITY)
        rc, out, err = client(s.port, "--count", "100")
        check(rc == 0 and verified(out)[0] == 100, f"served once the limit allows:\n{out}{err}")
    finally:
        status = s.stop()
        check(status == 0, f"server exit status {status}:\n{s.text()}")
    check("terminate" not in s.text(), f"std::terminate:\n{s.text()}")
    print(next(l for l in s.text().splitlines() if "rejected (server error" in l))


def case_setup_failure_threads():
    """--threads 2 (8 MiB of pool each): under 1 MiB of RLIMIT_MEMLOCK thread 0 cannot set up the
    first clients; under 12 MiB thread 0 can and thread 1 cannot. Each such request is rejected
    with the reason and the server goes on; unlimited, thread 1 serves; SIGTERM exits 0."""
    s = Server(19018, "--threads", "2", address="0.0.0.0", wrapper=memlock_limited(1 << 20))
    try:
        check_rejected_for_memory(s, 1)  # thread 0
        check_rejected_for_memory(s, 2)  # thread 0 again: both serve no connection
        set_memlock(s, 12 << 20)
        held = start_client(s.port, "--count", "100000000", "--inflight", "2")
        wait_until(lambda: s.rdma_objects("qp") == 1, 30, lambda: f"held client connected:\n{text_of(held)}")
        check_rejected_for_memory(s, 3)  # thread 1
        check_rejected_for_memory(s, 4)  # thread 1 again
        set_memlock(s, resource.RLIM_INFINITY)
        rc, out, err = client(s.port, "--count", "100")
        check(rc == 0 and verified(out)[0] == 100, f"served once the limit allows:\n{out}{err}")
        s.wait_for(r"closed \(the client disconnected[^\n]*\(thread 1\)", 60)
        refused = [len(re.findall(rf"rejected \(server error: [^\n]*\(thread {t}\)", s.text())) for t in (0, 1)]
        check(refused == [2, 2], f"2 requests refused by each thread: {refused}")
    finally:
        status = s.stop()
        check(status == 0, f"server exit status {status}:\n{s.text()}")
    check("terminate" not in s.text(), f"std::terminate:\n{s.text()}")
    print(next(l for l in s.text().splitlines() if "rejected (server error" in l))
    check(held.wait(60) == 1 and "the server closed the connection" in text_of(held), f"held client:\n{text_of(held)}")


GONE_DEVICE, GONE_NETDEV, GONE_ADDR = "rvgone1", "rvgone_e", "198.18.78.1"


def remove_scratch_device():
    subprocess.run(f"rdma link delete {GONE_DEVICE}; ip link del {GONE_NETDEV}", shell=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60)


def case_device_removed():
    """The device goes away under live traffic (`rdma link delete`, as a hot-unplug would): the
    client's connections end at once with ENODEV ("the RDMA device is gone"; on iWARP one may
    end by the server's close for it, which can come first), not by its reply timeout; the
    server logs the loss and exits non-zero; the kernel completes the removal once both let go. A device of its own (the test device's kind) on a dummy netdev of its own."""
    kind = "siw" if os.environ.get("RINGVERBS_TRANSPORT") == "iwarp" else "rxe"
    remove_scratch_device()
    running = []  # what holds the device: killed on a failure, else the removal waits for it
    subprocess.run(f"ip link add {GONE_NETDEV} type dummy && ip addr add {GONE_ADDR}/24 dev {GONE_NETDEV} && "
                   f"ip link set {GONE_NETDEV} up && rdma link add {GONE_DEVICE} type {kind} netdev {GONE_NETDEV}",
                   shell=True, check=True)
    try:
        state = f"/sys/class/infiniband/{GONE_DEVICE}/ports/1/state"
        wait_until(lambda: "ACTIVE" in open(state).read(), 10, f"{GONE_DEVICE} ACTIVE")
        s = Server(19021, *os.environ.get("ECHO_SERVER_ARGS", "").split(), "--device", GONE_DEVICE,
                   address=GONE_ADDR)
        running.append(s.proc)
        log = os.path.join(TMP, "client.removed.log")
        # --reply-timeout 120: only the device's loss can end these connections in time.
        c = subprocess.Popen([CLIENT, "--address", GONE_ADDR, "--port", str(s.port), "--device", GONE_DEVICE, "--clients", "4",
                              "--inflight", "2", "--count", "100000000", "--reply-timeout", "120"],
                             stdout=open(log, "w"), stderr=subprocess.STDOUT)
        running.append(c)
        c.log = log
        wait_until(lambda: s.rdma_objects("qp") == 4, 30,
                   lambda: f"4 connections open ({s.rdma_objects('qp')} QPs); client:\n{text_of(c)}")
        time.sleep(1)
        t0 = time.monotonic()
        remover = subprocess.Popen(["rdma", "link", "delete", GONE_DEVICE])
        running.append(remover)
        rc = c.wait(60)
        client_s = time.monotonic() - t0
        out = text_of(c)
        print(out, end="")
        src = s.proc.wait(60)
        server_s = time.monotonic() - t0
        text = s.text()
        print(text, end="")
        print(f"echo_test: client ended {client_s:.1f} s, server {server_s:.1f} s after the removal began")
        check(rc == 1, f"client exit status {rc}")
        # Each connection's own line (the library's diagnostics, on stderr here too, may also
        # say "the RDMA device is gone": not counted).
        ends = re.findall(r"^echo_client: connection \d+ to \S+: (.*) after \d+ of \d+ messages$", out, re.M)
        check(len(ends) == 4, f"4 connections ended, each with its reason: {ends}")
        gone = sum("the RDMA device is gone" in e for e in ends)
        closed = sum(e.startswith("the server closed the connection") for e in ends)
        if IWARP:
            # The server, losing the device too, closes its connections as it exits, and on iWARP
            # that close is its TCP stream's end, which the client's kernel may report before the
            # removal (a CI run: 3 gone, 1 "the server closed the connection", 0.3 s after).
            check(gone >= 1 and gone + closed >= 4,
                  f"the 4 connections ended by the device's loss or the server's close for it ({gone}, {closed})")
        else:
            check(gone >= 4, "each of the 4 connections ended by the device's loss")
        check(client_s < 30, f"the client's connections ended promptly ({client_s:.1f} s)")
        check(src == 1, f"server exit status {src} (non-zero: it lost its device)")
        check("the RDMA device went away" in text, "the server logs the device's loss")
        check(remover.wait(60) == 0, "rdma link delete completed once both processes let the device go")
        check(not os.path.exists(f"/sys/class/infiniband/{GONE_DEVICE}"), f"{GONE_DEVICE} gone")
    finally:
        # A failed case (a wait that timed out) leaves the client (--count 100000000) and the
        # server running, holding the device: `rdma link delete` would wait for them beyond
        # remove_scratch_device's timeout, and they would run on beside the next cases.
        for p in running:
            if p.poll() is None:
                p.kill()
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    pass
        remove_scratch_device()


CASES = {name[5:]: fn for name, fn in sorted(globals().items()) if name.startswith("case_")}
# Only in a guest of tools/softroce-vm: it adds and removes a device and a netdev, as root.
if os.environ.get("RINGVERBS_IN_VM") != "1":
    CASES.pop("device_removed")


def main():
    if not have_device():
        print("echo_test: no RDMA device: SKIP (tools/softroce-vm runs this on Soft-RoCE)")
        return 77
    if not ADDR:
        print("echo_test: RINGVERBS_ADDR (the device's IP address) is not set: SKIP")
        return 77
    if shutil.which("rdma") is None:
        print("echo_test: the iproute2 'rdma' tool is missing")
        return 1
    if shutil.which("prlimit") is None or shutil.which("setpriv") is None:
        print("echo_test: util-linux's prlimit or setpriv is missing")
        return 1
    wanted = sys.argv[2:] or list(CASES)
    failed, skipped = [], []
    for name in wanted:
        print(f"--- {name}: {CASES[name].__doc__.strip()}", flush=True)
        t0 = time.monotonic()
        try:
            CASES[name]()
            print(f"--- {name}: ok ({time.monotonic() - t0:.1f} s)", flush=True)
        except NotApplicable as e:
            skipped.append(name)
            print(f"--- {name}: not applicable here (skipped): {e}", flush=True)
        except (Failure, subprocess.TimeoutExpired) as e:
            failed.append(f"{name} ({str(e).splitlines()[0] if str(e) else type(e).__name__})")
            print(f"--- {name}: FAILED: {e}", flush=True)
    ran = len(wanted) - len(skipped)
    # The failed ones named last, with their first line: CI shows a failed test's last lines.
    print(f"echo_test: {ran - len(failed)} of {ran} cases passed"
          + (f"; {len(skipped)} not applicable, skipped: {', '.join(skipped)}" if skipped else "")
          + "".join(f"\n  FAILED: {f}" for f in failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
