"""Issue 43's sweep, whole: every Hugging Face causal-LM family that the installed
transformers builds offline from ``tests/hf_catalogue.py``'s tiny configs, trained 3 AdamW
steps with clipping in float64 under ddp, fsdp, tp (2 ranks, the family's own plan) and
fsdp x tp (2 x 2) and, for the mixtures of experts, ep, fsdp x ep, ep x tp, pp x ep and
cp x ep, each compared with one process (``tests/hf_sweep.py`` says how a cell
is judged: equal, refused, differs, crash, hang).

    python benchmarks/hf_sweep.py [--only llama,glm] [--strategies ddp,tp] [--again]
                                  [--json benchmarks/hf_sweep.json] [--readme]

Prints every cell as it ends, then the table and the counts. Each cell is appended to
``<--json>l`` as it ends (a stopped run resumes there; ``--again`` reruns the cells that
were not equal or refused), and ``--json`` gets the whole at the end (a later
``--readme --from-json F`` writes the table without running again);
``--readme`` writes the counts into README.md (between its ``hf-sweep`` markers) and every
family's row into docs/hf-families.md. About an
hour on 2 cores for every family.
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings

import harness

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
BEGIN, END = "<!-- hf-sweep:begin -->", "<!-- hf-sweep:end -->"
SHORT = {"equal": "equal", "refused": "refused", "differs": "DIFFERS", "crash": "CRASH",
         "hang": "HANG", "skipped": "not run"}


NO_EXPERTS = "no experts module: expert parallelism does not apply"


def cell_text(cell: dict) -> str:
    if cell["detail"] == NO_EXPERTS:
        return "—"
    text = SHORT[cell["outcome"]]
    if cell["outcome"] == "equal" and "float32" in cell["detail"]:
        text += "³²"
    if cell["outcome"] == "equal" and cell["eager"]:
        text += f" ({cell['eager']} eager)"
    return text


def table(cells: list[dict], built: dict[str, str], strategies: list[str],
          versions: str) -> str:
    """The README's section: the counts, a row per family, and the refusals' reasons."""
    by_family: dict[str, dict[str, dict]] = {}
    for c in cells:
        by_family.setdefault(c["family"], {})[c["strategy"]] = c
    tried = [f for f in by_family]
    lines = [f"Trained by `python benchmarks/hf_sweep.py --readme` ({versions}): "
             f"{len(built)} causal-LM families in transformers' catalogue, "
             f"{len(tried)} built offline from a tiny config; each trained 3 AdamW steps "
             f"with clipping in float64 and compared with one process.", ""]
    lines += ["| strategy | equal | refused | differs | crash | hang | not run |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for s in strategies:
        row = [c for c in cells if c["strategy"] == s]
        count = {k: sum(c["outcome"] == k for c in row) for k in SHORT}
        unrun = count["skipped"] + len(tried) - len(row)  # (a sweep stopped part-way)
        lines.append(f"| {s} | {count['equal']} | {count['refused']} | {count['differs']} "
                     f"| {count['crash']} | {count['hang']} | {unrun} |")
    from tests.hf_sweep import EXPERTS_ONLY

    if any(s in EXPERTS_ONLY for s in strategies):
        lines += ["", "`ep`: `spmd.ep.experts()` along the data dimension under ddp (`fsdp x ep`: "
                      "under fsdp; `ep x tp`: 2 x 2 ranks, the family's own tensor-parallel "
                      "plan where it has one and `spmd.ep.experts(tensor_parallel=\"tp\")`, "
                      "the experts split by their features too; `pp x ep`: 2 x 2 ranks, "
                      "2 stages (1F1B, 2 microbatches) each with its experts split on "
                      "\"ep\"; `cp x ep`: 2 x 2 ranks, the sequence split over \"cp\" "
                      "(ring attention), each rank's part routed to the experts split on "
                      "\"ep\"); `—`: no experts module it "
                      "recognises (one whose forward "
                      "takes `(hidden, top_k_index, top_k_weights)`): a dense family, or "
                      "Llama 4, whose experts run on tokens routed before them."]
    summary = len(lines)
    lines += ["", "| family | " + " | ".join(strategies) + " |",
              "|---|" + "---|" * len(strategies)]
    for family in sorted(by_family):
        row = by_family[family]
        lines.append(f"| {family} | " + " | ".join(
            cell_text(row[s]) if s in row else "not yet run" for s in strategies) + " |")
    reasons: dict[str, list[str]] = {}
    for c in cells:
        if c["outcome"] != "equal" and c["detail"] != NO_EXPERTS:
            reasons.setdefault(c["detail"], []).append(f"{c['family']} ({c['strategy']})")
    if reasons:
        lines += ["", "What the other cells said:", ""]
        for detail, where in sorted(reasons.items(), key=lambda kv: -len(kv[1])):
            lines.append(f"- {', '.join(where)}: {detail}")
    missing = {f: why for f, why in built.items() if why}
    if missing:
        lines += ["", f"Not built from a tiny config ({len(missing)}): " + "; ".join(
            f"{f} ({why})" for f, why in sorted(missing.items()))]
    short = lines[:summary] + ["", "Every family's row: [docs/hf-families.md]"
                                   "(docs/hf-families.md)."]
    return "\n".join(short), "\n".join(lines)


def write_readme(sections: tuple[str, str]) -> None:
    """The counts into README.md (between its markers), every family's row into
    docs/hf-families.md."""
    short, whole = sections
    path = os.path.join(ROOT, "README.md")
    text = open(path).read()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"README.md has no {BEGIN} ... {END} markers")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    with open(path, "w") as f:
        f.write(f"{head}{BEGIN}\n{short}\n{END}{tail}")
    with open(os.path.join(ROOT, "docs", "hf-families.md"), "w") as f:
        f.write("# Hugging Face families under every strategy\n\nWritten by `python "
                "benchmarks/hf_sweep.py --readme`; how a cell is judged: README's "
                "\"Hugging Face families\" and docs/testing.md.\n\n" + whole + "\n")


def main() -> None:
    parser = harness.parser(__doc__)
    parser.add_argument("--only", default="", help="comma-separated model types")
    parser.add_argument("--strategies", default="", help="comma-separated, of ddp, fsdp, "
                        "tp, 'fsdp x tp'")
    parser.add_argument("--json", default="", help="write the cells here")
    parser.add_argument("--from-json", default="", help="read the cells, run nothing")
    parser.add_argument("--again", action="store_true", help="run the cells of --json's "
                        "progress file that were not equal or refused (after a fix)")
    parser.add_argument("--readme", action="store_true", help="write README.md's table")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    import multiprocessing

    import torch
    import transformers

    from spmd.ep import find_experts
    from tests import hf_catalogue, hf_sweep

    # ranks fork from a server that has these imported: a job starts in a second
    multiprocessing.set_forkserver_preload(["torch", "transformers", "spmd",
                                            "spmd.runtime.collectives", "tests.hf_sweep",
                                            "tests.hf_catalogue"])

    torch.set_num_threads(1)
    import resource

    # a family whose one-process runs would take the machine: a MemoryError for it
    resource.setrlimit(resource.RLIMIT_AS, (16 << 30, resource.RLIM_INFINITY))
    strategies = args.strategies.split(",") if args.strategies else list(hf_sweep.STRATEGIES)
    versions = (f"{time.strftime('%Y-%m-%d')}, transformers {transformers.__version__}, "
                f"torch {torch.__version__}")
    if args.from_json:
        saved = json.load(open(args.from_json))
        cells, built, versions = saved["cells"], saved["built"], saved["versions"]
    else:
        json_path = args.json or "hf_sweep.json"
        progress = json_path + "l"  # a line per cell as it ends: a stopped run resumes
        done = {}
        if os.path.exists(progress):
            for line in open(progress):
                c = json.loads(line)
                done[c["family"], c["strategy"]] = c
        families = hf_catalogue.families()
        if args.only:
            families = [f for f in families if f in args.only.split(",")]
        again = {key for key, c in done.items() if c["outcome"] not in ("equal", "refused")}
        if args.again:
            families = [f for f in families if f in {g for g, _ in again}]
        # what an earlier run (of other families) found stays in the table
        built = json.load(open(json_path))["built"] if os.path.exists(json_path) else {}
        experts: set[str] = set()  # the families with an experts module (spmd.ep)
        for family in families:
            model, built[family] = hf_catalogue.try_build(family)
            if model is not None and find_experts(model):
                experts.add(family)
        runnable = [f for f in families if not built[f]]
        print(f"{len(runnable)} of {len(families)} families build", flush=True)

        def record(o) -> dict:
            return {"family": o.family, "strategy": o.strategy, "outcome": o.outcome,
                    "detail": o.detail, "diff": o.diff, "eager": o.eager,
                    "seconds": round(o.seconds, 2),
                    "trace": next((r["trace"] for r in o.ranks if "trace" in r), "")}

        def log(o) -> None:
            print(f"{o.family:<28} {o.strategy:<10} {o.outcome:<8} {o.seconds:6.1f} s "
                  f"{o.eager} eager {o.detail[:160]}", flush=True)
            with open(progress, "a") as f:
                f.write(json.dumps(record(o)) + "\n")

        start = time.perf_counter()
        # family by family (each family's one-process runs are made once and dropped
        # when its cells are done)
        todo = [(f, s) for f in runnable for s in strategies]
        todo = [c for c in todo if (c in again if args.again else c not in done)]
        # expert parallelism's cells of a family without experts: not run, and said so
        unrun = [hf_sweep.Outcome(f, s, "skipped", NO_EXPERTS) for f, s in todo
                 if s in hf_sweep.EXPERTS_ONLY and f not in experts]
        todo = [c for c in todo if c not in {(o.family, o.strategy) for o in unrun}]
        outcomes = unrun + hf_sweep.sweep(todo, log=log)
        print(f"\n{len(outcomes)} cells in {time.perf_counter() - start:.0f} s")
        cells = {**done, **{(o.family, o.strategy): record(o) for o in outcomes}}
        order = {s: i for i, s in enumerate(hf_sweep.STRATEGIES)}
        cells = sorted((c for (f, _), c in cells.items() if not built.get(f)),
                       key=lambda c: (order[c["strategy"]], c["family"]))
        with open(json_path, "w") as f:
            json.dump({"cells": cells, "built": built, "versions": versions}, f, indent=1)
    # every strategy some cell ran under, in the harness's order
    ran = {c["strategy"] for c in cells}
    sections = table(cells, built, [s for s in hf_sweep.STRATEGIES if s in ran], versions)
    print(sections[1])
    if args.readme:
        write_readme(sections)


if __name__ == "__main__":
    main()
