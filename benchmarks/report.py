"""Render the tables of benchmarks/README.md from benchmarks/results/*.json.

benchmarks/README.md is written by hand: its headings, commands and prose are edited there.
Only the regions it marks are generated, each between two comment lines of its own:

    <!-- generated: NAME -->
    ...the table (or list) rendered from results/*.json; rewritten on every run...
    <!-- /generated -->

NAME is a key of ``RENDERERS`` (lower case, digits and dashes). This script replaces what
lies between each pair of markers with its renderer's output and leaves every byte outside
them as it is. Every marked region needs a renderer and every renderer a region: either
mismatch, a malformed or unclosed marker, or a missing results file stops it with a message.
The plots (``results/*.png``) are drawn by each benchmark's own script; the README links them.

    .venv/bin/python benchmarks/report.py            # after any benchmark: rewrite the regions
    .venv/bin/python benchmarks/report.py --check    # exit 1, naming the regions, if out of date
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
README = HERE / "README.md"

START = re.compile(r"<!-- generated: (?P<name>[a-z0-9][a-z0-9-]*) -->")
END = "<!-- /generated -->"
MARKER_LIKE = re.compile(r"\s*<!--\s*/?\s*generated\b")


class ReportError(Exception):
    """The README's markers and the renderers do not fit, or a results file is missing."""


@dataclass(frozen=True)
class Region:
    """A marked region of the README: ``text[start:end]`` is its body (whole lines)."""

    name: str
    start: int
    end: int


# --- Formatting helpers (``_num`` is also imported by ttft.py) ---------------------------


def _md(header: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def _num(value: float | None, spec: str, unit: str = "") -> str:
    """A table cell: ``value`` formatted, or "-" where it was not measured."""
    return "-" if value is None else f"{value:{spec}}{unit}"


def _load(name: str) -> Any:
    path = RESULTS / f"{name}.json"
    if not path.exists():
        raise ReportError(f"{path.relative_to(HERE.parent)} not found: run its benchmark first")
    return json.loads(path.read_text())


# --- Time to first token (ttft.py) ---------------------------------------------------------

TTFT_HEADER = ["model", "tokens", "system", "cold s", "warm s", "hot s", "cold/warm", "cold/hot",
               "saved MB", "warm vs ours-q4"]  # fmt: skip
TTFT_FOOTNOTE = "\\* past SmolLM2's trained context (8,192 tokens)."


def _ttft_row(r: dict[str, Any], rows: list[dict[str, Any]], started: bool) -> list[str]:
    key = (r["model"], r["n"], "ours-q4")
    ours = next((o for o in rows if (o["model"], o["n"], o["system"]) == key), None)
    mark = "*" if r.get("beyond_trained_context") else ""
    cells = [
        r["model"], f"{r['tokens']}{mark}", f"`{r['system']}`", _num(r["cold_s"], ".2f"),
        f"{r['warm_s']:.3f}", f"{r['hot_s']:.3f}", _num(r["cold_over_warm"], ".0f", "x"),
        _num(r["cold_over_hot"], ".0f", "x"), f"{r['disk_bytes'] / 1e6:.1f}",
        f"{r['warm_s'] / ours['warm_s']:.2f}x" if ours else "-",
    ]  # fmt: skip
    if started:  # runs since start_s was recorded
        cells.append(f"{r['start_s'] + r['warm_s']:.3f}" if r.get("start_s") else "-")
    return cells


def _ttft_notes(data: dict[str, Any], rows: list[dict[str, Any]]) -> list[str]:
    """The systems a run skipped, and how mlx-lm-q4's unmeasured cold prefills were built."""
    skipped = {f"{r['system']} on {r['model']}: {r['skipped']}" for r in data["rows"] if "skipped" in r}
    notes = [f"- skipped: {s}" for s in sorted(skipped)]
    slow = [r for r in rows if r["system"] == "mlx-lm-q4" and r["cold_s"]]
    if any(r["cold_s"] is None for r in rows) and slow:
        worst = max(slow, key=lambda r: r["n"])
        notes.append(
            f'- `mlx-lm-q4` cold "-": its 4-bit prefill took {worst["cold_s"]:.0f} s at '
            f"{worst['tokens']} tokens, so beyond that its state is built by a full-precision prefill "
            "and quantized at the end (the same saved state); its warm and hot are measured as for "
            "the others."
        )
    return notes


def ttft_table(name: str) -> str:
    """A ``ttft.py`` results file as a table, the legend of its ``*`` mark, and its notes."""
    data = _load(name)
    rows = [r for r in data["rows"] if "skipped" not in r]
    started = any(r.get("start_s") for r in rows)
    header = TTFT_HEADER + (["start+warm s"] if started else [])
    table = _md(header, [_ttft_row(r, rows, started) for r in rows])
    return "\n".join([table, "", TTFT_FOOTNOTE, *_ttft_notes(data, rows)])


# --- CPU benchmarks ------------------------------------------------------------------------


def decode_ahead() -> str:
    out = []
    for data in (_load(f"decode_ahead_{d}") for d in ("cpu", "gpu")):
        for r in data["rows"]:
            a, b = r["step by step"]["median"], r["one ahead"]["median"]
            out.append([data["device"], r["model"], r["weights"], str(r["context"]), r["kv"],
                        f"{a:.1f}", f"{b:.1f}", f"{b / a:.2f}x"])  # fmt: skip
    header = ["device", "model", "weights", "context", "KV", "step by step tok/s", "one ahead tok/s", "ratio"]
    return _md(header, out)


def capacity() -> str:
    data = _load("capacity")
    out = []
    for r in data["rows"]:
        cells = [
            r["model"], str(r["tokens"]), f"`{r['system']}`", f"{r['memory_bytes'] / 1e6:.1f}",
            f"{r['memory_over_fp16_formula']:.3f}", f"{r['rss_delta_bytes'] / 1e6:.1f}",
        ]  # fmt: skip
        out.append(cells + [str(v) for v in r["agents"].values()])
    header = ["model", "tokens", "system", "parked MB", "parked / FP16 formula", "serving RSS MB"]
    return _md(header + [f"agents in {b:g} GiB" for b in data["budgets_gib"]], out)


def fidelity() -> str:
    out = []
    for model, d in _load("fidelity").items():
        base = d["ppl_512"]["fp16"]
        for fmt in (f for f in ("q4", "k6v4-rot-h4", "q8") if f in d["ppl_512"]):
            longs = {ctx: v[fmt] / v["fp16"] - 1 for ctx, v in d["ppl_long"].items()}
            agree = d["agreement"][fmt]
            out.append([
                model, f"`{fmt}`",
                f"{d['ppl_512'][fmt]:.2f} vs {base:.2f} ({d['ppl_512'][fmt] / base - 1:+.1%})",
                ", ".join(f"{ctx}: {v:+.1%}" for ctx, v in longs.items()),
                f"{sum(a >= 32 for a in agree)}/{len(agree)}", f"{statistics.mean(agree):.0f} of 48",
            ])  # fmt: skip
    header = ["model", "KV format", "ppl, 512-token windows (vs FP16)", "ppl change, long windows",
              "prompts agreeing >= 32 tokens", "mean agreeing tokens"]  # fmt: skip
    return _md(header, out)


def _ttft_mean_max(phase: dict[str, Any]) -> str:
    v = [row["ttft_s"] for row in phase["rows"]]
    return f"{statistics.mean(v):.2f} / {max(v):.2f}"


def workflow() -> str:
    data = _load("workflow")
    out = []
    for p, c in zip(data["phases"]["persistent"], data["phases"]["cleared"], strict=True):
        tokens = statistics.mean(row["prompt_tokens"] for row in p["rows"])
        out.append([
            str(p["phase"]), f"{tokens:.0f}", _ttft_mean_max(p), f"{p['wall_s']:.2f}",
            _ttft_mean_max(c), f"{c['wall_s']:.2f}", f"{c['wall_s'] / p['wall_s']:.1f}x",
        ])  # fmt: skip
    tot = data["total_wall_s"]
    out.append(["total", "", "", f"{tot['persistent']:.1f}", "", f"{tot['cleared']:.1f}",
                f"{tot['cleared'] / tot['persistent']:.1f}x"])  # fmt: skip
    header = ["phase", "prompt tokens (mean)", "persistent TTFT mean / max s", "phase s",
              "cleared TTFT mean / max s", "phase s", "cleared / persistent"]  # fmt: skip
    return _md(header, out)


def routing() -> str:
    s = _load("routing")["summary"]
    cold = s["cold"]["query_wall_mean_s"]
    out = [
        [mode, str(v["calls"]), f"{v['ttft_median_s']:.2f}", f"{v['ttft_max_s']:.2f}",
         f"{v['query_wall_mean_s']:.2f}", f"{cold / v['query_wall_mean_s']:.0f}x", ", ".join(v["caches"])]
        for mode, v in s.items()
    ]  # fmt: skip
    header = ["mode", "expert calls", "TTFT median s", "TTFT max s", "query wall mean s", "vs cold",
              "cache outcomes"]  # fmt: skip
    return _md(header, out)


def server_ttft() -> str:
    out = []
    for r in _load("server")["ttft"].values():
        w, c = r["turn3_warm_after_restart"], r["turn3_cold"]
        out.append([
            str(w["prompt_tokens"]), f"{r['turn1_cold']['client_ttft_s']:.2f}",
            f"{r['turn2_hot']['client_ttft_s']:.2f}", f"{w['client_ttft_s']:.2f}",
            f"{c['client_ttft_s']:.2f}", f"{c['client_ttft_s'] / w['client_ttft_s']:.0f}x",
        ])  # fmt: skip
    header = ["prompt tokens", "turn 1 cold s", "turn 2 hot s", "turn 3 after restart s", "turn 3 cold s",
              "restart vs cold"]  # fmt: skip
    return _md(header, out)


def server_concurrent() -> str:
    conc = _load("server")["concurrent"]
    one = conc[0]["tokens_per_s"]
    rows = [[str(r["clients"]), f"{r['tokens_per_s']:.1f}", f"{r['tokens_per_s'] / one:.2f}x"] for r in conc]
    return _md(["clients", "tokens/s", "vs one"], rows)


def concurrency_batch() -> str:
    s = _load("concurrency")["summary"]
    rows = [[b, f"{v['tokens_per_s']:.1f}", f"{v['steady_tokens_per_s']:.1f}",
             f"{v['tokens_per_s'] / s['1']['tokens_per_s']:.2f}x"] for b, v in s.items()]  # fmt: skip
    return _md(["batch", "decode tok/s", "steady tok/s", "vs batch 1"], rows)


def concurrency_staggered() -> str:
    rows = [[k, f"{v['b_ttft_s']:.2f}"] for k, v in _load("concurrency")["staggered"].items()]
    return _md(["policy", "TTFT s"], rows)


def fanout() -> str:
    data = _load("fanout")
    rows = []
    for r in data["rows"]:
        w, ph = r["wall_s"], r["phases"]
        rows.append([
            str(r["items"]), f"{w['sequential']:.2f}", f"{w['fan-out']:.2f}", f"{w['mlx-lm batch']:.2f}",
            f"{r['fan_over_sequential']:.2f}x", f"{r['fan_over_mlx_batch']:.2f}x",
            *(f"{ph[k]:.3f}" for k in ("load_s", "fork_s", "prefill_s", "decode_s", "save_s")),
            f"{r['other_s']:.2f}",
        ])  # fmt: skip
    header = [
        "Sends", "sequential s", "fan-out s", "mlx-lm batch s", "fan-out / sequential", "fan-out / mlx-lm",
        "load s", "fork s", "prefill s", "decode s", "save s", "other s",
    ]  # fmt: skip
    return _md(header, rows)


def distributed_latency() -> str:
    systems = ["cold", "same worker", "other worker", "local store"]
    rows = []
    for n, row in _load("distributed")["latency"].items():
        t, s = row["ttft_s"], row["save_s"]
        rows.append([
            n, *(f"{t[k]:.3f}" for k in systems), f"{t['other worker'] / t['same worker']:.2f}x",
            f"{t['cold'] / t['other worker']:.1f}x", f"{s['first, local']:.2f} / {s['first, shared']:.2f}",
            f"{s['follow-up, local']:.3f} / {s['follow-up, shared']:.3f}",
        ])  # fmt: skip
    header = ["context", *systems, "other / same", "cold / other", "first save s: local / shared",
              "follow-up save s: local / shared"]  # fmt: skip
    return _md(header, rows)


def distributed_throughput() -> str:
    tput = _load("distributed")["throughput_turns_per_s"]
    one = tput.get("1")
    rows = [[w, f"{v:.2f}", f"{v / one:.2f}x" if one else "-"] for w, v in tput.items()]
    return _md(["workers", "turns / s", "vs 1"], rows)


# --- The H200 (gpu.py, gpu_sliding.py) ------------------------------------------------------

GPU_HEADER = ["model (RANDOM WEIGHTS)", "context", "system", "cold s", "warm s", "(load s)", "hot s",
              "decode tok/s", "parked MB", "served MB", "run"]  # fmt: skip
STEADY_KEYS = ("ours_hot_ttft_s", "forward_ours_s", "forward_mlx_kvcache_s")


def gpu_runs() -> str:
    """The legend of the ``run`` column: one line per run of the table."""
    return "\n".join(f"- {k}: {v}" for k, v in _load("gpu").get("runs", {}).items())


def gpu_steps() -> str:
    steps = ", ".join(f"{st['step']} {st['s']:.0f} s" for st in _load("gpu")["steps"])
    return f"Device time per step: {steps}."


def _gpu_row(model: str, r: dict[str, Any]) -> list[str]:
    if "error" in r:
        return [model, str(r["context"]), r["system"], "error: " + r["error"][:60]] + [""] * 7
    warm, mem = r.get("warm", {}), r.get("memory", {})
    served = mem["served_bytes"] / 1e6 if mem else r["cold"].get("memory_bytes", 0) / 1e6
    return [
        model, str(r["context"]), r["system"], _num(r["cold"].get("ttft_s"), ".3f"),
        _num(warm.get("ttft_s"), ".3f"), _num(warm.get("load_s"), ".3f"), _num(r["hot"].get("ttft_s"), ".3f"),
        _num(r.get("decode_tok_s"), ".1f"), _num(mem["parked_bytes"] / 1e6 if mem else None, ".0f"),
        _num(served, ".0f"), r.get("run", ""),
    ]  # fmt: skip


def gpu_ttft() -> str:
    models = _load("gpu")["models"]
    return _md(GPU_HEADER, [_gpu_row(m["model"], r) for m in models for r in m["rows"]])


def gpu_batch() -> str:
    rows = [
        [str(b["batch"]), _num(b.get("ours_tok_s"), ".1f"), _num(b.get("mlx_lm_tok_s"), ".1f")]
        for m in _load("gpu")["models"]
        for b in m.get("batch_decode", [])
    ]
    return _md(["batch", "ours tok/s", "mlx-lm tok/s"], rows)


def gpu_steady() -> str:
    def cell(xs: list[float] | None) -> str:
        return " / ".join(f"{x:.3f}" for x in xs) if xs else "-"

    steady = _load("gpu").get("hot_steady", {}).get("rows", [])
    rows = [[str(r["context"])] + [cell(r[k]) for k in STEADY_KEYS] for r in steady]
    return _md(["context", "ours hot TTFT s", "forward: ours s", "forward: mlx-lm KVCache s"], rows)


def gpu_sliding() -> str:
    data = _load("gpu_sliding")
    cells: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in data["rows"]:
        cells.setdefault((r["tree"], r["context"]), []).append(r)
    rows = []
    for (tree, ctx), rs in sorted(cells.items(), key=lambda kv: (kv[0][1], data["trees"].index(kv[0][0]))):

        def med(key: str, rs: list[dict[str, Any]] = rs) -> float:
            return statistics.median(r[key] for r in rs)

        rows.append([
            tree, f"{ctx:,}", str(len(rs)), f"{med('prefill_s'):.2f}", f"{med('save_s'):.2f}",
            f"{med('peak_gb'):.1f}", f"{med('hot_ttft_s'):.3f}",
        ])  # fmt: skip
    return _md(["tree", "tokens", "runs", "prefill s", "save s", "peak GB", "hot TTFT s"], rows)


RENDERERS: dict[str, Callable[[], str]] = {
    "ttft": partial(ttft_table, "ttft"),
    "ttft-zen5": partial(ttft_table, "ttft_zen5"),
    "ttft-zen5-warm": partial(ttft_table, "ttft_zen5_warm"),
    "decode-ahead": decode_ahead,
    "capacity": capacity,
    "fidelity": fidelity,
    "workflow": workflow,
    "routing": routing,
    "server-ttft": server_ttft,
    "server-concurrent": server_concurrent,
    "concurrency-batch": concurrency_batch,
    "concurrency-staggered": concurrency_staggered,
    "fanout": fanout,
    "distributed-latency": distributed_latency,
    "distributed-throughput": distributed_throughput,
    "gpu-runs": gpu_runs,
    "gpu-steps": gpu_steps,
    "gpu-ttft": gpu_ttft,
    "gpu-batch": gpu_batch,
    "gpu-steady": gpu_steady,
    "gpu-sliding": gpu_sliding,
}


# --- The README's regions ------------------------------------------------------------------


def find_regions(text: str) -> list[Region]:
    """Every marked region of ``text``, in order; ReportError on a malformed, nested,
    unclosed or repeated marker."""
    regions: list[Region] = []
    open_name: str | None = None
    body_start = offset = 0
    for number, line in enumerate(text.split("\n"), 1):
        start = START.fullmatch(line)
        if start and open_name is None:
            open_name, body_start = start["name"], offset + len(line) + 1
        elif line == END and open_name is not None:
            regions.append(Region(open_name, body_start, offset))
            open_name = None
        elif start or line == END or MARKER_LIKE.match(line):
            raise ReportError(f"README line {number}: unexpected or malformed marker {line.strip()!r}")
        offset += len(line) + 1
    if open_name is not None:
        raise ReportError(f"region {open_name!r} has no closing {END}")
    names = [r.name for r in regions]
    if repeated := sorted({n for n in names if names.count(n) > 1}):
        raise ReportError(f"regions marked more than once: {', '.join(repeated)}")
    return regions


def _check_names(regions: Iterable[Region], renderers: dict[str, Callable[[], str]]) -> None:
    marked = {r.name for r in regions}
    if unknown := sorted(marked - renderers.keys()):
        raise ReportError(f"README marks regions no renderer fills: {', '.join(unknown)}")
    if missing := [n for n in renderers if n not in marked]:
        raise ReportError(f"renderers whose region is missing from the README: {', '.join(missing)}")


def render(text: str, renderers: dict[str, Callable[[], str]] = RENDERERS) -> tuple[str, list[str]]:
    """``text`` with every region's body rendered anew, and the names of the regions that
    changed; everything outside the regions is kept byte for byte."""
    regions = find_regions(text)
    _check_names(regions, renderers)
    parts: list[str] = []
    changed: list[str] = []
    pos = 0
    for region in regions:
        body = renderers[region.name]().strip("\n")
        body = body + "\n" if body else ""
        if body != text[region.start : region.end]:
            changed.append(region.name)
        parts += [text[pos : region.start], body]
        pos = region.end
    parts.append(text[pos:])
    return "".join(parts), changed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Render benchmarks/README.md's tables from results/*.json.")
    ap.add_argument("--check", action="store_true", help="exit 1 if the README's tables are out of date")
    ap.add_argument("--readme", type=Path, default=README, help="the README to fill (default: %(default)s)")
    a = ap.parse_args(argv)
    try:
        text = a.readme.read_bytes().decode()  # bytes: line endings untranslated
        new, changed = render(text)
    except ReportError as exc:
        print(f"report.py: {a.readme}: {exc}", file=sys.stderr)
        return 2
    if a.check:
        if changed:
            print(f"{a.readme} is out of date in: {', '.join(changed)} (run benchmarks/report.py)")
            return 1
        print(f"{a.readme} is up to date ({len(RENDERERS)} regions)")
    elif new != text:
        a.readme.write_bytes(new.encode())
        print(f"{a.readme}: rewrote {', '.join(changed)}")
    else:
        print(f"{a.readme}: up to date ({len(RENDERERS)} regions)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
