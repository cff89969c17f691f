"""Stage sweep: time short runs per batch size and precision; find the largest batch that fits.

    python stages/sweep.py --params params.yaml --data data/prepared --env reports/env.json \
        --model-source reports/model_source.json --out reports/sweep

Writes points/<precision>-<batch>.json (one per point, kept between runs: a
point whose settings, data, machine and code are unchanged is not measured
again), max.json (the largest batch per precision), sweep.csv (every point, for
dvc plots and the report) and sweep.json (all of it, with what was reused).
"""

import argparse
import json
from pathlib import Path

import _here  # noqa: F401  ampbench from this repository's src (stages/_here.py)

from ampbench import config
from ampbench.errors import run_cli
from ampbench.results import SWEEP_COLUMNS, atomic_write, csv_text, write_json


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--data", required=True, help="the prepared data folder")
    ap.add_argument("--env", required=True, help="env.json, written by env_check")
    ap.add_argument("--model-source", required=True, help="model_source.json, written by env_check: the model's "
                                                          "source hash, part of each point's key")
    ap.add_argument("--out", required=True, help="folder for the sweep's files (a DVC persist output)")
    args = ap.parse_args()

    cfg = config.load(args.params)
    out = Path(args.out)
    if not cfg.sweep.enabled:  # before torch is imported: a disabled sweep costs a second
        write_json(out / "sweep.json", {"enabled": False})
        atomic_write(out / "sweep.csv", csv_text([], SWEEP_COLUMNS))
        print("sweep: disabled (sweep.enabled: false)")
        return

    import torch

    from ampbench import data, env, results, sweep
    info = json.loads(Path(args.env).read_text())
    device = torch.device(env.resolve_device(cfg.device, info, set(config.sweep_precisions(cfg))))
    prepared = data.load_prepared(Path(args.data), device, stream=True)  # a point reads only the images it uses
    model_source = json.loads(Path(args.model_source).read_text())
    result = sweep.run_sweep(cfg, prepared, device, out, results.fingerprint(info), model_source)
    failed = f", {len(result['not_made'])} could not be made (the report says why)" if result["not_made"] else ""
    if result["left_out"]:
        failed += (f", {len(result['left_out'])} left out (over sweep.cpu_point_budget_s = "
                   f"{result['cpu_point_budget_s']:g} s on this CPU)")
    print(f"sweep: {result['measured_points']} point(s) measured, {result['reused_points']} reused{failed} -> {out}")


if __name__ == "__main__":
    run_cli(main)
