"""Stage data: fetch and verify CIFAR-10 (or make the synthetic set); write uint8 tensors once.

    python stages/data.py --params params.yaml --out data/prepared --raw data/raw
"""

import argparse
from pathlib import Path

from ampbench import config, data
from ampbench.errors import run_cli


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--out", required=True, help="folder for train.pt, test.pt, meta.json")
    ap.add_argument("--raw", required=True, help="download cache for the CIFAR-10 archive")
    args = ap.parse_args()

    cfg = config.load(args.params)
    meta = data.prepare(cfg.data, cfg.seed, Path(args.out), Path(args.raw))
    print(f"data: {meta['source']}, {meta['train_count']} train / {meta['test_count']} test images -> {args.out}")


if __name__ == "__main__":
    run_cli(main)
