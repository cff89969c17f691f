"""Stage data: fetch and verify CIFAR-10 (or read an image folder, or make the synthetic set); write uint8 tensors
once, or, for a folder that streams, the list of its images that read.

    python stages/data.py --params params.yaml --out data/prepared --raw data/raw --data-source reports/data_source.json
"""

import argparse
import json
from pathlib import Path

import _here  # noqa: F401  ampbench from this repository's src (stages/_here.py)

from ampbench import config, data
from ampbench.errors import DataError, run_cli


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--out", required=True, help="folder for train.pt, test.pt, meta.json")
    ap.add_argument("--raw", required=True, help="download cache for the CIFAR-10 archive")
    ap.add_argument("--data-source", help="env_check's data_source.json: how to prepare the set (default: decoded)")
    args = ap.parse_args()

    cfg = config.load(args.params)
    form = None
    if args.data_source:
        try:
            form = json.loads(Path(args.data_source).read_text()).get("data", {}).get("form")
        except (OSError, ValueError, AttributeError) as err:
            raise DataError(f"{args.data_source} could not be read ({err}); run env_check first (dvc repro)") \
                from None
    meta = data.prepare(cfg.data, cfg.seed, Path(args.out), Path(args.raw), form=form or "tensors")
    for line in data.folder.bad_file_lines(meta, f"{args.out}/meta.json"):
        print(f"warning: {line}")
    listed = " (listed for streaming: decoded in the training's DataLoader workers)" if form == "files" else ""
    print(f"data: {meta['source']}, {meta['train_count']} train / {meta['test_count']} test images -> "
          f"{args.out}{listed}")


if __name__ == "__main__":
    run_cli(main)
