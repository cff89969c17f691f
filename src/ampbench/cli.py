"""The ampbench command.

    ampbench demo            # the same DVC pipeline on the CPU, synthetic data, small model; results in demo/
    ampbench demo --nproc-per-node 2   # the same, data-parallel over 2 processes (torchrun, gloo)
    ampbench demo --arch vit_tiny --ladder --optimizer adamw   # a transformer at every precision: fp32 ... fp8
    ampbench mlflow-sync     # log the on-disk runs that are not in MLflow yet (after a tracking outage)
    ampbench mlflow-ui       # the MLflow UI on this repository's store, opened on the runs table
    ampbench compare         # what each precision bought on each machine logging to the team's tracking server
    ampbench team-server --artifacts DIR --tls-cert C --tls-key K   # the team's server: accounts, rights, TLS
    ampbench team-user NAME  # an account on it (password on stdin), EDIT on the experiment
    ampbench roofline --gpu "RTX 5090"   # each precision's least step time at datasheet peaks, params.yaml's model
    ampbench roofline --gpu all          # the same for every GPU in the datasheet table
    ampbench roofline --gpu "H100 SXM" --nproc 8 --strategy fsdp   # 8 GPUs: the collectives on NVLink, memory per GPU
    ampbench check-model tv:convnext_tiny   # will this model run? input size, roofline, fp8, one step per precision
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from ampbench import config, precision, sandbox
from ampbench.config import optim
from ampbench.errors import ConfigError, run_cli

# every rung once, in the ladder's order; fp16's variant keeps params.yaml's name for it, amp
LADDER = {("amp" if r.grad_scaler else r.name): {"precision": r.name, "accum_steps": 1}
          for r in precision.RUNGS.values() if r.in_ladder}


def demo(dest: Path, arch: str = "", nproc: int = 1, ladder: bool = False, optimizer: str = "") -> None:
    params = sandbox.demo_params()
    if arch:  # e.g. vit_tiny: the same demo, another model
        params = sandbox.merge(params, {"model": {"arch": arch}})
    if optimizer and optimizer != params.get("train", {}).get("optimizer", config.TrainConfig().optimizer):
        train = {k: v for k, v in params.get("train", {}).items() if k not in ("lr", "weight_decay")}
        params["train"] = {**train, "optimizer": optimizer}  # that optimizer's own lr and weight decay
    if ladder:  # every precision once: strict fp32, tf32, bf16, fp16, fp8
        params["variants"] = LADDER
    if nproc > 1:  # DDP, beside one-process runs of the same variants
        params = sandbox.data_parallel(params, nproc)
    config.from_dict(params)  # a bad value in the user's params.yaml is reported before anything runs
    t0 = time.perf_counter()
    sandbox.create(dest, params)
    try:
        sandbox.repro(dest)
    except subprocess.CalledProcessError as err:
        sys.exit(err.returncode)
    sandbox.commit(dest, "ampbench demo results")  # the baseline for `dvc exp show` there
    print(f"\ndemo finished in {time.perf_counter() - t0:.0f}s: {dest / 'reports' / 'report.md'}\n"
          f"MLflow UI: ampbench mlflow-ui --store {dest / 'mlflow.db'}")


def mlflow_sync(args) -> None:
    from ampbench import tracking
    if not tracking.RETRIES_GIVEN:  # a sync replays what a server's outage left: it waits out a restart (about a
        os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = "6"  # minute: retries after 2, 4, 8, 16, 32 s), where a
        # stage, whose results are on disk already, gives up after seconds (MLflow reads it at each request)
    cfg = config.load(args.params)
    r = Path(args.reports)
    failed = tracking.sync(cfg.mlflow, Path.cwd(), r / "runs", r / "plans", r / "env.json", r / "report.md",
                           r / "summary.json", r / "figures", r / "report.html", r / "metrics.json")
    if failed:
        sys.exit(1)


def compare(args) -> None:
    """From the tracking store several machines log to: a table (and a figure) of each precision's speedup on each
    machine, machines grouped by configuration."""
    from ampbench.env import check_tracking_server
    from ampbench.tracking import compare as cmp
    cfg = config.load(args.params).mlflow if Path(args.params).is_file() else config.MlflowConfig()
    uri = config.tracking_uri(cfg, Path.cwd())
    problem = check_tracking_server(uri)
    if problem:
        said = ("MLFLOW_TRACKING", "account", "--allowed-hosts", "certificate", "TLS")  # a cause with its own fix
        fix = "" if any(w in problem for w in said) else "; start it, or set MLFLOW_TRACKING_URI to the team's server"
        raise ConfigError(f"MLflow tracking server {config.redact(uri)}: {problem}{fix}")
    page, groups = cmp.report(cmp.MlflowClient(uri), args.experiment or cfg.experiment)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(page)
    print(page)
    if groups:
        cmp.figure(groups, out.with_suffix(".png"))
        print(f"written: {out.with_suffix('.md')}, {out.with_suffix('.png')} (from {config.redact(uri)})")


def mlflow_ui(args) -> None:
    """Start `mlflow ui` on the store and say which page shows the runs (MLflow 3 opens on its GenAI view)."""
    from ampbench import tracking
    from ampbench.tracking import server
    cfg = config.load(args.params).mlflow if Path(args.params).is_file() else config.MlflowConfig()
    uri = f"sqlite:///{Path(args.store).resolve()}" if args.store else config.tracking_uri(cfg, Path.cwd())
    if args.store and not Path(args.store).is_file():
        raise ConfigError(f"--store {args.store}: no such file; run `make demo` (demo/mlflow.db) or "
                                 "`make repro` (mlflow.db) first")
    exp_id = tracking.prepare_ui(cfg, uri, Path.cwd())
    if uri.startswith(("http://", "https://")):  # a tracking server already serves its own UI
        print(f"open {tracking.ui_url(config.redact(uri), exp_id)}")
        return
    told, base = server.base_urls("http", args.host, args.port)
    pipeline = tracking.latest_pipeline(uri, exp_id) if exp_id else None
    print(f"MLflow UI for {config.redact(uri)}: starting on {told} ...", flush=True)
    # the store's URI (a database's may hold its password) in MLflow's own variable: no command line shows it
    server.run([sys.executable, "-m", "mlflow", "ui", "--host", args.host, "--port", str(args.port),
                "--uvicorn-opts", server.GRACE_OPTS],
               {**tracking.server_env(), server.STORE_ENV: uri}, base, args.wait, "MLflow UI",
               f"open {tracking.ui_url(told, exp_id)}\n"
               f"  the runs table: search tags.`ampbench.pipeline` = '{pipeline or '<id>'}' for one pipeline's runs, "
               "tick them and press Compare, or click the chart icon for every metric side by side\n"
               "  Ctrl-C stops it")


def roofline_cmd(args) -> None:
    from ampbench.measure import roofline
    from ampbench.report import fmt
    from ampbench.report.roofline import roofline_note, roofline_table
    rows = None if args.gpu == "all" else [roofline.find_gpu(args.gpu)]  # a bad name stops before counting
    args.launch_us = roofline.LAUNCH_US if args.launch_us is None else args.launch_us
    if args.launch_us < 0:
        raise ConfigError(f"--launch-us {args.launch_us:g}: give a time of 0 or more microseconds")
    if args.batch < 0:
        raise ConfigError(f"--batch {args.batch}: give a batch of 1 or more images (or 0 for train.batch_size)")
    cfg = config.load(args.params)
    if args.nproc != 1 or args.strategy:
        return _roofline_n(args, cfg, rows)
    found = roofline.for_config(cfg, optim.for_count, args.batch or None, inference=args.inference)
    s = found["summary"]
    closest = roofline.closest_default(s["conv_flop_share"])
    what, unit = (("one inference pass (forward only, eval mode, no gradients)", "pass") if args.inference
                  else ("one training step", "step"))
    print(f"Roofline of {what}: {found['model']}, batch {found['batch']}, {found['input_size']}x"
          f"{found['input_size']} inputs{'' if args.inference else ', optimizer and loss included'} (counted on "
          f"meta tensors in {found['count_s']:.1f} s)\n{s['flops'] / 1e9:,.1f} GFLOP and {s['bytes'] / 1e9:,.2f} GB "
          f"moved per {unit} in fp32; {s['conv_flop_share']:.0%} of the FLOPs in convolutions, so plain PyTorch (TF32 "
          f"convolutions, IEEE matmuls) runs this model closest to {closest}.\n")
    precisions = list(found["ops"])
    if rows:
        row = rows[0]
        print(f"{row['name']}: {row['source']}; memory {row['bandwidth_gbps']:,} GB/s\n")
        print("\n".join(roofline_table(roofline.table(found["ops"], row, found["batch"], args.launch_us))))
    else:
        from ampbench.measure.flops import DATASHEET
        notes: dict[tuple[str, str], list[str]] = {}
        print("| GPU | " + " | ".join(f"{p} img/s" for p in precisions) + " | "
              + " | ".join(f"{p} vs fp32" for p in precisions if p != "fp32") + " | fp16 vs tf32 |")
        print("|---|" + "---|" * (2 * len(precisions)))
        for _, row in DATASHEET:
            t = roofline.table(found["ops"], row, found["batch"], args.launch_us)
            ips = [f"{t[p]['imgs_per_s']:,.0f}{' (launch-bound)' if t[p]['launch_bound'] else ''}"
                   if roofline.available(t[p]) else "n/a" for p in precisions]
            vs = [fmt.times(t[p]["vs_fp32"]) if roofline.available(t[p]) else "n/a" for p in precisions if p != "fp32"]
            fp16 = t.get("fp16")
            print(f"| {row['name']} | " + " | ".join(ips) + " | " + " | ".join(vs)
                  + f" | {fmt.times(fp16.get('vs_tf32')) if roofline.available(fp16) else 'n/a'} |")
            for p, c in t.items():  # why a cell is n/a, the GPUs with the same reason together
                if not roofline.available(c):
                    notes.setdefault((p, c["na"].replace(row["name"], "{gpu}")), []).append(row["name"])
        print("\nn/a: " + "; ".join(f"{p} on {', '.join(gpus)}: {why.replace('{gpu}', 'it')}"
                                    for (p, why), gpus in notes.items()) + "." if notes else "")
        print("\nDense rates with FP32 accumulation, from: " + "; ".join(
            f"{row['name']}: {row['source']}" for _, row in DATASHEET) + ".")
    print("\n" + roofline_note(args.launch_us, args.inference))


def _roofline_n(args, cfg, rows) -> None:
    """``ampbench roofline --nproc N --strategy ddp|fsdp``: the step on N GPUs of one node, its collectives' bytes at
    the GPUs' interconnect bandwidth, and the memory per GPU by part."""
    from ampbench.measure import links, roofline
    from ampbench.report.roofline import data_parallel_table, roofline_note
    strategy = args.strategy or cfg.distributed.strategy
    links.check(args.nproc, strategy)
    if args.inference:
        raise ConfigError("--inference with --nproc: an inference pass sends no gradients; drop one of them")
    if not rows:
        raise ConfigError("--gpu all with --nproc: name one GPU of the table, e.g. --gpu \"H100 SXM\"")
    row, batch = rows[0], args.batch or cfg.train.batch_size
    per_gpu = links.share(batch, args.nproc)
    found = roofline.for_config(cfg, optim.for_count, per_gpu)
    model, state = links.model_counts(cfg, optim.for_count)
    link = links.link(row, args.nproc, args.gpu)
    params = sum(q.numel() for q in model.parameters())
    print(f"Roofline of one training step on {args.nproc} {row['name']} GPUs ({strategy.upper()}): "
          f"{found['model']}, {params / 1e6:,.2f} M parameters, global batch {batch} ({per_gpu} per GPU), "
          f"{found['input_size']}x{found['input_size']} inputs, {cfg.train.optimizer} ({state} state value"
          f"{'s' if state != 1 else ''} per parameter)")
    print(f"{row['name']}: {row['source']}; memory {row['bandwidth_gbps']:,} GB/s")
    print(f"GPU to GPU: {link['name']}, {link['gbps']:,g} GB/s per GPU both ways, so {link['gbps'] / 2:,g} GB/s sent "
          f"by each in a ring ({link['source']})\n" if link else
          f"GPU to GPU: n/a (no source gives {row['name']}'s link between GPUs): the collectives' bytes without a "
          "time\n")
    def prepare(p, meta):  # as FSDP trains it: fp8 converted, its weights gathered in fp8
        import copy

        from ampbench import runplan
        from ampbench.precision import rung
        return rung(p).prepare(copy.deepcopy(meta), runplan.recipe(cfg, p), cfg.model.convert_ends, sharded=True) \
            if rung(p).converts else meta
    from ampbench import runplan
    refusals = {p: why for p in found["ops"] if (why := runplan.fsdp_refusal(cfg, p))} if strategy == "fsdp" else {}
    t = links.table(found["ops"], row, model, state, args.nproc, strategy, batch, cfg.distributed.fsdp_reduce_dtype,
                    args.launch_us, prepare, refusals, link)
    print("\n".join(data_parallel_table(t, link, args.nproc, strategy)))
    print("\nThe step is the longer of one GPU's kernels and the collectives' time on the link (overlapped, as DDP's "
          "buckets and FSDP's prefetch overlap them at best), the collectives timed at the link's full figure: a "
          "best case, as NCCL reaches about 80% of it. "
          + roofline_note(args.launch_us))


def check_model_cmd(args) -> None:
    """One model (an arch or a factory ``module:function``) checked against params.yaml's data and variants."""
    import json

    import yaml

    from ampbench.models import TV_PREFIX
    from ampbench.train import conformance
    raw = {}
    if Path(args.params).is_file():
        config.load(args.params)  # a broken params.yaml is reported as the pipeline reports it
        raw = yaml.safe_load(Path(args.params).read_text())
    factory = ":" in args.model and not args.model.startswith(TV_PREFIX)
    model = {"factory": args.model} if factory else {"arch": args.model, "factory": ""}
    raw["model"] = {**(raw.get("model") or {}), **model}
    cfg = config.from_dict(raw)  # a bad arch name stops here, with the names it takes
    precisions = tuple(p for p in args.precisions.split(",") if p) if args.precisions else ()
    for p in precisions:
        if p not in precision.names():
            raise ConfigError(f"--precisions: {p!r} is not a precision; use {', '.join(precision.names())}")
    import torch
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    result = conformance.check_model(cfg, precisions=precisions, device=device, step_budget_s=args.step_budget,
                                     no_step=args.no_step)
    print(conformance.table(result))
    if args.json:
        from ampbench.results import atomic_write
        atomic_write(Path(args.json), json.dumps(result, indent=2, sort_keys=True, default=str) + "\n")
    if not result["ok"]:
        failed = [r["check"] for r in result["rows"] if r["ok"] is False]
        print(f"\n{result['model']}: {', '.join(failed)} failed (the table says why)", file=sys.stderr)
        sys.exit(1)


def main() -> None:
    ap = argparse.ArgumentParser(prog="ampbench", description="FP32 vs FP16-AMP, measured on your hardware")
    sub = ap.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="run the pipeline on the CPU with synthetic data, in its own folder")
    d.add_argument("--dir", default="demo", help="folder for the demo's repository (default: demo)")
    d.add_argument("--arch", default="", help="model.arch for the demo instead of small_cnn, e.g. vit_tiny "
                                              "(fp16 is emulated on a CPU: a transformer takes minutes)")
    d.add_argument("--ladder", action="store_true",
                   help="the variants fp32, tf32, bf16, amp (fp16) and fp8 instead of params.yaml's (fp8 converts "
                        "Linear layers: use it with --arch vit_tiny)")
    d.add_argument("--optimizer", choices=optim.names(), default="",
                   help="train.optimizer for the demo, with that optimizer's own lr and weight decay "
                        "(adamw trains a ViT; SGD at lr 0.1 does not)")
    d.add_argument("--nproc-per-node", type=int, default=1, metavar="N",
                   help="train under torchrun with N processes (gloo), each variant also once in one process "
                        "for the scaling efficiency, and fp32 with fp16 gradient communication")
    rp = sub.add_parser("repro", help="dvc repro, with a SIGTERM (docker stop, Kubernetes) passed on to it and its "
                        "stages waited for: the command for a container's entrypoint")
    rp.add_argument("dvc_args", nargs=argparse.REMAINDER, help="arguments for dvc repro (e.g. train@amp --force)")
    s = sub.add_parser("mlflow-sync", help="log on-disk runs missing from MLflow (no duplicates)")
    s.add_argument("--params", default="params.yaml")
    s.add_argument("--reports", default="reports", help="the pipeline's reports folder")
    u = sub.add_parser("mlflow-ui", help="start the MLflow UI on this repository's runs and print its URL")
    u.add_argument("--params", default="params.yaml")
    u.add_argument("--store", default="", help="an ampbench SQLite store, e.g. demo/mlflow.db (default: params)")
    u.add_argument("--host", default="127.0.0.1")
    u.add_argument("--port", type=int, default=5000)
    u.add_argument("--wait", type=float, default=180, help="seconds to wait for the server to answer")
    c = sub.add_parser("compare", help="what each precision bought on each machine, from the tracking store")
    c.add_argument("--params", default="params.yaml")
    c.add_argument("--experiment", default="", help="the MLflow experiment (default: params.yaml's mlflow.experiment)")
    c.add_argument("--out", default="reports/compare", help="writes <out>.md and <out>.png (default: reports/compare)")
    r = sub.add_parser("roofline", help="what each precision could give at most on a GPU, from its datasheet")
    r.add_argument("--gpu", required=True, help='a GPU of the datasheet table, e.g. "RTX 5090" or H100 SXM; or all')
    r.add_argument("--params", default="params.yaml")
    r.add_argument("--batch", type=int, default=0, help="images per step (default: train.batch_size)")
    r.add_argument("--launch-us", type=float, default=None, help="the host's least time per kernel launch, in "
                   "microseconds (default 4; make gpu-validate measures a machine's)")
    r.add_argument("--nproc", type=int, default=1, metavar="N", help="N GPUs of one node, data-parallel: the "
                   "collectives' bytes at the GPUs' interconnect bandwidth and the memory per GPU by part")
    r.add_argument("--strategy", choices=("ddp", "fsdp"), default="",
                   help="with --nproc: DDP or FSDP (default: params.yaml's distributed.strategy)")
    r.add_argument("--inference", action="store_true", help="count one forward pass in eval mode without gradients "
                   "(to set beside published inference figures) instead of a training step")
    from ampbench.tracking import server
    server.add_parsers(sub)  # team-server, team-user
    m = sub.add_parser("check-model", help="will a model run here? input size, roofline, fp8, one step per "
                                           "precision (seconds to a minute on a CPU)")
    m.add_argument("model", help="a model.arch (resnet18, vit_tiny, tv:<torchvision name>) or a factory "
                                 "module:function")
    m.add_argument("--params", default="params.yaml", help="the data, variants and training settings to check with")
    m.add_argument("--precisions", default="", help="comma-separated precisions to step (default: the variants')")
    m.add_argument("--device", default="", choices=("", "cpu", "cuda"),
                   help="cpu or cuda (default: cuda when there is one)")
    m.add_argument("--step-budget", type=float, default=0.0, metavar="S",
                   help="step no other precision once fp32's step took longer than S seconds (0: no budget)")
    m.add_argument("--no-step", default="", metavar="REASON", help="step nothing, giving this reason")
    m.add_argument("--json", default="", metavar="PATH", help="write the result as JSON too")
    args = ap.parse_args()
    if args.command == "check-model":
        run_cli(lambda: check_model_cmd(args))
    elif args.command == "roofline":
        run_cli(lambda: roofline_cmd(args))
    elif args.command == "mlflow-ui":
        run_cli(lambda: mlflow_ui(args))
    elif args.command == "demo":
        run_cli(lambda: demo(Path(args.dir), args.arch, args.nproc_per_node, args.ladder, args.optimizer))
    elif args.command == "repro":
        from ampbench.errors import supervise
        sys.exit(supervise([sys.executable, "-m", "dvc", "repro", *args.dvc_args]))
    elif args.command == "mlflow-sync":
        run_cli(lambda: mlflow_sync(args))
    elif args.command == "compare":
        run_cli(lambda: compare(args))
    elif args.command == "team-server":
        run_cli(lambda: server.team_server(args))
    elif args.command == "team-user":
        run_cli(lambda: server.team_user(args))


if __name__ == "__main__":
    main()
