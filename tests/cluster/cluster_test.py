#!/usr/bin/env python3
"""The echo server and client on two hosts: two Soft-RoCE guests joined by one virtual link
(tools/softroce-vm -n 2), the server on node 2 (through tools/on-node), the client here on
node 1, with faults on the link from tc netem.

    cluster_test.py BUILD_DIR [CASE...]

Outside a two-node cluster it exits 77 (SKIP). Throughput under faults is reported, not
asserted: every byte is."""
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))
import harness  # noqa: E402  (tests/support/harness.py)
from harness import Failure, check  # noqa: E402

BUILD = os.path.abspath(sys.argv[1])
TOP = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ON_NODE = os.path.join(TOP, "tools", "on-node")
SERVER = os.path.join(BUILD, "examples", "echo_server")
CLIENT = os.path.join(BUILD, "examples", "echo_client")
PEER = os.environ.get("RINGVERBS_PEER_ADDR", "")
PEER6 = os.environ.get("RINGVERBS_PEER_ADDR6", "")
TMP = tempfile.mkdtemp(prefix="cluster_test.")


def on_node(node, *cmd, timeout=120):
    r = subprocess.run([ON_NODE, str(node), *cmd], capture_output=True, text=True, timeout=timeout)
    return r.returncode, r.stdout, r.stderr


def netem(*spec):
    """The same netem qdisc on eth0 of both nodes (each direction of the link); none: removed."""
    for node in (1, 2):
        if spec:
            rc, out, err = on_node(node, "tc", "qdisc", "replace", "dev", "eth0", "root", "netem", *spec)
            check(rc == 0, f"tc netem on node {node}: {out}{err}")
        else:
            on_node(node, "tc", "qdisc", "del", "dev", "eth0", "root")


class RemoteServer(harness.Server):
    """echo_server on node 2, through on-node (which forwards SIGTERM to it)."""

    def __init__(self, port, *args, address=None):
        self.port = port
        self.address = address or PEER
        super().__init__([ON_NODE, "2", SERVER, "--address", self.address, "--port", str(port), *args],
                         os.path.join(TMP, f"server.{port}.log"), ready_timeout=60, interval=0.1)

    def stop(self, timeout=60):
        # No backtrace: the process here is on-node's, the server runs on node 2.
        return super().stop(timeout=timeout, backtrace=False)


def client(port, *args, timeout=600, address=None):
    r = subprocess.run([CLIENT, "--address", address or PEER, "--port", str(port), *args], capture_output=True,
                       text=True, timeout=timeout)
    return r.returncode, r.stdout, r.stderr


def verified(stdout):
    m = re.search(r"(\d+) of (\d+) messages \((\d+) bytes\) echoed and verified", stdout)
    return (int(m.group(1)), int(m.group(2)), int(m.group(3))) if m else (0, -1, 0)


def rate(stdout):
    m = re.search(r"([\d.]+) messages/s", stdout)
    return float(m.group(1)) if m else 0.0


def case_echo_across():
    """Across the link: 1 connection x 2,000 and 16 connections x 300 messages, every byte
    verified; SIGTERM ends the server on node 2 with exit 0; then 500 messages over IPv6."""
    s = RemoteServer(19101)
    try:
        for clients, count in ((1, 2000), (16, 300)):
            rc, out, err = client(s.port, "--clients", str(clients), "--count", str(count), "--size", "512",
                                  "--inflight", "4")
            print(out + err, end="")
            check(rc == 0, f"client exit {rc}")
            got, want, nbytes = verified(out)
            check(got == want == clients * count and nbytes == got * 512, f"verified {got} of {want}")
        s.wait_for(r"closed \(the client disconnected", 60, count=17)
    finally:
        check(s.stop() == 0, f"server exit status:\n{s.text()}")
    check("17 connection(s) served" in s.text(), "server summary")
    # And over IPv6 (fd01::2): RoCE v2 with the IPv6 GID.
    s6 = RemoteServer(19105, address=PEER6)
    try:
        rc, out, err = client(s6.port, "--count", "500", "--size", "512", address=PEER6)
        print(out + err, end="")
        check(rc == 0 and verified(out)[0] == 500, f"IPv6 client exit {rc}")
    finally:
        check(s6.stop() == 0, f"IPv6 server exit status:\n{s6.text()}")


def case_lossy_link():
    """1% and then 5% loss with 5 ms +- 2 ms delay each way: 16 connections x 100 messages, every
    byte verified (RC retransmits); messages/s reported, not asserted."""
    s = RemoteServer(19102)
    try:
        for loss in ("1%", "5%"):
            netem("delay", "5ms", "2ms", "loss", loss)
            start = time.monotonic()
            rc, out, err = client(s.port, "--clients", "16", "--count", "100", "--size", "1024", "--inflight", "2")
            print(out + err, end="")
            check(rc == 0, f"client exit {rc} at {loss} loss")
            got, want, _ = verified(out)
            check(got == want == 16 * 100, f"verified {got} of {want} at {loss} loss")
            print(f"loss {loss}, delay 5 ms +- 2 ms: {rate(out):.0f} messages/s, {time.monotonic() - start:.1f} s")
    finally:
        netem()
        check(s.stop() == 0, f"server exit status:\n{s.text()}")


def rdma_counts(node):
    """QPs, CQs, MRs, PDs and cm_ids on a node (every process, and the kernel's own)."""
    return {kind: len(harness.restrack_list(kind, lambda cmd: on_node(node, *cmd), f" on node {node}"))
            for kind in harness.RDMA_KINDS}


def wait_until(cond, timeout, what):
    harness.wait_until(cond, timeout, what, interval=0.5)  # a check on a node costs a process


def case_partition():
    """A 30 s partition (netem loss 100% both ways) during traffic: the client gives up within
    30 s, saying why (its --reply-timeout of 10 s, or a send out of retries); the server closes
    the connection within 30 s (its echo send out of retries, or --idle-timeout 10); after the
    heal a new client is served and verified; both nodes' QPs, CQs, MRs, PDs and cm_ids are
    back to where they were."""
    before = {1: rdma_counts(1), 2: rdma_counts(2)}
    s = RemoteServer(19103, "--idle-timeout", "10")
    try:
        log = os.path.join(TMP, "partitioned-client.log")
        c = subprocess.Popen([CLIENT, "--address", PEER, "--port", str(s.port), "--count", "100000000",
                              "--inflight", "2", "--reply-timeout", "10"], stdout=open(log, "w"),
                             stderr=subprocess.STDOUT)
        # Mid-stream: connected (its QP on the server's node), then a second of traffic. Not a
        # fixed wait: in two TCG guests a connect may take longer than one.
        server_qps = lambda: len(harness.restrack_list("qp", lambda cmd: on_node(2, *cmd), " on node 2"))
        wait_until(lambda: server_qps() > before[2]["qp"] or c.poll() is not None, 60,
                   lambda: f"the client connected; its log:\n{open(log).read()}")
        time.sleep(1)
        check(c.poll() is None, f"client ended before the partition:\n{open(log).read()}")
        cut = time.monotonic()
        netem("loss", "100%")
        try:
            rc = c.wait(30)
        except subprocess.TimeoutExpired:
            c.kill()
            raise Failure(f"the client was still waiting 30 s into the partition:\n{open(log).read()}")
        client_ended = time.monotonic() - cut
        text = open(log).read()
        print(text, end="")
        check(rc == 1 and re.search(r"no reply for 10 s \(--reply-timeout\)|Transport retry counter exceeded", text),
              f"client exit {rc}: why it gave up")
        s.wait_for(r"closed \((idle: no message for 10 s|echo send failed: [^\n]*retry)", 30)
        server_ended = time.monotonic() - cut
        print(f"partition: client gave up after {client_ended:.1f} s, server closed after {server_ended:.1f} s")
        time.sleep(max(0.0, 30 - (time.monotonic() - cut)))
    finally:
        netem()
    try:
        rc, out, err = client(s.port, "--clients", "4", "--count", "200", "--inflight", "2")
        print(out + err, end="")
        check(rc == 0 and verified(out)[0] == 800, f"served after the heal ({rc})")
        s.wait_for(r"closed \(the client disconnected", 60, count=4)
    finally:
        check(s.stop() == 0, f"server exit status:\n{s.text()}")
    for node in (1, 2):
        wait_until(lambda: rdma_counts(node) == before[node], 30,
                   lambda: f"node {node}: {rdma_counts(node)}, {before[node]} before")


def case_link_down_up():
    """eth0 of node 1 down, then up: the echo server there logs IBV_EVENT_PORT_ERR ("port
    error") then IBV_EVENT_PORT_ACTIVE ("port active") from device_events; a client on node 2 connecting after the link is
    back is served and verified."""
    addr = os.environ["RINGVERBS_ADDR"]
    log = os.path.join(TMP, "local-server.log")
    server = subprocess.Popen([SERVER, "--address", addr, "--port", "19104"], stdout=open(log, "w"),
                              stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: "listening on" in open(log).read(), 30, lambda: open(log).read())
        subprocess.run(["ip", "link", "set", "eth0", "down"], check=True)
        time.sleep(1)
        subprocess.run(["ip", "link", "set", "eth0", "up"], check=True)
        wait_until(lambda: "device rxe0: port active" in open(log).read(), 30,
                   lambda: f"no PORT_ACTIVE:\n{open(log).read()}")
        text = open(log).read()
        check(0 <= text.find("device rxe0: port error") < text.find("device rxe0: port active"),
              f"PORT_ERR, then PORT_ACTIVE:\n{text}")
        wait_until(lambda: "ACTIVE" in subprocess.run(["rdma", "link"], capture_output=True, text=True).stdout, 30,
                   "rxe0 ACTIVE again")
        rc, out, err = on_node(2, CLIENT, "--address", addr, "--port", "19104", "--count", "500",
                               "--connect-attempts", "10", timeout=300)
        print(out + err, end="")
        check(rc == 0 and verified(out)[0] == 500, f"client on node 2 after the link came back ({rc})")
    finally:
        server.send_signal(signal.SIGTERM)
        rc = server.wait(60)
        print(open(log).read(), end="")
    check(rc == 0, "local server exit status")


CASES = {name[5:]: fn for name, fn in sorted(globals().items()) if name.startswith("case_")}


def main():
    if os.environ.get("RINGVERBS_NODES") != "2" or not PEER:
        print("cluster_test: not in a two-node cluster: SKIP (tools/softroce-vm -n 2 runs it)")
        return 77
    names = sys.argv[2:] or list(CASES)
    failed = []
    for name in names:
        fn = CASES[name]
        print(f"--- {name}: {fn.__doc__.strip()}", flush=True)
        start = time.monotonic()
        try:
            fn()
            print(f"--- {name}: ok ({time.monotonic() - start:.1f} s)", flush=True)
        except (Failure, subprocess.TimeoutExpired) as e:
            print(f"--- {name}: FAILED: {e}", flush=True)
            failed.append(name)
    print(f"cluster_test: {len(names) - len(failed)} of {len(names)} cases passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
