"""Stage paired: the one-process variants, timed in short windows taken in turns in one process.

    python stages/paired.py --params params.yaml --data data/prepared --env reports/env.json --out reports/paired.json

Writes paired.json: each variant's img/s per round and its ratios to fp32's, round by round (``ampbench.sweep.paired``).
"""

import argparse
import json
from pathlib import Path

import _here  # noqa: F401  ampbench from this repository's src (stages/_here.py)

from ampbench import config
from ampbench.errors import run_cli
from ampbench.results import write_json


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--data", required=True, help="the prepared data folder")
    ap.add_argument("--env", required=True, help="env.json, written by env_check")
    ap.add_argument("--out", required=True, help="paired.json")
    args = ap.parse_args()

    cfg = config.load(args.params)
    if not cfg.paired.enabled:  # before torch is imported: a disabled check costs a second
        write_json(Path(args.out), {"enabled": False})
        print("paired: disabled (paired.enabled: false)")
        return

    import torch

    from ampbench import data, env, models
    from ampbench.errors import analysis
    from ampbench.sweep import paired
    info = json.loads(Path(args.env).read_text())
    device = torch.device(env.resolve_device(cfg.device, info, {cfg.variants[n].precision
                                                                for n in paired.variants(cfg)}))
    prepared = data.load_prepared(Path(args.data), device, stream=True)
    # an analysis: one that fails is said, and the report says so; the pipeline goes on
    result, why = analysis("paired", models.name(cfg.model), paired.run_paired, cfg, prepared, device)
    result = result or {"enabled": True, "error": why, "vs_fp32": {}}
    write_json(Path(args.out), result)
    said = "; ".join(f"{n} {r['median']:.2f}x fp32 (rounds {r['lo']:.2f} to {r['hi']:.2f})"
                     for n, r in result["vs_fp32"].items())
    windows = ", ".join(f"{n} {k}" for n, k in (result.get("steps") or {}).items())
    print(f"paired: {cfg.paired.rounds} rounds at batch {cfg.train.batch_size} (steps per window: "
          f"{windows or 'none'}): {said or 'no ratio'} -> {args.out}")


if __name__ == "__main__":
    run_cli(main)
