"""``satjax train | sft | eval``: argument parsing around the library functions."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from satjax.config import ConfigError, load_config


def _parser(prog: str, description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--config", default=None, help="YAML config (default: built-in tiny run)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set objective.hparams.lam=0.5")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


def _load(p: argparse.ArgumentParser, args: argparse.Namespace):
    try:
        return load_config(args.config, args.overrides)
    except (ConfigError, FileNotFoundError) as e:
        p.exit(2, f"{p.prog}: error: {e}\n")


def train(argv: list[str]) -> int:
    p = _parser("satjax train", "Asynchronous RL: queue server + rollout workers + trainer.")
    p.add_argument("--resume", action="store_true", help="continue the run in run_dir")
    args = p.parse_args(argv)
    cfg = _load(p, args)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    from satjax.app.run import run_train
    from satjax.run_dir import RunDirs

    try:
        last = run_train(cfg, resume=args.resume, progress=not args.no_progress)
    except FileExistsError as e:
        p.exit(2, f"{p.prog}: error: {e}\n")
    keys = ("reward_mean", "loss", "lag_mean", "sat_tail_frac", "router_mismatch")
    print(json.dumps({k: last[k] for k in keys if k in last}))
    print(f"run directory: {cfg.run_dir} (metrics: {RunDirs(cfg.run_dir).metrics})")
    return 0


def sft(argv: list[str]) -> int:
    p = _parser("satjax sft", "Supervised warm-up; writes a HF checkpoint to <run_dir>/sft.")
    args = p.parse_args(argv)
    cfg = _load(p, args)
    from satjax.app.run import warm_start
    from satjax.factory import build_task, build_tokenizer
    from satjax.run_dir import RunDirs

    tok, task = build_tokenizer(cfg), build_task(cfg)
    warm_start(cfg, tok, task, progress=not args.no_progress)
    print(f"warm-up checkpoint: {RunDirs(cfg.run_dir).sft}")
    return 0


def evaluate(argv: list[str]) -> int:
    p = _parser("satjax eval", "avg@k and pass@k on the held-out split.")
    p.add_argument("--model", default=None,
                   help="HF checkpoint dir (default: the run's latest published weights)")
    p.add_argument("--k", type=int, default=None)
    p.add_argument("--num-prompts", type=int, default=None)
    args = p.parse_args(argv)
    cfg = _load(p, args)
    from satjax.app.evaluate import evaluate as run_eval
    from satjax.factory import build_task, build_tokenizer, sampling_params
    from satjax.model import from_pretrained
    from satjax.run_dir import RunDirs
    from satjax.weight_sync import WeightSubscriber

    path = args.model
    if path is None:
        sub = WeightSubscriber(RunDirs(cfg.run_dir).weights)
        latest = sub.latest_version()
        if latest is None:
            p.exit(2, f"{p.prog}: error: no published weights under {cfg.run_dir}; pass --model\n")
        path = str(sub.checkpoint_dir(latest))
    tok, task = build_tokenizer(cfg), build_task(cfg)
    result = run_eval(
        from_pretrained(path), task, tok,
        num_prompts=args.num_prompts or cfg.eval.num_prompts, k=args.k or cfg.eval.k,
        sampling=sampling_params(cfg, tok, temperature=cfg.eval.temperature), seed=cfg.seed,
    )
    json.dump({"model": path, **result.as_dict()}, sys.stdout)
    print()
    return 0
