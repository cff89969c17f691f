"""Stage sweep: time short runs per batch size and precision; find the largest batch that fits.

    python stages/sweep.py --params params.yaml --data data/prepared --env reports/env.json --out reports/sweep

Writes points/<precision>-<batch>.json (one per point, kept between runs: a
point whose settings, data, machine and code are unchanged is not measured
again), max.json (the largest batch per precision), sweep.csv (every point, for
dvc plots and the report) and sweep.json (all of it, with what was reused).
"""

import argparse
import json
import time
from pathlib import Path

from ampbench import config
from ampbench.errors import run_cli
from ampbench.results import atomic_write, csv_text, write_json

COLUMNS = ["variant", "batch_size", "imgs_per_s", "imgs_per_s_p10", "imgs_per_s_p90", "peak_mem_bytes",
           "peak_reserved_bytes", "activation_bytes", "achieved_tflops", "oom"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--data", required=True, help="the prepared data folder")
    ap.add_argument("--env", required=True, help="env.json, written by env_check")
    ap.add_argument("--out", required=True, help="folder for the sweep's files (a DVC persist output)")
    args = ap.parse_args()

    cfg = config.load(args.params)
    out = Path(args.out)
    if not cfg.sweep.enabled:  # before torch is imported: a disabled sweep costs a second
        write_json(out / "sweep.json", {"enabled": False})
        atomic_write(out / "sweep.csv", csv_text([], COLUMNS))
        print("sweep: disabled (sweep.enabled: false)")
        return

    import torch

    from ampbench import data, env, sweep
    info = json.loads(Path(args.env).read_text())
    precisions = config.sweep_precisions(cfg)
    device = torch.device(env.resolve_device(cfg.device, info, set(precisions)))
    prepared = data.load_prepared(Path(args.data), device)
    sweep.cap_memory(cfg, device)
    fingerprint = env.fingerprint(info)
    points_dir = out / "points"
    wanted, rows, largest, reused = set(), [], {}, 0
    for precision in precisions:
        bench = sweep.Bench(cfg, prepared, device, precision)
        points = []
        for batch in cfg.sweep.batch_sizes:
            path = points_dir / f"{precision}-{batch}.json"
            wanted.add(path.name)
            key = sweep.point_key(cfg, precision, batch, prepared["meta"], fingerprint)
            old = json.loads(path.read_text()) if path.is_file() else {}
            if old.get("key") == key:
                point, reused = old, reused + 1
            else:
                t0 = time.perf_counter()
                try:
                    point = {**bench.point(batch, cfg.sweep.steps), "key": key}
                except torch.cuda.OutOfMemoryError:
                    bench.free()
                    point = {"precision": precision, "batch_size": batch, "oom": True, "key": key}
                write_json(path, point)
                mem = (f"peak {point.get('peak_mem_bytes', 0) / 2**20:,.0f} MiB" if device.type == "cuda"
                       else f"activations {point.get('activation_bytes', 0) / 2**20:,.1f} MiB")
                what = "out of memory" if point.get("oom") else f"{point['imgs_per_s']:,.0f} img/s, {mem}"
                print(f"[sweep {precision}] batch {batch}: {what} ({time.perf_counter() - t0:.1f} s)", flush=True)
            points.append(point)
            spread = point.get("imgs_per_s_p10_p90") or [None, None]
            rows.append({"variant": precision, **{k: point.get(k) for k in COLUMNS[1:] if k in point},
                         "imgs_per_s_p10": spread[0], "imgs_per_s_p90": spread[1], "oom": bool(point.get("oom"))})
        if cfg.sweep.find_max:
            ok = [p for p in points if not p.get("oom")]
            largest[precision] = sweep.find_max(bench, ok, cfg, _dataset_bytes(prepared))
            print(f"[sweep {precision}] largest batch: {largest[precision]['largest_batch']} "
                  f"({largest[precision]['method']})", flush=True)
        del bench
    for stale in points_dir.glob("*.json"):
        if stale.name not in wanted:
            stale.unlink()
    write_json(out / "max.json", largest)
    atomic_write(out / "sweep.csv", csv_text(rows, COLUMNS))
    write_json(out / "sweep.json", {"enabled": True, "device": device.type, "precisions": list(precisions),
                                    "batch_sizes": list(cfg.sweep.batch_sizes), "steps": cfg.sweep.steps,
                                    "points": rows, "largest": largest, "reused_points": reused,
                                    "measured_points": len(rows) - reused})
    print(f"sweep: {len(rows) - reused} point(s) measured, {reused} reused -> {out}")


def _dataset_bytes(prepared: dict) -> int:
    return sum(t.numel() * t.element_size() for split in ("train", "test") for t in prepared[split])


if __name__ == "__main__":
    run_cli(main)
