"""A soak, as trusted systems run one: three server workers on one shared store (real
PostgreSQL and SeaweedFS, started here: ``tests/services.py``) under clients and faults for
``--minutes``, with invariants checked all along and at the end.

    .venv/bin/python benchmarks/soak.py [--minutes 20] [--clients 6] [--agents 10] [--seed 1]

Clients (threads; each op against a random worker, as a load balancer spreads them):

- turns: an agent's next turn (``/v1/completions``, ``wait_for_save``), one at a time per
  agent, its text the agent's conversation so far and a new question;
- streams dropped: the same, streamed, the client gone after the first piece;
- fan-outs: three branches of a ``Send`` at once, over one shared prefix, new agents;
- forks (``POST /v1/agents/{id}/fork``) and deletes of forks;
- ``agent-memory cache gc`` and ``cache verify`` on the store, now and then.

Faults, one at a time every ``--fault-every`` seconds, in turn: a worker SIGKILLed (and
started again on its directory), a worker SIGSTOPped, PostgreSQL SIGSTOPped, SeaweedFS
SIGSTOPped (each for ``--freeze-s``), and worker C's disk full (its cache directory is a
tmpfs, filled for ``--freeze-s``; skipped, and said, where no tmpfs can be mounted).

Invariants (the run fails, exit 1, if one breaks):

- no acknowledged turn lost: at the end every agent's stored text starts with its last turn
  whose reply said ``cache_saved`` true or ``"local"`` (or with a later turn that reached a
  worker: a reply lost with its worker); a save reported lost (``false``) is counted;
- 0 dangling references (``Catalog.dangling``; ``cache verify`` exits 0);
- bounded resources per worker process (memory, open files, threads) and database
  connections: after warm-up (the first third of a worker's life) the level of its last third
  is within ``GROWTH`` of the level of its middle third (open files and threads: the peak;
  memory: the median, for a step's transients are spikes, a cold prefill's attention scores
  ~200 MB of SmolLM2 at 2K tokens, where a leak raises every sample after it). Memory is
  judged as mlx's arrays less what the caches hold (the hot tier, the block pool, the caches
  of requests in flight and the blocks of saves not written yet, from the worker's
  ``/metrics``): those fill to their budgets over a life, and a leak is what grows besides
  them (RSS is plotted, not judged: memory the caches let go stays in mlx's buffer cache and
  the C allocator);
- every agent resumes warm at the end, on a worker that never held it;
- no 5xx other than 503 (the store out of reach) and 507 (the disk full), and no 400 for a
  request that is right.

Writes results/soak.json and results/soak.png (memory, open files and threads per worker
over time with the faults marked; turns served hot / warm / cold). A 2-minute run is part of
the test suite (tests/integration/test_soak.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))  # the real servers the tests start

from services import PostgresServer, SeaweedServer  # noqa: E402

from langchain_agent_memory import corpus  # noqa: E402
from langchain_agent_memory.testing.server_process import free_port, start_server  # noqa: E402

RESULTS = HERE / "results"
MODEL = "smollm2-135m"
PREFIX = "You answer questions about this license in one short line.\n\n" + corpus.apache_license()[:1200]
#: Allowed growth of a resource's level from the middle third of a worker's life to its last.
GROWTH = {"unheld_mb": 0.1, "fds": 0.25, "threads": 0.25}
#: How a third's level is read: memory's median (a step's transients are spikes a peak would
#: judge; a leak raises every sample after it), the peak of the others.
LEVEL = {"unheld_mb": statistics.median, "fds": max, "threads": max}
SLACK = {"unheld_mb": 32, "fds": 16, "threads": 8}  # absolute slack on top (small numbers)
#: The worker's gauges of what its caches hold, and of mlx's memory (plotted beside RSS).
HELD = (
    "agent_memory_hot_bytes",
    "agent_memory_pool_bytes",
    "agent_memory_serving_bytes",
    "agent_memory_queued_save_bytes",
)
MLX = ("agent_memory_mlx_active_bytes", "agent_memory_mlx_cache_bytes")
MAX_CONVERSATION = len(PREFIX) + 6000
FAULTS = ("kill worker", "stop worker", "stop postgres", "stop seaweedfs", "disk full")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Worker:
    """One ``agent-memory serve`` process on the shared store, its cache directory its own."""

    def __init__(self, name: str, directory: Path, store: str, blocks: str) -> None:
        self.name, self.dir = name, directory
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [
            "--model",
            MODEL,
            "--cache-dir",
            str(directory),
            "--store",
            store,
            "--blocks",
            blocks,
            "--lazy-store",
            "--log-level",
            "warning",
            "--max-tokens-limit",
            "64",
        ]
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at: list[float] = []
        self.lock = threading.Lock()

    def start(self) -> None:
        self.proc = start_server(self.args, self.port)
        self.started_at.append(time.monotonic())

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def sample(self) -> dict[str, float] | None:
        """RSS (MB), open files and threads of the process, or None if it is not running."""
        if self.proc is None or self.proc.poll() is not None:
            return None
        try:
            status = Path(f"/proc/{self.proc.pid}/status").read_text()
            fds = len(list(Path(f"/proc/{self.proc.pid}/fd").iterdir()))
        except OSError:
            return None
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if "VmRSS" not in fields:  # exiting (a zombie until reaped): no memory left to read
            return None
        gauges = self.gauges()
        mb = {} if gauges is None else {n: gauges.get(n, 0.0) / 2**20 for n in HELD + MLX}
        held = sum(mb[n] for n in HELD) if mb else None
        active = mb[MLX[0]] if mb else None
        return {
            "rss_mb": int(fields["VmRSS"].split()[0]) / 1024,
            "held_mb": held,
            "mlx_active_mb": active,
            "mlx_cache_mb": mb[MLX[1]] if mb else None,
            # mlx's arrays the caches do not hold (the weights, a step's transients): what
            # leaks if arrays leak. Not RSS less the caches: memory the caches let go stays
            # in mlx's buffer cache and the C allocator (RSS), which that would count as growth.
            "unheld_mb": None if held is None or active is None else active - held,
            "fds": fds,
            "threads": int(fields["Threads"]),
            "gauges_mb": {n.removeprefix("agent_memory_"): round(v, 1) for n, v in mb.items()},
        }

    def gauges(self) -> dict[str, float] | None:
        """The worker's memory gauges (summed over models), or None where it does not answer
        within a second (frozen by a fault, restarting)."""
        from prometheus_client.parser import text_string_to_metric_families

        try:
            text = httpx.get(f"{self.url}/metrics", timeout=1.0).text
        except httpx.HTTPError:
            return None
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in HELD + MLX:
                    out[sample.name] = out.get(sample.name, 0.0) + sample.value
        return out

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.kill()


class Ledger:
    """What clients were told, per agent: the last turn acknowledged saved (its prompt, which
    the stored cache must hold, and its prompt and reply, the next turn's context), and the
    prompts sent since (a reply lost with its worker may still have been saved)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.acked: dict[str, tuple[str, str]] = {}
        self.since: dict[str, list[str]] = {}
        self.counts: Counter[str] = Counter()
        self.wrong: list[str] = []

    def sent(self, agent: str, text: str) -> None:
        with self.lock:
            self.since.setdefault(agent, []).append(text)

    def saved(self, agent: str, prompt: str, reply: str, how: Any) -> None:
        with self.lock:
            if how in (True, "local"):
                self.acked[agent] = (prompt, prompt + reply)
                self.since[agent] = []
            else:
                self.counts["saves reported lost"] += 1

    def context(self, agent: str) -> str:
        """The agent's conversation so far, as the client knows it (begun again past
        ``MAX_CONVERSATION`` characters: a long soak stays within the model's context)."""
        with self.lock:
            text = self.acked[agent][1] if agent in self.acked else PREFIX
        return text if len(text) < MAX_CONVERSATION else PREFIX

    def count(self, what: str) -> None:
        with self.lock:
            self.counts[what] += 1

    def bad(self, what: str) -> None:
        with self.lock:
            self.wrong.append(what)
        log(f"WRONG: {what}")


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.root = Path(tempfile.mkdtemp(prefix="agent-memory-soak-"))
        self.pg, self.s3 = PostgresServer(), SeaweedServer()
        self.store, self.blocks = self.pg.new_database("soak"), self.s3.new_bucket("soak")
        self.tmpfs = self._mount_tmpfs(self.root / "c")
        self.workers = [Worker(name, self.root / name, self.store, self.blocks) for name in ("a", "b", "c")]
        self.ledger = Ledger()
        self.agent_locks = {f"agent-{i}": threading.Lock() for i in range(args.agents)}
        self.samples: list[dict[str, Any]] = []
        self.faults: list[dict[str, Any]] = []
        self.stop = threading.Event()
        self.t0 = time.monotonic()
        self.fanouts = 0

    # ------------------------------------------------------------------ services

    def _mount_tmpfs(self, where: Path) -> bool:
        where.mkdir(parents=True)
        size = f"{self.args.disk_mb}m"
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            log(f"no tmpfs for worker c ({done.stderr.strip()}): the disk-full fault is skipped")
        return done.returncode == 0

    def close(self) -> None:
        for w in self.workers:
            w.stop()
        self.pg.close()
        self.s3.close()
        if self.tmpfs:
            subprocess.run(["umount", "-l", str(self.root / "c")], capture_output=True)

    # ------------------------------------------------------------------ clients

    def worker(self) -> Worker:
        return self.rng.choice(self.workers)

    def post(self, w: Worker, path: str, body: dict[str, Any]) -> httpx.Response | None:
        """A request; None if the worker is down or did not answer (killed, stopped)."""
        try:
            return httpx.post(w.url + path, json=body, timeout=self.args.request_timeout_s)
        except httpx.HTTPError:
            self.ledger.count("no answer (worker down)")
            return None

    def check(self, op: str, reply: httpx.Response | None, allowed: tuple[int, ...] = (200,)) -> bool:
        if reply is None:
            return False
        self.ledger.count(f"{op} {reply.status_code}")
        # 503: the store out of reach; 507: the disk full (the disk-full fault), both said.
        if reply.status_code not in (*allowed, 503, 507):
            self.ledger.bad(f"{op}: {reply.status_code} {reply.text[:300]}")
        return reply.status_code == 200

    def turn(self, agent: str) -> None:
        with self.agent_locks[agent]:
            text = self.ledger.context(agent)
            n = self.rng.randrange(1000)
            prompt = f"{text}\nQ: question {n} of {agent}?\nA:"
            self.ledger.sent(agent, prompt)
            out = self.saved_turn(self.worker(), "turn", agent, prompt)
            if out is not None:
                self.ledger.count(f"served {out['agent_memory']['cache'].split('-')[0]}")

    def saved_turn(self, w: Worker, op: str, agent: str, prompt: str) -> dict[str, Any] | None:
        """``agent``'s completion of ``prompt`` on ``w``, answered once saved; what the reply
        said of its save goes in the ledger. The reply, or None if there was none."""
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "agent_id": agent, "wait_for_save": True}
        reply = self.post(w, "/v1/completions", body)
        if not self.check(op, reply):
            return None
        assert reply is not None
        out: dict[str, Any] = reply.json()
        self.ledger.saved(agent, prompt, out["choices"][0]["text"], out["agent_memory"]["cache_saved"])
        return out

    def dropped_stream(self, agent: str) -> None:
        with self.agent_locks[agent]:
            prompt = f"{self.ledger.context(agent)}\nQ: tell me more, at length?\nA:"
            self.ledger.sent(agent, prompt)
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 32, "agent_id": agent, "stream": True}
            w = self.worker()
            try:
                with httpx.stream("POST", w.url + "/v1/completions", json=body, timeout=60) as r:
                    for _ in r.iter_lines():
                        break  # the client goes away mid-stream
                self.ledger.count("streams dropped")
            except httpx.HTTPError:
                self.ledger.count("no answer (worker down)")

    def fan_out(self) -> None:
        self.fanouts += 1
        branches = [f"fan-{self.fanouts}-{i}" for i in range(3)]
        w = self.worker()

        def branch(agent: str, i: int) -> None:
            self.saved_turn(
                w, "fan-out branch", agent, f"{PREFIX}\nQ: branch {i}: what is section {i + 1} about?\nA:"
            )

        threads = [threading.Thread(target=branch, args=(a, i)) for i, a in enumerate(branches)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def fork(self, agent: str) -> None:
        target = f"{agent}-fork"
        w = self.worker()
        try:
            reply = httpx.post(
                f"{w.url}/v1/agents/{agent}/fork", json={"to": target, "replace": True}, timeout=60
            )
        except httpx.HTTPError:
            self.ledger.count("no answer (worker down)")
            return
        # 404: the source deleted first; 409: another worker wrote the target meanwhile.
        self.check("fork", reply, (200, 404, 409))

    def delete_fork(self, agent: str) -> None:
        w = self.worker()
        try:
            reply = httpx.delete(f"{w.url}/v1/agents/{agent}-fork", timeout=60)
        except httpx.HTTPError:
            self.ledger.count("no answer (worker down)")
            return
        self.check("delete", reply, (200, 404))

    def maintenance(self, what: str) -> None:
        cmd = [
            sys.executable,
            "-m",
            "langchain_agent_memory.cli.main",
            "cache",
            what,
            "--store",
            self.store,
            "--blocks",
            self.blocks,
            "--cache-dir",
            str(self.root / "maint"),
        ]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        self.ledger.count(f"cache {what} exit {done.returncode}")
        if done.returncode != 0 and what == "verify" and "unreachable" not in done.stderr + done.stdout:
            self.ledger.bad(f"cache verify: {done.stdout[-500:]} {done.stderr[-500:]}")

    def client(self, n: int) -> None:
        rng = random.Random(self.args.seed * 1000 + n)
        ops = ["turn"] * 6 + ["stream"] + ["fork", "delete"] + ["fan-out"] * (1 if n == 0 else 0)
        while not self.stop.is_set():
            op = rng.choice(ops)
            agent = rng.choice(sorted(self.agent_locks))
            try:
                if op == "turn":
                    self.turn(agent)
                elif op == "stream":
                    self.dropped_stream(agent)
                elif op == "fork":
                    self.fork(agent)
                elif op == "delete":
                    self.delete_fork(agent)
                else:
                    self.fan_out()
            except Exception as exc:  # a client's own failure is a finding, not a crash
                self.ledger.bad(f"client {n} {op}: {type(exc).__name__}: {exc}")

    # ------------------------------------------------------------------ faults and samples

    def fault(self, kind: str) -> None:
        start = time.monotonic() - self.t0
        freeze = self.args.freeze_s
        w = self.rng.choice(self.workers)
        said = kind
        if kind == "kill worker":
            with w.lock:
                w.kill()
                time.sleep(1)
                w.start()
            said = f"{kind} {w.name}"
        elif kind == "stop worker":
            w.signal(signal.SIGSTOP)
            time.sleep(freeze)
            w.signal(signal.SIGCONT)
            said = f"{kind} {w.name}"
        elif kind in ("stop postgres", "stop seaweedfs"):
            service = self.pg if kind == "stop postgres" else self.s3
            service.freeze()
            try:
                time.sleep(freeze)
            finally:
                service.thaw()
        elif kind == "disk full":
            if not self.tmpfs:
                return
            ballast = self.root / "c" / "ballast"
            with contextlib.suppress(OSError), open(ballast, "wb") as f:
                while True:
                    f.write(b"\0" * (1 << 20))
            time.sleep(freeze)
            ballast.unlink(missing_ok=True)
        self.faults.append({"t": start, "s": time.monotonic() - self.t0 - start, "fault": said, "kind": kind})
        log(f"fault: {said} ({self.faults[-1]['s']:.1f} s)")

    def chaos(self) -> None:
        i = 0
        while not self.stop.wait(self.args.fault_every):
            kind = FAULTS[i % len(FAULTS)]
            i += 1
            try:
                self.fault(kind)
            except Exception as exc:
                self.ledger.bad(f"fault {kind}: {type(exc).__name__}: {exc}")

    def db_connections(self) -> int | None:
        import psycopg

        try:
            with psycopg.connect(self.pg.url, autocommit=True, connect_timeout=2) as c:
                row = c.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = 'soak'").fetchone()
            return int(row[0]) if row else None
        except psycopg.Error:
            return None

    def sampler(self) -> None:
        try:
            self._sample_until_stopped()
        except Exception as exc:  # the resource checks would judge a part of the run only
            self.ledger.bad(f"sampler: {type(exc).__name__}: {exc}")

    def _sample_until_stopped(self) -> None:
        while not self.stop.wait(2.0):
            row: dict[str, Any] = {"t": time.monotonic() - self.t0, "db_connections": self.db_connections()}
            for w in self.workers:
                row[w.name] = w.sample()
                row[f"{w.name}_start"] = len(w.started_at)
            self.samples.append(row)

    def maintainer(self) -> None:
        n = 0
        while not self.stop.wait(self.args.fault_every * 1.7):
            self.maintenance(("gc", "verify")[n % 2])
            n += 1

    # ------------------------------------------------------------------ the run

    def run(self) -> dict[str, Any]:
        log(f"starting 3 workers on {self.store.split('?')[0]} + {self.blocks.split('?')[0]}")
        for w in self.workers:
            w.start()
        self.t0 = time.monotonic()
        threads = [
            threading.Thread(target=self.client, args=(n,), daemon=True) for n in range(self.args.clients)
        ]
        threads += [
            threading.Thread(target=f, daemon=True) for f in (self.chaos, self.sampler, self.maintainer)
        ]
        for t in threads:
            t.start()
        end = self.t0 + self.args.minutes * 60
        while time.monotonic() < end:
            time.sleep(min(30, max(0.1, end - time.monotonic())))
            c, minutes = self.ledger.counts, (time.monotonic() - self.t0) / 60
            wrong = len(self.ledger.wrong)
            log(f"{minutes:.1f} min: {c['turn 200']} turns, {len(self.faults)} faults, {wrong} wrong")
        self.stop.set()
        for t in threads:
            t.join(timeout=self.args.request_timeout_s + self.args.freeze_s + 30)
        return self.finish()

    def finish(self) -> dict[str, Any]:
        """After the run: uploads settle, then every invariant is checked."""
        for w in self.workers:  # all up (a fault may have left one stopped)
            w.signal(signal.SIGCONT)
            if w.proc is None or w.proc.poll() is not None:
                w.start()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            pending = sum(self._pending(w) for w in self.workers)
            if pending == 0:
                break
            time.sleep(1)
        checks = {"pending saves at the end": sum(self._pending(w) for w in self.workers)}
        checks.update(self._check_store())
        checks.update(self._check_resources())
        return {
            "checks": checks,
            "wrong": self.ledger.wrong,
            "counts": dict(self.ledger.counts),
            "faults": self.faults,
            "samples": self.samples,
            "minutes": self.args.minutes,
            "tmpfs": self.tmpfs,
        }

    def _pending(self, w: Worker) -> int:
        try:
            ready = httpx.get(w.url + "/ready", timeout=10).json()
        except (httpx.HTTPError, ValueError):
            return 1
        return sum(m.get("pending_saves", 0) for m in ready.get("models", {}).values())

    def _check_store(self) -> dict[str, Any]:
        from langchain_agent_memory.engine.engine import Engine, GenerationParams

        out: dict[str, Any] = {}
        with Engine(MODEL, cache_dir=self.root / "reader", store=self.store, blocks=self.blocks) as reader:
            store = reader.admin.store
            out["dangling references"] = store.catalog.dangling(reader.fingerprint)
            lost, resumed, agents = [], Counter(), sorted(self.ledger.acked)
            for agent in agents:
                record = store.records.get(agent)
                acked = self.ledger.acked[agent][0]
                later = self.ledger.since.get(agent, [])
                text = record.text if record is not None else ""
                if not any(text.startswith(t) for t in [acked, *later]):
                    lost.append(agent)
                    self.ledger.bad(f"agent {agent}: its acknowledged turn is not in the store")
                    continue
                again = reader.generate(
                    agent, text + "\nQ: one last thing?\nA:", GenerationParams(max_tokens=2)
                )
                resumed[str(again.outcome).split("-")[0]] += 1
                if not str(again.outcome).startswith("warm"):
                    self.ledger.bad(f"agent {agent}: resumed {again.outcome}, not warm")
            out["agents checked"] = len(agents)
            out["acknowledged turns lost"] = len(lost)
            out["resumed at the end"] = dict(resumed)
        if out["dangling references"]:
            self.ledger.bad(f"{out['dangling references']} dangling references")
        return out

    def _check_resources(self) -> dict[str, Any]:
        """Each life of each worker (a kill starts another) long enough to judge: the level
        (``LEVEL``) of its last third within GROWTH of its middle third's (the first third is
        warm-up); database connections likewise over the run."""
        out: dict[str, Any] = {}
        for w in self.workers:
            for life in range(1, len(w.started_at) + 1):
                series = [s[w.name] for s in self.samples if s.get(f"{w.name}_start") == life and s[w.name]]
                if len(series) < 9:
                    continue
                third = len(series) // 3
                verdict: dict[str, Any] = {"minutes": round(len(series) * 2 / 60, 1)}
                for key, share in GROWTH.items():
                    values = [s[key] for s in series]
                    mid = [v for v in values[third : 2 * third] if v is not None]
                    end = [v for v in values[2 * third :] if v is not None]
                    if not mid or not end:  # its gauges unread (a worker frozen that long)
                        verdict[key] = "unread"
                        continue
                    middle, last = LEVEL[key](mid), LEVEL[key](end)
                    verdict[key] = [round(middle, 1), round(last, 1)]
                    if last > middle * (1 + share) + SLACK[key]:
                        self.ledger.bad(
                            f"worker {w.name} (life {life}): {key} grew from {middle:.0f} to {last:.0f}"
                        )
                out[f"worker {w.name}, life {life}"] = verdict
        conns = [s["db_connections"] for s in self.samples if s["db_connections"] is not None]
        if len(conns) >= 9:
            third = len(conns) // 3
            middle, last = max(conns[third : 2 * third]), max(conns[2 * third :])
            out["db connections"] = [middle, last]
            if last > middle + 6:
                self.ledger.bad(f"database connections grew from {middle} to {last}")
        return out


def plot(data: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(4, 1, figsize=(10, 11), sharex=False)
    samples = data["samples"]
    for ax, key, label in zip(
        axes[:3],
        ("rss_mb", "fds", "threads"),
        ("MB (dots: RSS; line: mlx arrays less the caches)", "open files", "threads"),
        strict=True,
    ):
        for name in ("a", "b", "c"):
            ts = [s["t"] / 60 for s in samples if s.get(name)]
            ys = [s[name][key] for s in samples if s.get(name)]
            dots = ax.plot(ts, ys, ".", markersize=3, label=f"worker {name}")
            if key == "rss_mb":  # beside RSS, what is judged: mlx's arrays less what the caches hold
                kept = [
                    (s["t"] / 60, s[name]["unheld_mb"])
                    for s in samples
                    if s.get(name) and s[name].get("unheld_mb") is not None
                ]
                ax.plot(
                    [t for t, _ in kept], [y for _, y in kept], "-", color=dots[0].get_color(), linewidth=1
                )
        for f in data["faults"]:
            ax.axvspan(f["t"] / 60, (f["t"] + max(f["s"], 1)) / 60, color="red", alpha=0.12)
        ax.set_ylabel(label)
        ax.legend(loc="upper left", fontsize=8)
    axes[2].set_xlabel("minutes (red: a fault injected)")
    served = {k.removeprefix("served "): v for k, v in data["counts"].items() if k.startswith("served ")}
    axes[3].bar(list(served), list(served.values()))
    axes[3].set_title("turns served, by where the agent's cache was")
    fig.suptitle(
        f"soak: {data['minutes']} min, 3 workers, {len(data['faults'])} faults, "
        f"{len(data['wrong'])} invariant(s) broken"
    )
    fig.tight_layout()
    fig.savefig(out, dpi=100)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=20.0)
    ap.add_argument("--clients", type=int, default=6)
    ap.add_argument("--agents", type=int, default=10)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--fault-every", type=float, default=25.0, help="seconds between faults")
    ap.add_argument("--freeze-s", type=float, default=8.0, help="how long a stopped process stays stopped")
    ap.add_argument("--request-timeout-s", type=float, default=120.0)
    ap.add_argument("--disk-mb", type=int, default=512, help="worker c's tmpfs")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    soak = Soak(args)
    # Stopped (SIGTERM), it still stops the workers and services it started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        data = soak.run()
    finally:
        soak.close()
    (out / "soak.json").write_text(json.dumps(data, indent=1))
    plot(data, out / "soak.png")
    print("\n  what            | count")
    for k, v in sorted(data["counts"].items()):
        print(f"  {k:<30} | {v}")
    print("\n  check           | value")
    for k, v in data["checks"].items():
        print(f"  {k:<30} | {v}")
    print(f"\nfaults: {len(data['faults'])}; invariants broken: {len(data['wrong'])}")
    for w in data["wrong"][:20]:
        print("  -", w)
    print(f"wrote {out / 'soak.json'} and {out / 'soak.png'}")
    return 1 if data["wrong"] else 0


if __name__ == "__main__":
    sys.exit(main())
