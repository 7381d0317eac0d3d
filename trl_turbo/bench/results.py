"""Result files of the benchmarks: JSON + PNG writing, run metadata, and the Markdown table for the README.

Design decision: every benchmark writes one self-describing JSON file per run (``<benchmark>-<shape>-<timestamp>``)
holding the commit, GPU, library versions and exact command next to flat ``rows``; nothing else is ever edited in
place. The PNG and the Markdown table are views derived from those rows, so results from several runs (or machines)
are combined by reading the files, never by merging state. In the table, a row key that appears in several files
takes its values from the newest file; runs on different GPUs are never mixed in one table.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from ..versions import installed_version

GIB = 1024**3
DEFAULT_RESULTS_DIR = Path("benchmarks/results")
_REPO_ROOT = Path(__file__).resolve().parents[2]
_DISTRIBUTIONS = {
    "torch": "torch",
    "transformers": "transformers",
    "trl": "trl",
    "peft": "peft",
    "accelerate": "accelerate",
    "triton": "triton",
    "vllm": "vllm",
    # vLLM runs its all-reduce + RMSNorm fusion (tensor parallel) and its sampler through flashinfer where it imports
    "flashinfer": "flashinfer-python",
    "bitsandbytes": "bitsandbytes",
    "liger_kernel": "liger-kernel",
    "trl_turbo": "trl-turbo",
}
# For each benchmark: the row field naming the implementation, the baseline it is compared to, and the metrics that
# the table shows (metric, header label, format) — the ratio columns divide the others by the baseline.
_TABLE_LAYOUT: dict[str, dict[str, Any]] = {
    "train": {
        "impl": "variant",
        "baseline": "stock",
        "key": ("quantization", "micro_batch", "prompt_len", "completion_len", "tis"),
        "metrics": (("peak_gib", "peak GiB", "{:.2f}"), ("step_s", "step s", "{:.2f}")),
    },
    "e2e": {
        "impl": "variant",
        "baseline": "stock",
        "key": ("quantization", "launch", "processes", "generations", "prompt_len", "completion_len"),
        "defaults": {"quantization": "none", "launch": "1gpu", "processes": 1},  # rows from before these fields
        "metrics": (("peak_gib", "peak GiB", "{:.2f}"), ("step_s", "step s", "{:.2f}"), ("sync_s", "sync s", "{:.3f}")),
    },
    "loss": {
        "impl": "impl",
        "baseline": "trl",
        "key": ("hidden", "vocab", "micro_batch", "completion_len"),
        "metrics": (("peak_extra_gib", "extra GiB", "{:.2f}"), ("fwd_bwd_ms", "fwd+bwd ms", "{:.1f}")),
    },
}


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=_REPO_ROOT, capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def metadata(benchmark: str, device: torch.device, config: dict[str, Any]) -> dict[str, Any]:
    """Everything that identifies a run, for the top of its JSON file."""
    versions = {name: installed_version(dist) for name, dist in _DISTRIBUTIONS.items()}
    versions["cuda"] = torch.version.cuda
    # The GPU machine receives a copy of the working tree without .git: the caller names the commit there
    # (TRL_TURBO_COMMIT=$(git rev-parse HEAD), set here before sending; dirty only if the tree was).
    # The variables win when set: a copied tree may carry a stale .git of its own.
    if os.environ.get("TRL_TURBO_COMMIT"):
        commit = os.environ["TRL_TURBO_COMMIT"]
        dirty = os.environ.get("TRL_TURBO_DIRTY", "1") != "0"
    else:
        status = _git("status", "--porcelain", "--untracked-files=no")  # carried, untracked folders are not code
        commit = _git("rev-parse", "HEAD") or "unknown"
        dirty = bool(status) if status is not None else True
    return {
        "benchmark": benchmark,
        "commit": commit,
        "dirty": dirty,
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
        "versions": versions,
        "command": " ".join(sys.orig_argv),
        "config": config,
    }


COMPLETION_AXIS = ("completion_len", "completion length (tokens)")


def plot(rows: list[dict[str, Any]], series: Callable[[dict[str, Any]], str], panels: Iterable[tuple[str, str]],
         title: str, path: Path, x: tuple[str, str] = COMPLETION_AXIS) -> None:
    """One subplot per ``(metric, y label)`` of ``panels``, metric against the row field ``x`` (completion length by
    default), one line per series."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = list(panels)
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    names = sorted({series(row) for row in rows})
    for ax, (metric, label) in zip(axes[0], panels):
        for name in names:
            points = sorted(
                (row[x[0]], row[metric])
                for row in rows
                if series(row) == name and row["ok"] and row.get(metric) is not None
            )
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, marker="o", label=name)
            failed = [row[x[0]] for row in rows if series(row) == name and not row["ok"]]
            for position in failed:
                ax.axvline(position, linestyle=":", alpha=0.4)
        ax.set_xlabel(x[1])
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(title + "  (dotted: OOM)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def finish_figure(fig: Any, axes: Iterable[Any], title: str, path: Path) -> None:
    """Grid and legend on each axis (a legend where something is labelled), the title, then save and close."""
    import matplotlib.pyplot as plt

    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write(meta: dict[str, Any], rows: list[dict[str, Any]], shape: str, out_dir: Path,
          series: Callable[[dict[str, Any]], str], panels: Iterable[tuple[str, str]], stem: str | None = None,
          x: tuple[str, str] = COMPLETION_AXIS) -> Path:
    """Write ``<benchmark>-<shape>-<timestamp>.json`` (or ``<stem>.json``) and its PNG into ``out_dir``; return the
    JSON path. Calling it again with the same ``stem`` rewrites both files, so long runs can save after every row."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = stem or f"{meta['benchmark']}-{shape}-{_dt.datetime.now().strftime('%Y%m%d-%H%M%S')}"
    json_path = out_dir / f"{stem}.json"
    json_path.write_text(json.dumps({**meta, "rows": rows}, indent=2) + "\n")
    plot(rows, series, panels, f"{meta['benchmark']} {shape} on {meta['gpu']}", out_dir / f"{stem}.png", x)
    return json_path


def _cell(row: dict[str, Any] | None, metric: str, fmt: str) -> str:
    if row is None:
        return "–"
    if not row["ok"]:
        return "OOM" if row.get("error") in (None, "OOM") else "error"
    value = row.get(metric)
    return "–" if value is None else fmt.format(value)


def _ratio(row: dict[str, Any] | None, base: dict[str, Any] | None, metric: str) -> str:
    if row is None or base is None or not (row["ok"] and base["ok"]):
        return "–"
    if row.get(metric) is None or not base.get(metric):
        return "–"
    return f"{row[metric] / base[metric]:.2f}×"


def _sort_key(value: Any) -> tuple[int, Any]:
    """Row keys mix None (older files without a field), numbers and strings: order within each kind."""
    if value is None:
        return (0, 0)
    return (1, value) if isinstance(value, (int, float)) else (2, str(value))


def render_table(results_dir: Path) -> str:
    """Markdown of every result file in ``results_dir``: one table per (benchmark, shape, GPU), with baseline ratios."""
    runs = []
    for path in sorted(results_dir.glob("*.json")):
        data = json.loads(path.read_text())
        if data.get("benchmark") in _TABLE_LAYOUT:
            runs.append(data)
    runs.sort(key=lambda run: run["date"])
    groups: dict[tuple[str, str, str], dict[tuple[Any, ...], dict[str, dict[str, Any]]]] = {}
    commits: dict[tuple[str, str, str], list[str]] = {}
    for run in runs:
        layout = _TABLE_LAYOUT[run["benchmark"]]
        group_key = (run["benchmark"], run["config"].get("shape", "?"), run["gpu"])
        group = groups.setdefault(group_key, {})
        commit = run["commit"][:10] + ("+dirty" if run["dirty"] else "")
        if commit not in commits.setdefault(group_key, []):
            commits[group_key].append(commit)
        for row in run["rows"]:
            key = tuple(row.get(field, layout.get("defaults", {}).get(field)) for field in layout["key"])
            group.setdefault(key, {})[row[layout["impl"]]] = row
    parts = []
    for (benchmark, shape, gpu), group in sorted(groups.items()):
        layout = _TABLE_LAYOUT[benchmark]
        impls = sorted(
            {impl for by_impl in group.values() for impl in by_impl}, key=lambda i: (i != layout["baseline"], i)
        )
        others = [impl for impl in impls if impl != layout["baseline"]]
        header = list(layout["key"])
        for _metric, label, _ in layout["metrics"]:
            header += [f"{impl} {label}" for impl in impls]
            if layout["baseline"] in impls:
                header += [f"{impl}/{layout['baseline']} {label}" for impl in others]
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for key, by_impl in sorted(group.items(), key=lambda item: tuple(map(_sort_key, item[0]))):
            cells = [str(k) for k in key]
            base = by_impl.get(layout["baseline"])
            for metric, _, fmt in layout["metrics"]:
                cells += [_cell(by_impl.get(impl), metric, fmt) for impl in impls]
                if layout["baseline"] in impls:
                    cells += [_ratio(by_impl.get(impl), base, metric) for impl in others]
            lines.append("| " + " | ".join(cells) + " |")
        origin = ", ".join(commits[(benchmark, shape, gpu)])
        parts.append(f"### {benchmark}: {shape} on {gpu}\n\n_commits: {origin}_\n\n" + "\n".join(lines))
    return "\n\n".join(parts) + "\n" if parts else "_no results_\n"


def add_table_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("table", help="render a Markdown table from all result JSON files")
    parser.add_argument("--results", type=Path, default=DEFAULT_RESULTS_DIR, help="folder of result JSON files")
    parser.set_defaults(func=lambda args: print(render_table(args.results), end=""))
