"""docs/BENCHMARKS.md from the suite's results: each area's section holds one
generated block per plan (quick, full), between markers

    <!-- suite:full:storage -->  ...  <!-- /suite:full:storage -->

Only those blocks are rewritten; everything else in the file (other
engineers' sections, prose) is left as it is. A missing block is added at
the end of its section; a missing section at the end of the file."""
from __future__ import annotations

import os
import re

MiB = 1 << 20
AREAS = [("summary", "## How to run"), ("storage", "## Storage"),
         ("overhead", "## Overhead: the synthetic loop"), ("torch", "## PyTorch training"),
         ("simulate", "## Goodput on the trace"), ("tune", "## Tune")]


def _pct(x: float) -> str:
    return f"{x * 100:.1f} %"


def _table(header: list, rows: list) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def _img(figs: dict, key: str, doc_dir: str, alt: str) -> str:
    if key not in figs:
        return ""
    rel = os.path.relpath(figs[key], doc_dir)
    return f"\n\n![{alt}]({rel})\n"


def summary(out, figs, args, doc_dir) -> str:
    m = out.get("machine", {})
    secs = out.get("total_seconds", 0)
    cmd = "bench/suite.py --quick" if args.tag == "quick" else "bench/suite.py"
    took = (f"took {secs / 60:.1f} min" if not getattr(args, "reuse", False) else
            "(stages rerun with --reuse; see Findings for run times)")
    load = ""
    if m.get("load_start"):
        load = (f" Load average (1/5/15 min) {' / '.join(f'{x:.1f}' for x in m['load_start'])} "
                f"at the start" + (f", {' / '.join(f'{x:.1f}' for x in m['load_end'])} at the end"
                                   if m.get("load_end") else "") + ".")
    stages = out.get("seconds", {})
    per = ", ".join(f"{k} {v:.0f} s" for k, v in stages.items())
    return (f"**{args.tag} run**: `.venv/bin/python {cmd}` {took} on "
            f"{m.get('cores')} cores ({m.get('platform')}, Python {m.get('python')}, torch "
            f"{m.get('torch')}); results (JSON, CSV) in "
            f"`{os.path.relpath(args.out, os.path.dirname(doc_dir))}/`.{load}"
            + (f" Stages: {per}." if per else ""))


def storage(out, figs, args, doc_dir) -> str:
    if "storage" not in out:
        return ""
    st = out["storage"]
    rows = [[f"{r['bytes'] // MiB}", f"{r['nonstop_persist_s']:.3f} ± "
             f"{r['nonstop_persist_spread_s'] / 2:.3f}", f"{r['write_GBps']:.2f}",
             f"{r['read_GBps']:.2f}", f"{r['torch_save_fsync_s']:.3f} ± "
             f"{r['torch_save_fsync_spread_s'] / 2:.3f}"] for r in st["rows"]]
    e = st["engine"]
    return (f"`nonstop bench storage --size S --repeat 1` per size, sizes interleaved, "
            f"{st['rows'][0]['rounds']} rounds (median ± half the spread"
            + (f"; {st['stopped']}" if st.get("stopped") else "") + f"). Engine: {e.get('medium')}, "
            f"{e.get('writers')} writers, {e.get('chunk_bytes', 0) // 1024} KiB chunks, "
            f"{e.get('copy_engine')}.\n\n"
            + _table(["MiB", "nonstop persist (s)", "write GB/s", "read GB/s",
                      "torch.save + fsync (s)"], rows)
            + _img(figs, "fig11", doc_dir, "time to persist vs size"))


def overhead(out, figs, args, doc_dir) -> str:
    if "overhead" not in out:
        return ""
    ov = out["overhead"]
    groups = "; ".join(f"intervals {g['intervals']}: {g['steps']} steps x {g['repeat']} rounds"
                       + (f", N = {g['max_in_flight']}" if "max_in_flight" in g else "")
                       for g in ov["groups"])
    if ov.get("stopped"):
        groups += f"; {ov['stopped']}"
    rows = []
    for r in ov["rows"]:
        name = r["scheme"] if r["scheme"] != "concurrent" else f"concurrent N={r['max_in_flight']}"
        rows.append([name, r["interval"], f"{r['relative']:.3f}", f"{r['relative_spread']:.3f}",
                     f"{r['stall_ms_mean']:.1f}", _pct(r["none_drift_max"]),
                     f"{r.get('rounds', '?')} x {r['steps']}"])
    return (f"`nonstop bench overhead --state {ov['state_bytes']} --step-ms {ov['step_ms']:.0f}` "
            f"({groups}); medium {ov['medium']}. Each step sleeps {ov['step_ms']:.0f} ms "
            f"(device compute), waits for the copy, then touches every page of the state. "
            f"`relative` = steps/s over the same round's `none` (median over rounds, `spread` = "
            f"max - min); `stall` = visible stall per checkpoint (ms); `none` ran at "
            f"{ov['none_steps_per_s']:.2f} steps/s, max |drift| {_pct(ov['none_drift_max'])}.\n\n"
            + _table(["scheme", "interval", "relative", "spread", "stall ms", "none drift",
                      "rounds x steps"], rows)
            + _img(figs, "fig8", doc_dir, "throughput vs interval")
            + _img(figs, "fig12", doc_dir, "N sensitivity")
            + _img(figs, "fig6", doc_dir, "stall per scheme"))


def torch_section(out, figs, args, doc_dir) -> str:
    parts = []
    for model, res in out.get("torch", {}).items():
        rows = []
        for r in res["rows"]:
            rows.append([r["scheme"], r["interval"] or "-", f"{r['step_s']:.3f}",
                         f"{r['relative']:.3f}", f"{r['relative_spread']:.3f}",
                         f"{r['stall_per_ckpt_s'] * 1e3:.1f}", _pct(r["stall_overhead"]),
                         f"{r.get('persist_s', 0):.3f}" if "persist_s" in r else "-",
                         f"{r['cpu_per_step_s']:.2f}",
                         f"{r.get('runs', '?')} / {r.get('steps_measured', '?')} / "
                         f"{r.get('ckpts_measured', '?') if r['interval'] else '-'}"])
        skipped = "".join(f"\n- `{k}` not run: {v}" for k, v in res.get("skipped", {}).items())
        if res.get("stopped"):
            skipped += (f"\n- cut by the time budget ({res.get('budget_s', 0):.0f} s): "
                        f"{res['stopped']}; the last column says what each row is built from.")
        if res.get("parts"):
            skipped += f"\n- `nonstop-multistep` with K = {res['parts']} parts (default 7)."
        per_run = ", ".join(f"interval {f}: {n} steps" for f, n in
                            res.get("steps_per_run", {}).items())
        parts.append(
            f"**GPT {model}** ({res['params'] / 1e6:.1f}M parameters, batch "
            f"{res['config']['batch']} x seq {res['config']['seq']}, torch {res['torch']}, "
            f"{res['threads']} torch thread on {res['cores']} cores), intervals "
            f"{res['intervals']} measured, up to {res['rounds']} interleaved rounds"
            + (f"; measured steps per run: {per_run}, `none` {res.get('none_steps_per_run')}"
               if per_run else "")
            + f" (each after one unmeasured warm-up checkpoint, waited for); `none` "
            f"{res['none_step_s']:.3f} s/step, drift between its runs {_pct(res['none_drift'])}; "
            f"took {res.get('wall_s', 0):.0f} s."
            f"{skipped}\n\n"
            + _table(["scheme", "interval", "s/step", "relative", "spread", "stall/ckpt ms",
                      "stall/step", "persist s", "CPU s/step", "runs / steps / ckpts"], rows))
    if not parts:
        return ""
    return ("\n\n".join(parts) + "\n\n`stall/ckpt`: time the training thread was blocked in "
            "the checkpoint calls (nonstop: save() and the wait before the next optimizer "
            "step; torch.save: the call incl. fsync; DCP / torchsnapshot: the async call plus "
            "the wait for the previous save); `persist`: a save's start to durable (median). "
            "`relative` is throughput over `none` (median over runs; `spread` = max - min). "
            "`runs / steps / ckpts`: how many runs the row's medians come from, and the "
            "measured steps and checkpoints of those runs together. Nothing here is "
            "extrapolated; intervals that were not measured appear only in the simulator's "
            "rows below, which model them from the measured stall and persist times.")


def simulate(out, figs, args, doc_dir) -> str:
    sims = out.get("simulate", {})
    if not sims:
        return ""
    parts = []
    for name, sim in sims.items():
        rows = [[b.get("scheme"), b.get("interval"), f"{b.get('goodput_steps_per_s', 0):.3f}",
                 f"{b.get('ratio_to_ideal_best', 0):.3f}"] for b in sim.get("best", [])]
        nb = sim.get("nonstop_best") or {}
        parts.append(f"**{name}** rows, `nonstop simulate --trace "
                     f"tests/data/gcp_a100_spot_trace.csv --schemes "
                     f"{os.path.basename(args.out)}/sim-input-{name}.json`: nonstop's best is "
                     f"`{nb.get('scheme')}` at interval {nb.get('interval')} = "
                     f"**{nb.get('ratio_to_ideal_best', 0):.3f} x** ideal's best.\n\n"
                     + _table(["scheme", "best interval", "goodput steps/s", "x ideal"], rows))
    return "\n\n".join(parts) + _img(figs, "fig9", doc_dir, "goodput on the trace")


def tune(out, figs, args, doc_dir) -> str:
    t = out.get("tune")
    if not t:
        return ""
    m = t["measured"]
    inp = t["inputs"]
    lines = [f"`nonstop tune --dir D --state-bytes {inp['state_bytes']} --step-ms "
             f"{inp['step_s'] * 1e3:.0f} --max-overhead {inp['max_overhead']}"
             f"{' --quick' if args.tag == 'quick' else ''}` measured for {m['seconds']:.1f} s "
             f"({m['probe_bytes'] // MiB} MiB probes; copy: {m['copy_engine']}; medium: "
             f"{m['medium']}):", ""]
    lines.append(_table(["chunk", "copy GB/s"], [[f"{c['chunk_bytes'] // 1024} KiB",
                                                  f"{c['GBps']:.2f}"] for c in m["copy"]]))
    lines.append("")
    lines.append(_table(["writers", "write GB/s"], [[w["writers"], f"{w['GBps']:.2f}"]
                                                    for w in m["write"]]))
    lines.append("")
    lines.append(_table(["N", "T_w (s)", "T_w/N (s)"], [[p["max_in_flight"], f"{p['tw_s']:.3f}",
                                                         f"{p['tw_s'] / p['max_in_flight']:.3f}"]
                                                        for p in m["persist"]]))
    lines.append("")
    lines.append(f"Recommendation: N* = {t['max_in_flight']}, p = {t['writers']}, b = "
                 f"{t['chunk_bytes'] // 1024} KiB, c = {t['chunks']} (staging "
                 f"{t['staging_bytes'] // MiB} MiB), T_w = {t['tw_s']:.3f} s, interval f* = "
                 f"**{t['interval']}** ({t['interval_reason']}).")
    v = out.get("verify")
    if v:
        rows = [[r["interval"], f"{r['relative']:.3f}", _pct(r["overhead"]),
                 _pct(r["relative_spread"]), _pct(r["stall_overhead"]),
                 "yes" if r["within_q"] else "no"] for r in v["rows"]]
        lines += ["", f"**Does the recommendation keep the overhead within q = {_pct(v['q'])}?** "
                  f"`nonstop bench overhead --schemes concurrent --max-in-flight "
                  f"{v['config']['max_in_flight']} --writers {v['config']['writers']} --chunk "
                  f"{v['config']['chunk_bytes']} --staging {v['config']['staging_bytes']} "
                  f"--interval {max(1, v['config']['interval'] // 4)},{v['config']['interval']} "
                  f"--steps {v['steps']} --repeat 1`, {v.get('rounds', 2)} rounds"
                  + (f" ({v['stopped']})" if v.get("stopped") else "") + " (none drift "
                  f"{', '.join(_pct(d) for d in v['none_drift'])}):", "",
                  _table(["interval", "relative", "throughput overhead", "spread",
                          "stall overhead", "within q"], rows)]
    return "\n".join(lines)


RENDER = {"summary": summary, "storage": storage, "overhead": overhead, "torch": torch_section,
          "simulate": simulate, "tune": tune}


def _replace_block(text: str, area: str, heading: str, tag: str, body: str) -> str:
    begin, end = f"<!-- suite:{tag}:{area} -->", f"<!-- /suite:{tag}:{area} -->"
    block = f"{begin}\n{body.strip()}\n{end}"
    pat = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    if pat.search(text):
        return pat.sub(lambda _: block, text)
    i = text.find("\n" + heading + "\n")
    if i < 0:
        return text.rstrip("\n") + f"\n\n{heading}\n\n{block}\n"
    j = text.find("\n## ", i + len(heading) + 2)
    j = len(text) if j < 0 else j
    return text[:j].rstrip("\n") + f"\n\n{block}\n" + text[j:]


def update(path: str, out: dict, figs: dict, args) -> None:
    text = open(path).read() if os.path.exists(path) else "# Benchmarks\n"
    doc_dir = os.path.dirname(os.path.abspath(path))
    for area, heading in AREAS:
        body = RENDER[area](out, figs, args, doc_dir)
        if body:
            label = f"*{args.tag} run*" if area != "summary" else ""
            text = _replace_block(text, area, heading, args.tag,
                                  (label + "\n\n" if label else "") + body)
    with open(path, "w") as f:
        f.write(text)
