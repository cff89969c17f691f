"""Stage env_check: probe the machine, validate params.yaml against it, write the run plans.

    python stages/env_check.py --params params.yaml --env reports/env.json --plans reports/plans

Writes reports/env.json (deterministic: no timestamps), one plan file per
variant, holding exactly the settings that variant's train stage reads, and
data_source.json, what the data stage will make. Builds the model once on the
CPU and runs two images through it. Stops in seconds, with the remedy, when the
model, the data or the machine cannot run what is asked (``ampbench.env.check``).
"""

import argparse

import _here  # noqa: F401  ampbench from this repository's src (stages/_here.py)

from ampbench.env import check
from ampbench.errors import run_cli


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--env", required=True, help="where to write env.json")
    ap.add_argument("--plans", required=True, help="folder for one <variant>.json plan per variant")
    ap.add_argument("--data-source", required=True, help="where to write what the data stage will make")
    ap.add_argument("--model-source", required=True, help="where to write the model's source (the sweep's dep)")
    ap.add_argument("--roofline", required=True, help="where to write the model's roofline (the report's dep)")
    args = ap.parse_args()
    check.run(args.params, check.Outputs(env=args.env, plans=args.plans, data_source=args.data_source,
                                         model_source=args.model_source, roofline=args.roofline))


if __name__ == "__main__":
    run_cli(main)
