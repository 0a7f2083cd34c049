"""PNG plots of a ``pisa-attn study`` result (matplotlib, headless)."""

from __future__ import annotations

import os

MODE_COLORS = {"drop": "tab:red", "zeroth": "tab:orange", "hybrid": "tab:blue", "first": "tab:green",
               "hybrid-default": "tab:purple", "hybrid-calibrated": "tab:brown"}
LABELS = {"drop": "sparse (drop)", "zeroth": "sparse + block 0th", "hybrid": "sparse + hybrid (PISA, α = 1)",
          "first": "sparse + block 1st", "hybrid-default": "hybrid, default α",
          "hybrid-calibrated": "hybrid, α fitted on another input"}


def _plt():
    import matplotlib

    matplotlib.use("Agg")  # headless: the study runs in CI and on GPU boxes without a display
    import matplotlib.pyplot as plt

    return plt


def _style(name: str) -> dict:
    mode, cov = name.removesuffix("+cov"), name.endswith("+cov")
    label = LABELS.get(mode, mode) + (" + cov-aware" if cov else "")
    return {"color": MODE_COLORS.get(mode), "linestyle": "--" if cov else "-", "marker": "o", "label": label}


def _error_lines(ax, xs, series: dict, xlabel: str, title: str, logx: bool = False) -> None:
    for name, ys in series.items():
        pts = [(x, y) for x, y in zip(xs, ys) if y > 0]  # log axis: an exact 0 (density 1) has no point
        if pts:
            ax.plot(*zip(*pts), **_style(name), markersize=3)
    ax.set_yscale("log")
    if logx:
        ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("relative L1 error vs dense")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)


def plot_study(result: dict, out_dir: str) -> list[str]:
    """Write density.png, length.png, scores.png, tail_mass.png and tiling.png; return the names."""
    plt = _plt()
    written = []

    def save(fig, name):
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, name), dpi=110)
        plt.close(fig)
        written.append(name)

    ds = result["density_sweep"]
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    _error_lines(ax, [100 * d for d in ds["densities"]], ds["rel_l1"], "density (%)",
                 f"error vs density ({ds['length']} tokens)")
    save(fig, "density.png")

    ls = result["length_sweep"]
    if len(ls["lengths"]) > 0:
        fig, ax = plt.subplots(figsize=(6.4, 4.4))
        _error_lines(ax, ls["lengths"], ls["rel_l1"], "tokens", f"error vs length (density {100 * ls['density']:g}%)",
                     logx=True)
        save(fig, "length.png")

    sc = result["scores"]
    fig, axes = plt.subplots(2, 2, figsize=(9, 6.4))
    titles = {"block_mean": "block-mean scores s·q̄·k̄", "block_mean_shifted": "block-mean, minus row max",
              "token": "token scores s·q·k", "token_shifted": "token scores, minus row max"}
    for ax, (key, title) in zip(axes.flat, titles.items()):
        h = sc[key]
        edges = h["edges"]
        width = [b - a for a, b in zip(edges[:-1], edges[1:])]
        for part, color in (("tail", "tab:gray"), ("selected", "tab:red")):
            n = sum(h[part]) or 1
            dens = [c / n / w for c, w in zip(h[part], width)]
            ax.stairs(dens, edges, fill=True, alpha=0.5, color=color, label=f"{part} blocks")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("pre-softmax score")
        ax.legend(fontsize=7)
    fig.suptitle(f"pre-softmax scores of selected vs tail blocks (density {100 * sc['density']:g}%)")
    save(fig, "scores.png")

    tm = result["tail_mass"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    n_sel = len(tm["per_head"])
    for i, (sel, vals) in enumerate(tm["per_head"].items()):
        xs = [h + (i - (n_sel - 1) / 2) * 0.8 / n_sel for h in range(len(vals))]
        a1.bar(xs, vals, width=0.8 / n_sel, label="cov-aware selection" if sel == "cov" else "top-k selection")
    a1.set_xlabel("head")
    a1.set_ylabel("mean tail mass ρ_t")
    a1.set_title(f"tail mass per head (density {100 * tm['density']:g}%)")
    a1.legend(fontsize=7)
    xs = [100 * d for d in ds["densities"]]
    for sel, vals in ds["tail_mass"].items():
        name = "cov-aware selection" if sel == "cov" else "top-k selection"
        line = a2.plot(xs, vals, marker="o", linestyle="--" if sel == "cov" else "-", label=f"ρ, {name}")[0]
        est = ds.get("tail_estimate", {}).get(sel)
        if est:
            a2.plot(xs, est, marker="x", linestyle=":", color=line.get_color(), label=f"0th-order estimate, {name}")
    a2.set_xlabel("density (%)")
    a2.set_ylabel("mean tail mass ρ_t")
    a2.set_yscale("log")
    a2.set_title("tail mass vs density (x: centroid estimate)")
    a2.grid(True, alpha=0.3)
    a2.legend(fontsize=7)
    save(fig, "tail_mass.png")

    tl = result.get("tiling")
    if tl:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
        xs = [100 * d for d in tl["densities"]]
        for order, style in (("tiled", "-"), ("raster", ":")):
            for mode, ys in tl[order]["rel_l1"].items():
                pts = [(x, y) for x, y in zip(xs, ys) if y > 0]
                if pts:
                    a1.plot(*zip(*pts), linestyle=style, marker="o", markersize=3, color=MODE_COLORS.get(mode),
                            label=f"{mode}, {order}")
            a2.plot(xs, tl[order]["tail_mass"], linestyle=style, marker="o", label=order)
        a1.set_yscale("log")
        a1.set_xlabel("density (%)")
        a1.set_ylabel("relative L1 error vs dense")
        a1.set_title(f"token tiling ({'x'.join(map(str, tl['tile']))} {tl['order']}) vs raster order")
        a1.grid(True, which="both", alpha=0.3)
        a1.legend(fontsize=7)
        a2.set_xlabel("density (%)")
        a2.set_ylabel("mean tail mass ρ_t")
        a2.set_title("tail mass, tiled vs raster")
        a2.grid(True, alpha=0.3)
        a2.legend(fontsize=7)
        save(fig, "tiling.png")
    return written
