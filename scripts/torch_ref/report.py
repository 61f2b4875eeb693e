"""Turns the runs of scripts/bench-levels.sh / bench-step.sh into docs: medians per combination, the tables, the
charts, and the section between the markers of docs/benchmarks.md.

    python report.py levels --results runs.jsonl --meta meta.json [--doc docs/benchmarks.md] [--out docs/benchmarks]
    python report.py step   --results runs.jsonl --meta meta.json [--doc docs/benchmarks.md]
    python report.py overlap --results runs.jsonl --meta meta.json [--doc docs/benchmarks.md]

`runs.jsonl`: one JSON object per run (the lines levels.rs / levels.py, step_time.rs / step.py print). `meta.json`:
machine, date, load averages and versions, written by the shell script. `levels` writes
`<out>/levels.json` (the medians, every run and the metadata), `<out>/levels-{mlp,gpt}.{svg,png}` and replaces
`<!-- levels:begin -->` … `<!-- levels:end -->`; `step` replaces `<!-- step:begin -->` … `<!-- step:end -->`.
"""

import argparse
import json
import os
import statistics
import sys

# A level's tier: the same rung of the ladder in both frameworks.
TIERS = ["plain", "ddp", "accel", "trainer"]
TIER_OF = {"candle": 0, "torch": 0, "ddp": 1, "accel": 2, "accelerate": 2, "trainer": 3}
TIER_NAMES = {
    "accel-rs": ["plain candle loop", "ddp-core (DDP)", "Accelerator", "Trainer"],
    "pytorch": ["plain PyTorch loop", "DDP (torchrun, gloo)", "Accelerate (cpu=True)", "HF Trainer (use_cpu)"],
}
FRAMEWORKS = ["accel-rs", "pytorch"]
NUMERIC = [
    "samples_per_s",
    "tokens_per_s",
    "step_ms",
    "first_step_ms",
    "wall_s",
    "train_loss",
    "test_accuracy",
    "val_loss",
    "samples_per_epoch",
    "samples_seen",
    "parameters",
    "steps",
]


def read_runs(path):
    runs = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line.startswith("{"):
                runs.append(json.loads(line))
    return runs


def median_of(group, key):
    vals = [r[key] for r in group if isinstance(r.get(key), (int, float)) and r[key] == r[key]]
    return statistics.median(vals) if vals else None


def medians(runs, keys):
    out = {}
    for r in runs:
        out.setdefault(tuple(r[k] for k in keys), []).append(r)
    return {
        k: {**{key: median_of(g, key) for key in NUMERIC + STEP_NUMERIC}, "runs": len(g), "threads": g[0].get("threads")}
        for k, g in out.items()
    }


def replace_section(doc, name, body):
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    with open(doc) as f:
        text = f.read()
    if begin not in text or end not in text:
        sys.exit(f"{doc}: the markers {begin} / {end} are missing; add them where the section goes")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    with open(doc, "w") as f:
        f.write(head + begin + "\n" + body.rstrip() + "\n" + end + tail)


def fmt(v, spec):
    return "—" if v is None else format(v, spec)


def ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b


def meta_lines(meta, torch=True):
    """The machine, date and load lines; `torch=False` for the reports that run no PyTorch (the versions line then
    names rustc and candle only)."""
    loads = meta.get("loads") or []
    load = (
        f"1-minute load average before each run {min(loads):.2f}–{max(loads):.2f} (median {statistics.median(loads):.2f})"
        if loads
        else "load average not recorded"
    )
    v = meta.get("versions", {})
    versions = f"Versions: {v.get('rustc', '?')}; candle 0.11.1"
    if torch:
        versions += (
            f"; torch {v.get('torch', '?')}, accelerate {v.get('accelerate', '?')}, transformers "
            f"{v.get('transformers', '?')} (PyPI, in {meta.get('venv', 'the venv')})"
        )
    return [
        f"Machine: {meta.get('cpu', '?')}, {meta.get('cores', '?')} cores, {meta.get('ram', '?')} RAM, "
        f"Linux {meta.get('kernel', '?')}. Date: {meta.get('date', '?')}. {load}; waited for < {meta.get('quiet', '?')} "
        f"before starting ({meta.get('waited', '?')}).",
        versions + ".",
    ]


# ---------------------------------------------------------------------------------------------------- levels


def chart(model, med, rate_key, unit, out_dir):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.2))
    series = [(fw, n) for n in (1, 2) for fw in FRAMEWORKS]
    colors = {("accel-rs", 1): "#d95f02", ("pytorch", 1): "#7570b3", ("accel-rs", 2): "#fdae6b", ("pytorch", 2): "#bcbddc"}
    width = 0.8 / len(series)
    for j, (fw, n) in enumerate(series):
        xs, ys = [], []
        for t in range(len(TIERS)):
            m = med.get((fw, model, t, n))
            if m and m.get(rate_key):
                xs.append(t + (j - (len(series) - 1) / 2) * width)
                ys.append(m[rate_key])
        ax.bar(xs, ys, width, label=f"{fw}, {n} process{'es' if n > 1 else ''}", color=colors[(fw, n)])
    ax.set_xticks(range(len(TIERS)))
    ax.set_xticklabels(["plain loop", "DDP level", "Accelerate level", "Trainer level"])
    ax.set_ylabel(unit)
    ax.set_title(f"{'MNIST MLP 784-512-512-10' if model == 'mlp' else 'char-GPT (820 992 parameters)'}: {unit} per level")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    paths = []
    for ext in ("svg", "png"):
        p = os.path.join(out_dir, f"levels-{model}.{ext}")
        fig.savefig(p, dpi=110)
        paths.append(p)
    plt.close(fig)
    return paths


def model_tables(model, med, rate_key, unit):
    rows1 = [
        f"| level | processes | accel-rs {unit} | PyTorch {unit} | accel-rs / PyTorch | overhead over the level below "
        "(accel-rs / PyTorch) | 2 vs 1 process (accel-rs / PyTorch) |",
        "|---|---|---|---|---|---|---|",
    ]
    quality = "test accuracy" if model == "mlp" else "validation loss"
    qkey = "test_accuracy" if model == "mlp" else "val_loss"
    rows2 = [
        f"| level | processes | step ms (accel-rs / PyTorch) | first step ms | wall s | train loss | {quality} | "
        f"{'samples per epoch' if model == 'mlp' else 'samples seen'} | runs |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for n in (1, 2):
        for t in range(len(TIERS)):
            ours, theirs = med.get(("accel-rs", model, t, n)), med.get(("pytorch", model, t, n))
            if not ours and not theirs:
                continue
            ours, theirs = ours or {}, theirs or {}
            name = f"{TIER_NAMES['accel-rs'][t]} / {TIER_NAMES['pytorch'][t]}"

            def over(fw, m):
                below = med.get((fw, model, t - 1, n)) if t > 0 else None
                r = ratio((below or {}).get(rate_key), m.get(rate_key))
                return "—" if r is None else f"{(r - 1) * 100:+.1f} %"

            def scale(fw, m):
                one = med.get((fw, model, t, 1)) if n == 2 else None
                r = ratio(m.get(rate_key), (one or {}).get(rate_key))
                return "—" if r is None else f"{r:.2f}×"

            r = ratio(ours.get(rate_key), theirs.get(rate_key))
            rows1.append(
                f"| {name} | {n} | {fmt(ours.get(rate_key), ',.0f')} | {fmt(theirs.get(rate_key), ',.0f')} | "
                f"{'—' if r is None else f'**{r:.2f}**'} | {over('accel-rs', ours)} / {over('pytorch', theirs)} | "
                f"{scale('accel-rs', ours)} / {scale('pytorch', theirs)} |"
            )
            qspec = ".4f"
            seen = "samples_per_epoch" if model == "mlp" else "samples_seen"
            rows2.append(
                f"| {name} | {n} | {fmt(ours.get('step_ms'), '.2f')} / {fmt(theirs.get('step_ms'), '.2f')} | "
                f"{fmt(ours.get('first_step_ms'), '.1f')} / {fmt(theirs.get('first_step_ms'), '.1f')} | "
                f"{fmt(ours.get('wall_s'), '.1f')} / {fmt(theirs.get('wall_s'), '.1f')} | "
                f"{fmt(ours.get('train_loss'), '.4f')} / {fmt(theirs.get('train_loss'), '.4f')} | "
                f"{fmt(ours.get(qkey), qspec)} / {fmt(theirs.get(qkey), qspec)} | "
                f"{fmt(ours.get(seen), '.0f')} / {fmt(theirs.get(seen), '.0f')} | "
                f"{ours.get('runs', 0)} / {theirs.get('runs', 0)} |"
            )
    return rows1, rows2


def levels(args):
    runs = read_runs(args.results)
    if not runs:
        sys.exit(f"{args.results}: no runs")
    meta = json.load(open(args.meta))
    for r in runs:
        r["tier"] = TIER_OF[r["level"]]
    med = medians(runs, ["framework", "model", "tier", "nproc"])
    # Same task on both sides: the parameter counts and the samples per epoch must agree per tier.
    problems = []
    for (fw, model, t, n), m in med.items():
        other = med.get(("pytorch" if fw == "accel-rs" else "accel-rs", model, t, n))
        for key in ("parameters", "samples_per_epoch"):
            if other and m.get(key) is not None and other.get(key) is not None and m[key] != other[key]:
                problems.append(f"{model} {TIERS[t]} {n}p: {key} {fw} {m[key]} vs {other[key]}")
    os.makedirs(args.out, exist_ok=True)
    body = [
        "Generated by `scripts/bench-levels.sh` (`scripts/torch_ref/report.py`); do not edit by hand.",
        "",
        *meta_lines(meta),
        "",
        f"Task: {meta.get('task', '')}",
        "",
    ]
    if problems:
        body += ["**Task mismatch between the frameworks:** " + "; ".join(problems), ""]
    summary = {"meta": meta, "medians": [], "runs": runs, "mismatches": problems}
    for model, rate_key, unit in (("mlp", "samples_per_s", "samples/s"), ("gpt", "tokens_per_s", "tokens/s")):
        if not any(k[1] == model for k in med):
            continue
        rows1, rows2 = model_tables(model, med, rate_key, unit)
        paths = chart(model, med, rate_key, unit, args.out)
        rel = os.path.relpath(paths[0], os.path.dirname(os.path.abspath(args.doc)))
        title = "MNIST MLP 784-512-512-10" if model == "mlp" else "char-GPT on Shakespeare"
        body += [f"#### {title}", "", *rows1, "", *rows2, "", f"![{unit} per level]({rel})", ""]
        for (fw, m, t, n), v in sorted(med.items()):
            if m == model:
                summary["medians"].append({"framework": fw, "model": m, "tier": TIERS[t], "nproc": n, **v})
    with open(os.path.join(args.out, "levels.json"), "w") as f:
        json.dump(summary, f, indent=1)
    body += [
        "Columns: throughput over every optimizer step but the first (medians of the runs); *overhead over the level "
        "below* = throughput of the level below at the same process count / this level's − 1 (the plain loop is "
        "1 process only); *2 vs 1 process* = throughput at 2 processes / at 1; step ms = median time between two "
        "optimizer steps; first step = from the start of the training loop to the end of the first step; wall = "
        "process start (including the launcher) to the result; train loss = mean over the run.",
    ]
    replace_section(args.doc, "levels", "\n".join(body))
    print(f"wrote {args.out}/levels.json, the charts and the levels section of {args.doc}")
    for p in problems:
        print("MISMATCH:", p, file=sys.stderr)


# ------------------------------------------------------------------------------------------------------ step

STEP_NUMERIC = ["forward_ms", "backward_ms", "optimizer_ms", "step_ms", "faults_per_step"]


def step(args):
    runs = read_runs(args.results)
    if not runs:
        sys.exit(f"{args.results}: no runs")
    meta = json.load(open(args.meta))
    med = medians(runs, ["impl", "model", "batch", "threads"])
    body = [
        "Generated by `scripts/bench-step.sh` (`scripts/torch_ref/report.py step`); do not edit by hand.",
        "",
        *meta_lines(meta),
        "",
        "| model | batch | threads | implementation | forward ms | backward ms | optimizer ms | step ms | "
        "step vs PyTorch | page faults per step | runs |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    order = {"pytorch": 0, "accel-rs fused": 1, "accel-rs fused (CANDLE_NUM_THREADS=1)": 2, "accel-rs candle-ops": 3}
    for key in sorted(med, key=lambda k: (k[1], k[3], k[2], order.get(k[0], 9), k[0])):
        impl, model, batch, threads = key
        m = med[key]
        ref = med.get(("pytorch", model, batch, threads))
        r = ratio((ref or {}).get("step_ms"), m.get("step_ms"))
        body.append(
            f"| {model} | {batch} | {threads} | {impl} | {fmt(m['forward_ms'], '.2f')} | {fmt(m['backward_ms'], '.2f')} "
            f"| {fmt(m['optimizer_ms'], '.2f')} | {fmt(m['step_ms'], '.2f')} | "
            f"{'—' if r is None or impl == 'pytorch' else f'**{r:.2f}×**'} | {fmt(m['faults_per_step'], '.0f')} | "
            f"{m['runs']} |"
        )
    body += [
        "",
        "Medians over the runs of each run's median step; *step vs PyTorch* = PyTorch's step time / this one's (≥ 1 "
        "is faster than PyTorch).",
    ]
    replace_section(args.doc, "step", "\n".join(body))
    print(f"wrote the step section of {args.doc}")


# --------------------------------------------------------------------------------------------------- overlap


def overlap(args):
    """2 vs 1 process throughput with the gradient all-reduce overlapped with the backward pass and without."""
    runs = read_runs(args.results)
    if not runs:
        sys.exit(f"{args.results}: no runs")
    meta = json.load(open(args.meta))
    # The two 1-process runs a round starts side by side (tag "side-by-side <round>"), right after the level's
    # 1-process run alone: their throughputs add up to what the machine gives two processes without communication.
    # Per round, that sum and its ratio to the run alone just before (steadier than a ratio of medians, as the VM
    # drifts between rounds); the medians over the rounds go into the table.
    med = medians([r for r in runs if not r.get("tag")], ["model", "level", "nproc", "overlap"])
    pair_sums, pair_ratios, alone, pending = {}, {}, {}, {}
    for r in runs:
        rate_key = "samples_per_s" if r["model"] == "mlp" else "tokens_per_s"
        key = (r["model"], r["level"])
        if not r.get("tag"):
            if r["nproc"] == 1:
                alone[key] = r.get(rate_key)
            continue
        if not str(r["tag"]).startswith("side-by-side") or not isinstance(r.get(rate_key), (int, float)):
            continue
        pair = pending.setdefault(key + (r["tag"],), [])
        pair.append(r[rate_key])
        if len(pair) == 2:
            del pending[key + (r["tag"],)]
            pair_sums.setdefault(key, []).append(sum(pair))
            if alone.get(key):
                pair_ratios.setdefault(key, []).append(sum(pair) / alone[key])
    body = [
        "Generated by `scripts/bench-overlap.sh` (`scripts/torch_ref/report.py overlap`); do not edit by hand.",
        "",
        *meta_lines(meta, torch=False),
        "",
        "| model | level | 1 process | 2 × 1 process side by side, no communication | 2 processes, all-reduce after "
        "backward | 2 processes, overlapped | scaling: side by side (ceiling) / after / overlapped | step ms, 2 "
        "processes: after / overlapped | runs |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for model in ["mlp", "gpt"]:
        rate_key, unit = ("samples_per_s", "samples/s") if model == "mlp" else ("tokens_per_s", "tokens/s")
        for level in ["ddp", "accel", "trainer"]:
            one = med.get((model, level, 1, "auto"))
            after = med.get((model, level, 2, "off"))
            over = med.get((model, level, 2, "on")) or (med.get((model, level, 2, "auto")) if level == "trainer" else None)
            if not one or not (after or over):
                continue
            r1 = one.get(rate_key)
            sums, ratios = pair_sums.get((model, level), []), pair_ratios.get((model, level), [])
            r_pair = statistics.median(sums) if sums else None
            rate = lambda m: None if m is None else m.get(rate_key)  # noqa: E731
            step = lambda m: None if m is None else m.get("step_ms")  # noqa: E731
            s_pair = statistics.median(ratios) if ratios else None
            s_after, s_over = ratio(rate(after), r1), ratio(rate(over), r1)
            body.append(
                f"| {model} | {level} | {fmt(r1, '.0f')} {unit} | {fmt(r_pair, '.0f')} | {fmt(rate(after), '.0f')} | "
                f"{fmt(rate(over), '.0f')} | {fmt(s_pair, '.2f')}× / {fmt(s_after, '.2f')}× / **{fmt(s_over, '.2f')}×** | "
                f"{fmt(step(after), '.2f')} / {fmt(step(over), '.2f')} | "
                f"{min(g['runs'] for g in (one, after, over) if g)} |"
            )
    body += [
        "",
        "Throughput: medians over the runs; *scaling* = 2-process throughput / 1-process throughput at the same "
        "per-process batch (the target is ≥ 1.8×). *Side by side*: two 1-process runs of the level started together, "
        "their throughputs added (median over the rounds); its scaling is the median over the rounds of that sum / "
        "the 1-process run alone just before it. That is what this machine gives two processes that never "
        "communicate, so a 2-process run cannot be expected above it (it slightly overstates the ceiling: the run "
        "that finishes second runs its last moments alone). The Trainer runs with its default (`Overlap::Auto`, "
        "which is off on this 2-core machine with 2 single-threaded ranks), shown in the 'overlapped' column.",
    ]
    replace_section(args.doc, "overlap", "\n".join(body))
    print(f"wrote the overlap section of {args.doc}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("what", choices=["levels", "step", "overlap"])
    p.add_argument("--results", required=True)
    p.add_argument("--meta", required=True)
    here = os.path.dirname(os.path.abspath(__file__))
    p.add_argument("--doc", default=os.path.join(here, "..", "..", "docs", "benchmarks.md"))
    p.add_argument("--out", default=os.path.join(here, "..", "..", "docs", "benchmarks"))
    a = p.parse_args()
    {"levels": levels, "step": step, "overlap": overlap}[a.what](a)


if __name__ == "__main__":
    main()
