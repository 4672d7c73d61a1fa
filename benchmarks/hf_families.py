"""Which Hugging Face causal-LM families build offline from the catalogue's tiny configs
(issue 43's first column): every ``model_type`` of transformers'
``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``, built by ``tests/hf_catalogue.py`` (generic tiny
sizes in every sub-config, a family's own where it needs them, float64, experts as batched_mm)
and run forward on 2 x 8 tokens, each within ``--seconds``. Nothing is downloaded.

    python benchmarks/hf_families.py [--seconds 20] [--only llama,glm]

Prints a row per family (built or why not, parameters, whether its config carries a
``base_model_tp_plan``) and the counts.
"""

from __future__ import annotations

import os
import sys
import time
import warnings

import harness

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    parser = harness.parser(__doc__)
    parser.add_argument("--seconds", type=int, default=20, help="per family")
    parser.add_argument("--only", default="", help="comma-separated model types")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    from tests import hf_catalogue

    families = hf_catalogue.families()
    if args.only:
        families = [f for f in families if f in args.only.split(",")]
    harness.table(("family", "builds", "parameters", "tp plan", "why not", "seconds"),
                  "llrlll")
    built = planned = 0
    for family in families:
        start = time.perf_counter()
        model, why = hf_catalogue.try_build(family, args.seconds)
        plan = model is not None and hf_catalogue.has_plan(model)
        built += model is not None
        planned += plan
        n = sum(p.numel() for p in model.parameters()) if model is not None else ""
        harness.row(family, "yes" if model is not None else "no", n, "yes" if plan else "",
                    why, f"{time.perf_counter() - start:.1f}")
    print(f"\n{built} of {len(families)} families built and ran; {planned} carry a "
          f"base_model_tp_plan")


if __name__ == "__main__":
    main()
