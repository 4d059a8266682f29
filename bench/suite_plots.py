"""Plots for bench/suite.py, after the papers' figures. Each function takes
the suite's results dict and writes one small PNG; render() writes all that
the results allow and returns {figure: path}."""
from __future__ import annotations

import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

MiB = 1 << 20
STYLE = {"sync": ("tab:red", "s"), "single": ("tab:orange", "^"), "gpm": ("tab:brown", "v"),
         "torch.save": ("tab:red", "s"), "dcp": ("tab:purple", "D"),
         "torchsnapshot": ("tab:pink", "P"), "nonstop": ("tab:blue", "o"),
         "nonstop-layerwise": ("tab:cyan", "o"), "nonstop-multistep": ("tab:green", "o")}


def _style(name: str):
    if name.startswith("concurrent"):
        n = int(name.split("N=")[-1]) if "N=" in name else 1
        return (plt.cm.Blues(0.45 + 0.15 * n), "o")
    return STYLE.get(name, ("gray", "x"))


def _save(fig, path: str) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=72)
    plt.close(fig)
    return path


def _synthetic_series(out: dict) -> dict:
    series = {}
    for r in out["overhead"]["rows"]:
        name = r["scheme"] if r["scheme"] != "concurrent" else f"concurrent N={r['max_in_flight']}"
        series.setdefault(name, []).append((r["interval"], r["relative"], r["relative_spread"],
                                            r["stall_ms_mean"]))
    return {k: sorted(v) for k, v in series.items()}


def _torch_series(res: dict) -> dict:
    series = {}
    for r in res["rows"]:
        if r["scheme"] == "none":
            continue
        series.setdefault(r["scheme"], []).append((r["interval"], r["relative"],
                                                   r["relative_spread"],
                                                   r["stall_per_ckpt_s"] * 1e3))
    return {k: sorted(v) for k, v in series.items()}


def _throughput_panel(ax, series: dict, title: str) -> None:
    for name, pts in series.items():
        c, m = _style(name)
        xs, ys, es = [p[0] for p in pts], [p[1] for p in pts], [p[2] / 2 for p in pts]
        ax.errorbar(xs, ys, yerr=es, label=name, color=c, marker=m, ms=4, lw=1.2, capsize=2)
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.set_xscale("log")
    xs = sorted({p[0] for pts in series.values() for p in pts})
    if xs:  # ticks at the measured intervals, plain numbers
        ax.set_xticks(xs)
        ax.set_xticklabels([str(x) for x in xs])
        ax.minorticks_off()
        ax.set_xlim(xs[0] / 1.3, xs[-1] * 1.3)
    ax.set_xlabel("checkpoint interval (steps)")
    ax.set_ylabel("throughput / no checkpoints")
    ax.set_title(title, fontsize=9)
    # Noisy runs can measure above 1: keep every point in view.
    top = max([p[1] + p[2] / 2 for pts in series.values() for p in pts] + [1.0])
    ax.set_ylim(0, max(1.1, top + 0.05))
    ax.legend(fontsize=6, loc="lower right")
    ax.grid(alpha=0.3)


def fig8(out: dict, img: str, tag: str):
    panels = []
    if "overhead" in out:
        ov = out["overhead"]
        panels.append((_synthetic_series(out), f"synthetic loop: {ov['state_bytes'] // MiB} MiB, "
                                               f"{ov['step_ms']:.0f} ms steps"))
    for model, res in out.get("torch", {}).items():
        panels.append((_torch_series(res), f"PyTorch GPT {model} ({res['params'] / 1e6:.0f}M), "
                                           f"{res['none_step_s']:.2f} s/step"))
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4), squeeze=False)
    for ax, (series, title) in zip(axes[0], panels):
        _throughput_panel(ax, series, title)
    fig.suptitle("Throughput vs checkpoint interval (cf. PCcheck Fig. 8)", fontsize=10)
    return _save(fig, os.path.join(img, f"suite-{tag}-fig8-throughput.png"))


def fig11(out: dict, img: str, tag: str):
    if "storage" not in out:
        return None
    rows = out["storage"]["rows"]
    xs = [r["bytes"] / MiB for r in rows]
    fig, ax = plt.subplots(figsize=(4.5, 3.4))
    ax.errorbar(xs, [r["nonstop_persist_s"] for r in rows],
                yerr=[r["nonstop_persist_spread_s"] / 2 for r in rows], marker="o",
                label="nonstop (copy + write + crc + commit)", color="tab:blue", capsize=2)
    ax.errorbar(xs, [r["torch_save_fsync_s"] for r in rows],
                yerr=[r["torch_save_fsync_spread_s"] / 2 for r in rows], marker="s",
                label="torch.save + fsync", color="tab:red", capsize=2)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("checkpoint size (MiB)")
    ax.set_ylabel("time to persist (s)")
    ax.set_title("Time to persist one checkpoint (cf. PCcheck Fig. 11)", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, which="both")
    return _save(fig, os.path.join(img, f"suite-{tag}-fig11-persist.png"))


def fig12(out: dict, img: str, tag: str):
    have_ov = "overhead" in out
    have_tune = "tune" in out
    if not (have_ov or have_tune):
        return None
    fig, axes = plt.subplots(1, 2, figsize=(8.4, 3.4))
    if have_ov:
        by_f = {}
        for r in out["overhead"]["rows"]:
            if r["scheme"] == "concurrent":
                by_f.setdefault(r["interval"], []).append((r["max_in_flight"], r["relative"],
                                                           r["relative_spread"]))
        for f, pts in sorted(by_f.items()):
            pts.sort()
            axes[0].errorbar([p[0] for p in pts], [p[1] for p in pts],
                             yerr=[p[2] / 2 for p in pts], marker="o", label=f"interval {f}",
                             capsize=2)
        axes[0].set_xlabel("N (checkpoints in flight)")
        axes[0].set_ylabel("throughput / no checkpoints")
        axes[0].set_title("synthetic loop: concurrent, by N", fontsize=9)
        axes[0].set_ylim(0, 1.1)
        axes[0].legend(fontsize=6)
        axes[0].grid(alpha=0.3)
    if have_tune:
        ps = out["tune"]["measured"]["persist"]
        ns = [p["max_in_flight"] for p in ps]
        axes[1].plot(ns, [p["tw_s"] for p in ps], marker="o", label="T_w (N started together)")
        axes[1].plot(ns, [p["tw_s"] / p["max_in_flight"] for p in ps], marker="s",
                     label="T_w / N")
        axes[1].set_xlabel("N (checkpoints in flight)")
        axes[1].set_ylabel("seconds")
        axes[1].set_title(f"nonstop tune: {out['tune']['measured']['probe_bytes'] // MiB} MiB "
                          f"probe", fontsize=9)
        axes[1].legend(fontsize=7)
        axes[1].grid(alpha=0.3)
    fig.suptitle("Sensitivity to N (cf. PCcheck Fig. 12)", fontsize=10)
    return _save(fig, os.path.join(img, f"suite-{tag}-fig12-n.png"))


def fig9(out: dict, img: str, tag: str):
    sims = out.get("simulate", {})
    if not sims:
        return None
    fig, axes = plt.subplots(1, len(sims), figsize=(4.2 * len(sims), 3.4), squeeze=False)
    for ax, (name, sim) in zip(axes[0], sims.items()):
        series = {}
        for r in sim["rows"]:
            series.setdefault(r["scheme"], []).append((r["interval"], r["goodput_steps_per_s"]))
        for s, pts in series.items():
            pts.sort()
            ls = "--" if s == "ideal" else "-"
            c = "k" if s == "ideal" else None
            ax.plot([p[0] for p in pts], [p[1] for p in pts], ls=ls, color=c, marker=".",
                    label=s, lw=1.2)
        ax.set_xscale("log")
        ax.set_xlabel("checkpoint interval (steps)")
        ax.set_ylabel("goodput (useful steps/s)")
        nb = sim.get("nonstop_best") or {}
        ax.set_title(f"{name}: nonstop best {nb.get('ratio_to_ideal_best', 0):.3f} x ideal",
                     fontsize=9)
        ax.legend(fontsize=6)
        ax.grid(alpha=0.3)
    fig.suptitle("Goodput on the GCP A100 spot trace (cf. PCcheck Fig. 9)", fontsize=10)
    return _save(fig, os.path.join(img, f"suite-{tag}-fig9-goodput.png"))


def fig6(out: dict, img: str, tag: str):
    panels = []
    if "overhead" in out:
        rows = out["overhead"]["rows"]
        f = max(r["interval"] for r in rows)
        bars = [(r["scheme"] if r["scheme"] != "concurrent" else f"conc N={r['max_in_flight']}",
                 r["stall_ms_mean"]) for r in rows if r["interval"] == f]
        panels.append((bars, f"synthetic loop, interval {f}"))
    for model, res in out.get("torch", {}).items():
        f = max(r["interval"] for r in res["rows"])
        bars = [(r["scheme"], r["stall_per_ckpt_s"] * 1e3) for r in res["rows"]
                if r["interval"] == f and r["scheme"] != "none"]
        panels.append((bars, f"PyTorch GPT {model}, interval {f}"))
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4), squeeze=False)
    for ax, (bars, title) in zip(axes[0], panels):
        names = [b[0] for b in bars]
        ax.bar(range(len(bars)), [b[1] for b in bars],
               color=[_style(n if not n.startswith("conc") else "concurrent")[0] for n in names])
        ax.set_xticks(range(len(bars)))
        ax.set_xticklabels(names, rotation=35, ha="right", fontsize=7)
        ax.set_yscale("log")
        ax.set_ylabel("visible stall per checkpoint (ms)")
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle("Training stall per checkpoint (cf. GoCkpt Fig. 6)", fontsize=10)
    return _save(fig, os.path.join(img, f"suite-{tag}-fig6-stall.png"))


def render(out: dict, img: str, tag: str) -> dict:
    figs = {}
    for name, fn in (("fig8", fig8), ("fig11", fig11), ("fig12", fig12), ("fig9", fig9),
                     ("fig6", fig6)):
        path = fn(out, img, tag)
        if path:
            figs[name] = path
    return figs
