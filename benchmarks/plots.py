"""PNG plots: throughput per system, latency CDFs, slot occupancy over time."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
import numpy as np  # noqa: E402
from matplotlib.ticker import NullFormatter, ScalarFormatter  # noqa: E402

from benchmarks.systems import BASELINE  # noqa: E402

_COLORS = {"continuous": "tab:blue", "static": "tab:orange", "hf_generate": "tab:red",
           "hf_generate_batch": "tab:green", "served": "tab:purple",
           "served_haproxy": "tab:brown"}


def _color(name: str) -> str:
    return _COLORS.get(name, "tab:gray")


def _ok(systems: dict) -> dict:
    return {name: s for name, s in systems.items() if "error" not in s}


def plot_throughput(results: dict, path: Path) -> None:
    systems = _ok(results["systems"])
    names = list(systems)
    useful = [systems[n]["output_tokens_per_s"] for n in names]
    computed = [systems[n]["computed_tokens"] / systems[n]["makespan_s"] for n in names]
    fig, ax = plt.subplots(figsize=(7.5, 4))
    x = np.arange(len(names))
    ax.bar(x, computed, color="none", edgecolor=[_color(n) for n in names], hatch="//", label="computed tokens/s")
    bars = ax.bar(x, useful, color=[_color(n) for n in names], label="useful output tokens/s")
    base = systems.get(BASELINE, {}).get("output_tokens_per_s")
    for bar, name, value in zip(bars, names, useful):
        label = f"{value:.0f}" + (f"\n{value / base:.2f}x continuous" if base and name != BASELINE else "")
        ax.annotate(label, (bar.get_x() + bar.get_width() / 2, value), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(x, [systems[n]["title"] for n in names], fontsize=8)
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"Throughput, workload {results['workload']['name']} ({results['model']})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _cdf(ax, values: list[float], name: str, title: str) -> None:
    values = sorted(v for v in values if v is not None and v > 0)
    if values:
        ax.step(values, np.arange(1, len(values) + 1) / len(values), where="post", color=_color(name), label=title)


def plot_latency_cdfs(results: dict, path: Path) -> None:
    systems = _ok(results["systems"])
    fig, axes = plt.subplots(1, 3, figsize=(13, 4), sharey=True)
    panels = (("ttft_s", "time to first token (s)"), ("mean_itl_s", "mean inter-token latency per request (s)"),
              ("e2e_s", "end-to-end latency (s)"))
    for ax, (key, label) in zip(axes, panels):
        for name, s in systems.items():
            _cdf(ax, [r[key] for r in s["requests"]], name, s["title"])
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("fraction of requests")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Latency CDFs, workload {results['workload']['name']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


_HF_PEERS = ("hf_generate", "hf_generate_batch")


def plot_occupancy(results: dict, path: Path) -> None:
    """slotserve's systems on the left, HF's on the right: each pair on its own time scale."""
    systems = {n: s for n, s in _ok(results["systems"]).items() if s.get("occupancy_timeline")}
    groups = [[n for n in systems if n not in _HF_PEERS], [n for n in systems if n in _HF_PEERS]]
    groups = [g for g in groups if g] or [[]]
    fig, axes = plt.subplots(1, len(groups), figsize=(6.5 * len(groups), 4), sharey=True, squeeze=False)
    for ax, names in zip(axes[0], groups):
        for name in names:
            s = systems[name]
            t, v = zip(*s["occupancy_timeline"])
            ax.step(t, v, where="post", color=_color(name), lw=1.3,
                    label=f"{s['title']} (mean {s['mean_slot_occupancy']:.2f})")
        ax.set_xlabel("time since start (s)")
        ax.set_ylim(0, 1.05)
        ax.grid(alpha=0.3)
        if names:
            ax.legend(fontsize=8)
    axes[0][0].set_ylabel("busy slots / slots")
    fig.suptitle(f"Slot occupancy over time, workload {results['workload']['name']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_plots(results: dict, out_dir: Path) -> list[str]:
    out_dir.mkdir(parents=True, exist_ok=True)
    name = results["workload"]["name"]
    paths = {plot_throughput: out_dir / f"{name}-throughput.png",
             plot_latency_cdfs: out_dir / f"{name}-latency-cdf.png",
             plot_occupancy: out_dir / f"{name}-occupancy.png"}
    if not _ok(results["systems"]):
        return []
    for plot, path in paths.items():
        plot(results, path)
    return [str(p) for p in paths.values()]
