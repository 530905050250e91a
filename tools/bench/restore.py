"""Time to restore R after a storage node dies, on real daemons (issue 8 benchmark, third row).

``python -m tools.bench.restore [--sentences N]``: a loopback cluster of 3 storage daemons (R = 2,
W = 1) and one compute daemon trains on N bundled sentences; then one storage daemon is killed
with SIGKILL. Measured: the failure detection time (kill → the survivors' membership says
``dead``), then ``giaannctl node removenode --wait`` on a survivor (re-replication of the dead
node's columns from the survivors, verification and cutover), with the bytes it streamed.
Baseline, measured in the same run: detection time + those bytes over the raw loopback TCP rate
(one socket pair sending the same number of bytes in 4 MiB writes), i.e. what restoring R would
take if only detection and the wire mattered.
"""

from __future__ import annotations

import argparse
import json
import socket
import tempfile
import threading
import time
from pathlib import Path

from giaannd.model.tokens import load_bundled_corpus, write_conllu
from giaannd.sdk.local_cluster import running_cluster
from tools.bench.report import print_table


def raw_tcp_rate(nbytes: int, chunk: int = 4 << 20) -> float:
    """Bytes/s of one loopback TCP connection sending ``nbytes``."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    received = 0

    def sink() -> None:
        nonlocal received
        conn, _ = server.accept()
        with conn:
            buf = bytearray(chunk)
            while received < nbytes:
                n = conn.recv_into(buf)
                if not n:
                    break
                received += n

    t = threading.Thread(target=sink)
    t.start()
    payload = b"\0" * chunk
    with socket.create_connection(("127.0.0.1", port)) as c:
        start = time.perf_counter()
        sent = 0
        while sent < nbytes:
            c.sendall(payload[:min(chunk, nbytes - sent)])
            sent += min(chunk, nbytes - sent)
        t.join()
        elapsed = time.perf_counter() - start
    server.close()
    return nbytes / elapsed


def main(sentences: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        corpus = root / "train.conllu"
        write_conllu(load_bundled_corpus(sentences), corpus)
        with running_cluster(root / "c", storage=3, compute=1, transport="tcp", replication_factor=2,
                             write_quorum=1, log_level="warning", corpus_dir=root) as cluster:
            cluster.wait_converged()
            compute = cluster.node("compute-1")
            job = compute.admin.json("POST", "/v1/train", {"corpus": str(corpus), "workers": 1})
            while compute.admin.json("GET", f"/v1/jobs/{job['job_id']}")["state"] == "running":
                time.sleep(0.2)
            victim, survivor = cluster.node("storage-3"), cluster.node("storage-1")
            killed = time.monotonic()
            cluster.kill(victim)
            while True:
                table = {m["name"]: m["status"] for m in survivor.admin.json("GET", "/v1/members")["members"]}
                if table["storage-3"] == "dead":
                    break
                time.sleep(0.05)
            detected = time.monotonic()
            proc = survivor.ctl("--json", "node", "removenode", "storage-3", "--wait", timeout_s=600)
            restored = time.monotonic()
            if proc.returncode != 0:
                raise SystemExit(f"removenode failed: {proc.stderr}")
            doc = json.loads(proc.stdout)
    moved = int(doc["bytes_done"])
    raw = raw_tcp_rate(max(moved, 1 << 20))
    detect_s, restore_s = detected - killed, restored - detected
    base = detect_s + moved / raw
    print_table("Time to restore R after a storage daemon is killed (3 storage, R = 2, loopback tcp)",
                ["sentences", "bytes re-replicated", "detection s", "removenode s", "total s",
                 "detection + bytes/raw s", "ratio"],
                [[str(sentences), f"{moved:,}", f"{detect_s:.2f}", f"{restore_s:.2f}",
                  f"{detect_s + restore_s:.2f}", f"{base:.2f}", f"{(detect_s + restore_s) / base:.2f}x"]])
    print(f"raw loopback tcp: {raw / 1e6:.0f} MB/s; removenode streamed at "
          f"{moved / max(restore_s, 1e-9) / 1e6:.1f} MB/s including plan, verify and cutover")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="python -m tools.bench.restore", description=__doc__)
    ap.add_argument("--sentences", type=int, default=2000)
    main(ap.parse_args().sentences)
