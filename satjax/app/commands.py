"""``satjax train | sft | eval``: argument parsing around the library functions.

User errors (a bad config key or value, a missing path, a run directory that does not
fit the command) end the command with exit code 2 and one line
``satjax <command>: error: ...``, before anything slow (model build, warm-up, processes)
starts. ``satjax train`` exits 0 when it finished, 130 when interrupted (after its clean
checkpoint) and 1 when it failed; its last line says where the run stopped and how to
continue it.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import importlib.util
import json
import logging
import os
import shlex
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from satjax.app.launch import ChildExitedError
from satjax.config import Config, ConfigError, file_digest, load_config
from satjax.run_dir import RunDirError, RunDirs

EXIT_USAGE = 2  # argparse's code for a bad command line; used for every user error
EXIT_INTERRUPTED = 130  # the shell's code for a Ctrl-C'd command (128 + SIGINT)

# Keys a resumed run may change: how long it runs, how often it checkpoints, how it is
# evaluated and where its workers and queue run. Anything else (the model, the task, the
# objective, the optimizer, batch shapes, lags) would silently make it another experiment.
RESUME_SAFE_KEYS = ("train.steps", "checkpoint.every", "checkpoint.keep", "eval.",
                    "rollout.num_workers", "rollout.vllm_python", "rollout.queue_retry_s",
                    "queue.address", "task.reward_timeout_s",
                    "queue.token", "queue.fsync", "queue.ready_timeout_s")


def parser(prog: str, description: str) -> argparse.ArgumentParser:
    """The options every config-driven command takes (--config, --set, --no-progress)."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--config", default=None,
                   help="YAML config (default: the built-in defaults, i.e. configs/tiny.yaml; "
                        "eval: the run's config.yaml if run_dir has one)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key (repeatable), e.g. --set train.steps=50 "
                        "--set objective.hparams.lam=0.5")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bars: a status line every --log-every steps instead")
    p.add_argument("--log-every", type=int, default=10, metavar="N",
                   help="with --no-progress, print one status line every N steps "
                        "(default: %(default)s)")
    return p


def fail(p: argparse.ArgumentParser, message: str) -> NoReturn:
    """Ends the command: exit code 2 and the one line ``<prog>: error: <message>``."""
    p.exit(EXIT_USAGE, f"{p.prog}: error: {message}\n")


def load(p: argparse.ArgumentParser, args: argparse.Namespace) -> Config:
    """The config ``args`` select, validated (values, paths, devices, engine)."""
    try:
        cfg = load_config(args.config, args.overrides)
        check_resources(cfg)
    except ConfigError as e:
        fail(p, str(e))
    if args.log_every < 1:
        fail(p, f"--log-every: must be >= 1, got {args.log_every!r}")
    return cfg


def damaged(p: argparse.ArgumentParser, error: BaseException) -> int:
    """Ends a command that found published weights it cannot read (a damaged or cut-short
    file, a base version gone): exit code 1 and one line naming the version and the file,
    not a traceback. Nothing was written."""
    print(f"{p.prog}: error: {error}", file=sys.stderr)
    return 1


def check_resources(cfg: Config) -> None:
    """What ``load_config`` cannot check without looking outside the config: the paths it
    names exist, the mesh fits the devices, the vLLM interpreter can import vllm. Cheap:
    nothing is built or loaded. Raises ConfigError naming the key."""
    # imports jax, as load_config has
    from satjax.app.factory import (
        TOKENIZER_FILES,
        architecture_mismatch,
        model_config,
        tokenizer_path,
    )
    from satjax.model.tokenizer import CharTokenizer

    def need(cond: bool, key: str, what: str, value: Any) -> None:
        if not cond:
            raise ConfigError(f"config key {key!r}: must be {what}, got {value!r}")

    _check_overrides(cfg)
    if cfg.model.path:
        config_json = Path(cfg.model.path) / "config.json"
        need(config_json.is_file(), "model.path",
             "a Hugging Face checkpoint directory (with config.json)", cfg.model.path)
        model_type = json.loads(config_json.read_text()).get("model_type")
        need(model_type in SUPPORTED_MODEL_TYPES, "model.path",
             f"a Qwen3-MoE or dense Qwen3 checkpoint (config.json model_type "
             f"{' or '.join(SUPPORTED_MODEL_TYPES)}; this one is {model_type!r})",
             cfg.model.path)
        mismatch = architecture_mismatch(cfg)
        need(not mismatch, "model.path", "a checkpoint of the architecture model.overrides "
             f"gives ({'; '.join(mismatch)})", cfg.model.path)
        if not tokenizer_path(cfg):
            vocab = model_config(cfg).vocab_size
            need(vocab == CharTokenizer().vocab_size, "task.tokenizer_path",
                 f"set: model.path has no tokenizer files ({', '.join(TOKENIZER_FILES)}) "
                 f"and the built-in character tokenizer does not fit its {vocab}-token "
                 "vocabulary", "")
    else:
        # a config that writes an architecture out (configs/qwen3-30b-a3b.yaml) names the
        # model to load; satjax does not RL-train one from random weights
        need(cfg.model.preset == "tiny", "model.path",
             "a local checkpoint directory of the model model.overrides describes", "")
    _check_dense(cfg, need)
    if cfg.task.tokenizer_path:
        need(Path(cfg.task.tokenizer_path).is_dir(), "task.tokenizer_path",
             "an existing tokenizer directory", cfg.task.tokenizer_path)
    tok_dir = tokenizer_path(cfg)
    if tok_dir:
        need_extra("transformers", "hf", "task.tokenizer_path",
                   "a Hugging Face tokenizer is read with transformers", tok_dir)
    if cfg.task.name == "jsonl":
        _check_data(cfg, need)
    _check_reward(cfg.task.reward or ("math_verify" if cfg.task.name == "jsonl" else ""))
    if cfg.task.prompt_template == "chat":
        # transformers renders a chat template with jinja2 but does not require it
        need_extra("jinja2", "hf", "task.prompt_template",
                   "a chat template is rendered with jinja2", "chat")
        need(bool(tok_dir) and has_chat_template(tok_dir), "task.prompt_template",
             "'chat' only with a Hugging Face tokenizer that has a chat template "
             f"(tokenizer: {tok_dir or 'the built-in character tokenizer'})", "chat")
    import jax  # load_config has imported it already (the objectives' checks)

    devices = jax.device_count()
    mesh = cfg.train.mesh
    need(mesh.size <= devices, "train.mesh",
         f"at most the {devices} device(s) there are (data*fsdp*expert*tensor = {mesh.size})",
         dataclasses.asdict(mesh))
    if cfg.rollout.engine == "vllm":
        from satjax.rollout.vllm_engine import resolve_python

        try:
            resolve_python(cfg.rollout.vllm_python)
        except ValueError as e:  # "rollout.vllm_python: <what is wrong>"
            raise ConfigError(f"config key 'rollout.vllm_python': {str(e).partition(': ')[2]}"
                              ) from None


def _check_overrides(cfg: Config) -> None:
    """``model.overrides`` names fields of the model's config, with values in the ranges
    written beside them (over the tiny preset sized to the built-in tokenizer, or as the
    whole architecture; over a ``model.path`` checkpoint they are compared with its
    config.json instead). The error names the field when the override gave it."""
    from satjax.model import Qwen3MoeConfig
    from satjax.model.tokenizer import CharTokenizer

    fields = [f.name for f in dataclasses.fields(Qwen3MoeConfig)]
    overrides = cfg.model.overrides
    for key in overrides:
        if key not in fields:
            raise ConfigError(f"config key 'model.overrides.{key}': must be a field of the "
                              f"model config ({', '.join(fields)}), got unknown {key!r}")
    if cfg.model.path:
        return
    if cfg.model.preset == "tiny" and not cfg.task.tokenizer_path:
        # the tiny preset is sized to the tokenizer: a smaller vocabulary has no row for
        # some of its token ids
        vocab = CharTokenizer().vocab_size
        value = overrides.get("vocab_size", vocab)
        if not (isinstance(value, int) and value >= vocab):
            raise ConfigError(f"config key 'model.overrides.vocab_size': must be >= {vocab} "
                              f"(the built-in character tokenizer's vocabulary), got {value!r}")
    try:
        if cfg.model.preset == "tiny":
            Qwen3MoeConfig.tiny(**overrides)
        else:
            Qwen3MoeConfig(**overrides)
    except (TypeError, ValueError) as e:
        field, _, what = str(e).partition(": ")
        key = f"model.overrides.{field}" if field in overrides else "model.overrides"
        raise ConfigError(f"config key {key!r}: {what if field in overrides else e}") from None


def _check_dense(cfg: Config, need: Callable[[bool, str, str, Any], None]) -> None:
    """A dense model (no MoE layer: ``model.path``'s, or ``num_experts: 0`` in
    ``model.overrides``) has no routes, so the run records and replays none."""
    from satjax.app.factory import model_config
    from satjax.model import Qwen3MoeConfig

    overrides = cfg.model.overrides
    if cfg.model.path:
        mcfg, source = model_config(cfg), f"{cfg.model.path} has no MoE layers"
    else:
        mcfg = Qwen3MoeConfig.tiny(**overrides) if cfg.model.preset == "tiny" else \
            Qwen3MoeConfig(**overrides)
        source = f"model.overrides {overrides} give no MoE layer"
    if mcfg.moe_layer_indices:
        return
    for key in ("train.replay", "rollout.record_routes"):
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        need(value in (False, "off"), key, f"false for a dense model ({source}, so there "
             "are no routes to record or replay)", value)


def check_token(cfg: Config) -> None:
    """The queue token ``satjax train`` will use (``queue.token``, else the environment's)
    meets the queue server's rule, so that a short one fails here, not at the first call."""
    from satjax.queue.protocol import MIN_TOKEN_CHARS, TOKEN_ENV

    key, token = (("config key 'queue.token'", cfg.queue.token) if cfg.queue.token
                  else (f"environment variable {TOKEN_ENV}", os.environ.get(TOKEN_ENV, "")))
    if token and len(token.strip()) < MIN_TOKEN_CHARS:
        raise ConfigError(f"{key}: must be at least {MIN_TOKEN_CHARS} characters (the queue "
                          f"server's rule; e.g. python -c 'import secrets; "
                          f"print(secrets.token_urlsafe(24))'), got {len(token.strip())}")


# config.json model_type values satjax loads (satjax.model.hf_io.from_pretrained)
SUPPORTED_MODEL_TYPES = ("qwen3_moe", "qwen3")


def need_extra(module: str, extra: str, key: str, why: str, value: Any) -> None:
    """Raises ConfigError naming ``key`` and the install command when ``module`` (an
    optional dependency) is not importable."""
    if importlib.util.find_spec(module) is None:
        raise ConfigError(f"config key {key!r}: {why}, which is not installed: "
                          f"pip install 'satjax[{extra}]' (got {value!r})")


def has_chat_template(tokenizer_dir: str) -> bool:
    """Whether a HF tokenizer directory has a chat template (in tokenizer_config.json or
    chat_template.jinja), read without loading the tokenizer."""
    d = Path(tokenizer_dir)
    if (d / "chat_template.jinja").is_file():
        return True
    config = d / "tokenizer_config.json"
    return config.is_file() and bool(json.loads(config.read_text()).get("chat_template"))


def _check_data(cfg: Config, need: Callable[[bool, str, str, Any], None]) -> None:
    """The jsonl task's files, fields and template fields: read from each file's first row
    only (fast), so a typo fails before the model loads."""
    from satjax.data.tasks import data_format, first_row

    t = cfg.task
    for key in ("task.jsonl_path", "task.eval_path"):
        path = getattr(t, key.split(".")[1])
        if not path and key == "task.eval_path":  # optional
            continue
        need(bool(path) and Path(path).exists(), key,
             "an existing file (JSONL or Parquet) or datasets directory", path)
        fmt = data_format(path)
        if fmt != "jsonl":
            need_extra("pyarrow" if fmt == "parquet" else "datasets", "data", key,
                       f"reading {'Parquet' if fmt == 'parquet' else 'a datasets directory'} "
                       "needs " + ("pyarrow" if fmt == "parquet" else "datasets"), path)
        try:
            row = first_row(path)
        except ValueError as e:
            raise ConfigError(f"config key {key!r}: {e}") from None
        for field_key in ("task.question_field", "task.answer_field"):
            field = getattr(t, field_key.split(".")[1])
            need(field in row, field_key, f"a field of {path}'s rows "
                 f"({', '.join(map(str, row))})", field)
        if t.prompt_template not in ("raw", "chat"):
            try:
                t.prompt_template.format(prompt="", **row)
            except (KeyError, IndexError) as e:
                raise ConfigError(f"config key 'task.prompt_template': must name only "
                                  f"fields of {path}'s rows (prompt, "
                                  f"{', '.join(map(str, row))}), got {{{e.args[0]}}}") from None
            except ValueError as e:
                raise ConfigError(f"config key 'task.prompt_template': must be a format "
                                  f"string ({e}), got {t.prompt_template!r}") from None
def _check_reward(reward: str) -> None:
    """The reward ``task.reward`` names can be computed: its extra installed, its module
    imported (once: the process keeps it)."""
    from satjax.data.rewards import import_reward

    if reward == "math_verify":
        need_extra("math_verify", "math", "task.reward",
                   "the math_verify reward needs math-verify", reward)
    elif reward not in ("", "exact"):
        try:
            import_reward(reward)
        except ValueError as e:
            raise ConfigError(f"config key 'task.reward': {str(e).partition(': ')[2]}") \
                from None


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for k, v in tree.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out or {prefix[:-1]: {}}
    return {prefix[:-1]: tree}


def changed_keys(old: Config, new: Config) -> list[str]:
    """Dotted keys whose values differ between two configs."""
    a, b = _flat(old.to_dict()), _flat(new.to_dict())
    changed = {k for k in a.keys() | b.keys() if a.get(k) != b.get(k)}
    # an empty mapping given keys is named by its new keys alone
    return sorted(k for k in changed if not any(c.startswith(k + ".") for c in changed))


def _resume_unsafe(keys: list[str]) -> list[str]:
    # run_dir is where the run is, not what it is: a moved run resumes from its new place
    return [k for k in keys if k != "run_dir" and not k.startswith(RESUME_SAFE_KEYS)]


def edited_keys(dirs: RunDirs, saved: Config) -> list[str] | None:
    """The keys of the run's ``config.yaml`` (loaded: ``saved``) that differ from what the
    run wrote: ``[]`` when its digest is the recorded one (or the run recorded none), the
    keys that differ from ``weights/run_config.yaml`` when that copy is the recorded one,
    None when neither is (both edited). The digests are of the files' values
    (:func:`~satjax.config.file_digest`), the comparison of the loaded configs: a key this
    satjax added since the run was written is neither an edit nor a change."""
    try:
        recorded = dirs.config_digest.read_text().strip()
    except FileNotFoundError:  # a run of a satjax that recorded no digest
        return []
    if file_digest(dirs.config) == recorded:
        return []
    try:
        if file_digest(dirs.weights_config) != recorded:
            return None
        original = load_config(dirs.weights_config)
    except ConfigError:
        return None
    return [k for k in changed_keys(original, saved) if k != "run_dir"]


def resume_config(p: argparse.ArgumentParser, args: argparse.Namespace, cfg: Config) -> Config:
    """The config a ``--resume`` continues with: the run's saved config, with ``--set`` (or
    a ``--config`` that agrees with it) changing only :data:`RESUME_SAFE_KEYS`. A
    ``config.yaml`` edited by hand since the run wrote it (its digest, ``config.sha256``,
    differs) is refused the same way, naming the keys; ``run_dir`` is the one given, so a
    moved run (or one named by another relative path) resumes where it now is."""
    dirs = RunDirs(cfg.run_dir)
    if not dirs.config.exists():
        fail(p, f"run_dir {cfg.run_dir!r}: no run to resume (no {dirs.config.name}); "
                "start one without --resume, or set run_dir to the run's directory")
    try:
        saved = load_config(dirs.config)
        edited = edited_keys(dirs, saved)
    except ConfigError as e:
        fail(p, str(e))
    # a key ending in "." stands for its section's keys
    safe = "--resume may change only " + ", ".join(
        f"{k}*" if k.endswith(".") else k for k in RESUME_SAFE_KEYS)
    if edited is None:
        fail(p, f"{dirs.config}: changed since the run wrote it (its digest is not the one "
                f"in {dirs.config_digest.name}, and {dirs.weights_config} differs too); "
                "restore the run's config, or start a new run in another run_dir")
    if _resume_unsafe(edited):
        fail(p, f"{dirs.config}: edited since the run wrote it: config key(s) "
                f"{', '.join(repr(k) for k in _resume_unsafe(edited))} changed (the run's "
                f"values are in {dirs.weights_config}); restore them, or start a new run "
                f"in another run_dir; {safe}")
    try:
        wanted = cfg if args.config else load_config(dirs.config, args.overrides)
        wanted = dataclasses.replace(wanted, run_dir=cfg.run_dir)
        check_resources(wanted)
    except ConfigError as e:
        fail(p, str(e))
    unsafe = _resume_unsafe(changed_keys(saved, wanted))
    if unsafe:
        fail(p, f"config key(s) {', '.join(repr(k) for k in unsafe)}: must not change on "
                f"--resume (the run was started with other values; see {dirs.config}); "
                f"{safe}")
    return wanted


class ExitOnInterrupt:
    """While entered, Ctrl-C ends ``satjax train`` at once: ``line()`` on stderr, exit code
    130 (unless SIGINT is ignored, as in a shell's background job). For start-up (imports,
    warm-up, compiles, the queue and the workers) and the last moments of shutdown; the RL
    loop's own handler (``satjax.app.run._StopOnInterrupt``: finish the step, checkpoint)
    turns this off while steps run.

    A Python signal handler runs only once the main thread is back in the interpreter, which
    an XLA compile holds off for as long as it takes, and a KeyboardInterrupt raised into
    JAX, gRPC or Orbax while their threads run can hang the process or crash it at exit
    (exit 139). So the C-level handler's wakeup byte (:func:`signal.set_wakeup_fd`) is read
    by a thread that prints the line and leaves with ``os._exit``: no unwinding, no
    finalizers. Nothing is lost: before the first RL step nothing is trained or
    acknowledged, the config and the warm-up are written atomically (a half-written publish
    stays in a staging directory readers ignore), the children get SIGTERM from the kernel
    when their parent goes (``satjax.app.launch``) and the run directory's lock goes with
    the process.
    """

    def __init__(self, line: Callable[[], str]) -> None:
        self.line = line
        self._r = self._w = -1
        if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:  # `nohup satjax train &`
            return
        self._r, self._w = os.pipe()
        os.set_blocking(self._w, False)  # set_wakeup_fd needs a non-blocking descriptor
        # a handler that raises nothing: the watcher thread acts
        self._old_handler = signal.signal(signal.SIGINT, lambda *_: None)
        self._old_fd = signal.set_wakeup_fd(self._w)
        threading.Thread(target=self._watch, name="exit-on-interrupt", daemon=True).start()

    def _watch(self) -> None:
        while True:
            try:
                data = os.read(self._r, 64)
            except OSError:  # closed by close()
                return
            if not data:
                return
            if signal.SIGINT in data:
                try:
                    text = self.line()
                except Exception as e:  # the line is best effort; the exit is not
                    text = f"satjax train: interrupted ({e!r})"
                os.write(sys.stderr.fileno(), f"\n{text}\n".encode())
                os._exit(EXIT_INTERRUPTED)

    def close(self) -> None:
        """Ctrl-C raises KeyboardInterrupt again."""
        if self._w < 0:
            return
        signal.set_wakeup_fd(self._old_fd)
        signal.signal(signal.SIGINT, self._old_handler)
        os.close(self._w)  # the watcher reads EOF and ends
        os.close(self._r)

    def __enter__(self) -> ExitOnInterrupt:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def continue_command(run_dir: str, reward: str = "") -> str:
    """The command that continues the run, with the ``PYTHONPATH`` its reward module
    (``task.reward`` "module:function") was found on, when it was found there."""
    from satjax.data.rewards import reward_path

    path = reward_path(reward)
    env = f"PYTHONPATH={shlex.quote(path)} " if path else ""
    return f"{env}satjax train --set run_dir={shlex.quote(run_dir)} --resume"


def train(argv: list[str]) -> int:
    p = parser("satjax train", "Asynchronous RL: queue server + rollout workers + trainer.")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in run_dir with its saved config.yaml (--set may "
                        "change only train.steps, checkpoint.*, eval.*, rollout.num_workers, "
                        "queue.*)")
    g = p.add_argument_group(
        "multi-process (one satjax train per host; see docs/parallel.md)",
        "Process 0 runs the queue and the workers and consumes the queue; every process "
        "trains on its devices of one global mesh. Each flag falls back to its environment "
        "variable.")
    g.add_argument("--coordinator", metavar="HOST:PORT",
                   help="process 0's address for jax.distributed ($SATJAX_COORDINATOR)")
    g.add_argument("--num-processes", type=int, metavar="N",
                   help="number of processes ($SATJAX_NUM_PROCESSES)")
    g.add_argument("--process-id", type=int, metavar="I",
                   help="this process's id in [0, N) ($SATJAX_PROCESS_ID)")
    g.add_argument("--distributed", action="store_true",
                   help="let JAX detect the cluster (TPU VM slices, SLURM, Open MPI)")
    args = p.parse_args(argv)
    started: list[Config] = []  # known once the config is loaded

    def interrupted() -> str:
        where = (f"{_checkpoint_note(RunDirs(started[0].run_dir))}; "
                 f"{next_step(started[0].run_dir, None, started[0].task.reward)}"
                 if started else "nothing started yet")
        return f"satjax train: interrupted outside the RL steps (starting or stopping); {where}"

    with ExitOnInterrupt(interrupted):
        return _train(p, args, started)


def _train(p: argparse.ArgumentParser, args: argparse.Namespace, started: list[Config]
           ) -> int:
    from satjax import parallel

    try:  # before anything touches a device: the mesh check counts the global devices
        parallel.init_distributed(args.coordinator, args.num_processes, args.process_id,
                                  auto=args.distributed)
    except ValueError as e:
        fail(p, str(e))
    cfg = load(p, args)
    dirs = RunDirs(cfg.run_dir)
    if args.resume:
        cfg = resume_config(p, args, cfg)
    try:
        check_token(cfg)
    except ConfigError as e:
        fail(p, str(e))
    started.append(cfg)
    reward = cfg.task.reward
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    from satjax.app.run import QueueUnreachableError, run_train

    try:
        outcome = run_train(cfg, resume=args.resume, progress=not args.no_progress,
                            log_every=args.log_every)
    except (FileExistsError, ConfigError, RunDirError) as e:  # the run directory, the data
        fail(p, str(e))
    except QueueUnreachableError as e:
        print(f"satjax train: error: {e}; {next_step(cfg.run_dir, e, reward)}",
              file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # a second Ctrl-C during the RL loop's final checkpoint
        print(f"satjax train: interrupted; {_checkpoint_note(dirs)}; "
              f"{next_step(cfg.run_dir, None, reward)}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as e:
        if isinstance(e, ChildExitedError):  # its log says why; the trainer's stack cannot
            print(f"satjax train: {e}", file=sys.stderr)
        else:
            traceback.print_exc()
        import jax

        if jax.process_count() > 1:
            # No more collectives (the peers wait in one this process left; reading the
            # checkpoint list through Orbax is one too), and no normal exit: it runs
            # jax.distributed's shutdown barrier. Ending here lets their heartbeat stop them.
            print(f"satjax train: failed in process {jax.process_index()}; continue with: "
                  f"{continue_command(cfg.run_dir, reward)} (on every process, once a "
                  "checkpoint "
                  "exists)", file=sys.stderr, flush=True)
            sys.stdout.flush()
            os._exit(1)
        # a child's failure: its last line (e.g. a reward that timed out, naming the example)
        cause = f": {e.name} exited with code {e.returncode}: {e.last_line}" \
            if isinstance(e, ChildExitedError) else ""
        print(f"satjax train: failed{cause}; {_checkpoint_note(dirs)}; "
              f"{next_step(cfg.run_dir, e, reward)}", file=sys.stderr)
        return 1
    keys = ("reward_mean", "loss", "lag_mean", "sat_tail_frac", "router_mismatch")
    if outcome.last:
        print(json.dumps({k: outcome.last[k] for k in keys if k in outcome.last}))
    where = f"run directory: {cfg.run_dir} (metrics: {dirs.metrics})"
    if outcome.interrupted:
        saved = "(checkpointed)" if outcome.step else "(nothing checkpointed yet)"
        print(f"stopped at step {outcome.step} of {outcome.total} {saved}; {where}; "
              f"{next_step(cfg.run_dir, None, reward)}")
        return EXIT_INTERRUPTED
    print(f"finished step {outcome.step} of {outcome.total}; {where}")
    return 0


# OSError causes outside the run that --resume cannot fix until someone does: permissions,
# a read-only or full file system
ENVIRONMENT_ERRNOS = (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT)


def environment_cause(error: BaseException | None) -> OSError | None:
    """The OSError of :data:`ENVIRONMENT_ERRNOS` that ``error`` is or was raised from (a
    full disk reaches the trainer inside a ``WeightSyncError`` of the publish), if any."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, OSError) and error.errno in ENVIRONMENT_ERRNOS:
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def next_step(run_dir: str, error: BaseException | None, reward: str = "") -> str:
    """What to do after a start of ``satjax train`` that ended early (``error``: why; None:
    interrupted). ``--resume`` is suggested only where it can help: the run has a
    checkpoint to continue from (without one, starting again is the same and simpler), and
    after the cause is fixed when the cause is outside the run (a permission, a full or
    read-only disk, a queue that does not answer): the same start would fail the same way.
    ``reward``: ``task.reward``, whose module's ``PYTHONPATH`` the command carries
    (:func:`continue_command`)."""
    from satjax.app.run import QueueUnreachableError

    fix = ""
    cause = environment_cause(error)
    if cause is not None:
        fix = f"fix the cause ({cause.strerror}: {cause.filename or 'see above'}), then "
    elif isinstance(error, QueueUnreachableError):
        fix = "start the queue (or set queue.address to where it runs), then "
    dirs = RunDirs(run_dir)
    if dirs.has_checkpoint():
        return f"{fix}continue with: {continue_command(run_dir, reward)}"
    if error is None:
        return "nothing to resume yet: run the same command again to start over"
    return fix + ("start the run again" if fix else
                  "fix the error above and start the run again") + " (there is nothing to resume)"


def _checkpoint_note(dirs: RunDirs) -> str:
    # from the directory names (an Orbax step directory is named by its step; one being
    # written is not): no Orbax manager, which a signal's thread must not start
    steps = [int(d.name) for d in dirs.checkpoints.iterdir() if d.name.isdigit()] \
        if dirs.checkpoints.is_dir() else []
    return f"the last checkpoint is step {max(steps)}" if steps else "no checkpoint yet"


def sft(argv: list[str]) -> int:
    p = parser("satjax sft", "Supervised warm-up on the task's reference answers (sft.*); "
                             "writes a HF checkpoint to <run_dir>/sft. By default it runs "
                             "for the tiny preset only: with model.path, --set sft.mode=always.")
    args = p.parse_args(argv)
    cfg = load(p, args)
    from satjax.train.sft import warmup_enabled

    if not warmup_enabled(cfg):
        fail(p, f"sft.mode {cfg.sft.mode!r}: no warm-up to run"
                + (f" for model.path {cfg.model.path!r} (a checkpoint starts RL as it is); "
                   "--set sft.mode=always fine-tunes it on the task's reference answers"
                   if cfg.model.path and cfg.sft.mode == "auto" else ""))
    from satjax.app.factory import build_task, build_tokenizer
    from satjax.app.run import warm_start

    tok = build_tokenizer(cfg)
    try:
        task = build_task(cfg, tok)
    except ConfigError as e:
        fail(p, str(e))
    try:
        warm_start(cfg, tok, task, progress=not args.no_progress, log_every=args.log_every)
    except KeyboardInterrupt:
        print("satjax sft: interrupted; nothing saved", file=sys.stderr)
        return EXIT_INTERRUPTED
    start = cfg.model.path or "a freshly initialised tiny MoE"
    print(f"warm-up checkpoint: {RunDirs(cfg.run_dir).sft} ({cfg.sft.steps} steps of "
          f"{cfg.sft.batch_size} examples from {start})")
    return 0


def evaluate(argv: list[str]) -> int:
    p = parser("satjax eval", "avg@k and pass@k on the held-out split: task.eval_path whole, "
                              "else the first eval.num_prompts (prints one JSON line).")
    p.add_argument("--model", default=None,
                   help="HF checkpoint dir (default: the run's latest published weights)")
    p.add_argument("--k", type=int, default=None,
                   help="samples per prompt (default: the config's eval.k)")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="held-out prompts to score (default: the config's eval.num_prompts)")
    args = p.parse_args(argv)
    cfg = load(p, args)
    saved = RunDirs(cfg.run_dir).config
    if args.config is None and saved.is_file():  # score the run with the run's own task
        try:
            cfg = load_config(saved, args.overrides)
        except ConfigError as e:
            fail(p, str(e))
    for flag, value in (("--k", args.k), ("--num-prompts", args.num_prompts)):
        if value is not None and value < 1:
            fail(p, f"{flag}: must be >= 1, got {value!r}")
    from satjax.weight_sync import WeightSubscriber, WeightSyncError

    path = args.model
    sub = WeightSubscriber(RunDirs(cfg.run_dir).weights)
    latest = None
    if path is None:
        latest = sub.latest_version()
        if latest is None:
            fail(p, f"run_dir {cfg.run_dir!r}: has no published weights; pass --model or "
                    "set run_dir to a trained run")
        path = str(sub.checkpoint_dir(latest))
    elif not (Path(path) / "config.json").is_file():
        fail(p, f"--model: must be a Hugging Face checkpoint directory (with config.json), "
                f"got {path!r}")
    from satjax.app.evaluate import evaluate as run_eval
    from satjax.app.factory import build_task, build_tokenizer, prompt_format, sampling_params
    from satjax.model import from_pretrained
    from satjax.rollout.builtin_engine import published_model

    tok = build_tokenizer(cfg)
    try:
        check_resources(cfg)
        task = build_task(cfg, tok)
    except ConfigError as e:
        fail(p, str(e))
    try:
        # the latest version may be a delta: rebuilt from its keyframe
        model = from_pretrained(path) if latest is None else published_model(sub, latest)
    except (WeightSyncError, OSError) as e:
        return damaged(p, e)
    result = run_eval(
        model, task, tok,
        num_prompts=args.num_prompts or cfg.eval.num_prompts, k=args.k or cfg.eval.k,
        sampling=sampling_params(cfg, tok, temperature=cfg.eval.temperature), seed=cfg.seed,
        prompt=prompt_format(cfg),
    )
    json.dump({"model": path, **result.as_dict()}, sys.stdout)
    print()
    return 0


def export(argv: list[str]) -> int:
    p = parser("satjax export", "Writes a published version (a full one, or a delta rebuilt "
                                "from its keyframe) as a complete Hugging Face model: "
                                "config, safetensors, generation config, tokenizer.")
    p.add_argument("--version", type=int, default=None,
                   help="the version to export (default: the latest)")
    p.add_argument("--out", required=True, help="directory to write (must not exist)")
    args = p.parse_args(argv)
    cfg = load(p, args)
    saved = RunDirs(cfg.run_dir).config
    if args.config is None and saved.is_file():  # the run's own tokenizer and model
        try:
            cfg = load_config(saved, args.overrides)
        except ConfigError as e:
            fail(p, str(e))
    if Path(args.out).exists():
        fail(p, f"--out: must not exist yet, got {args.out!r}")
    from satjax.weight_sync import WeightSubscriber, WeightSyncError

    sub = WeightSubscriber(RunDirs(cfg.run_dir).weights)
    version = sub.latest_version() if args.version is None else args.version
    if version is None:
        fail(p, f"run_dir {cfg.run_dir!r}: has no published weights")
    try:
        sub.checkpoint_dir(version)
    except WeightSyncError as e:
        fail(p, f"--version: {e} (kept: the newest versions and their keyframes)")
    from satjax.app.factory import build_tokenizer
    from satjax.model import save_pretrained
    from satjax.rollout.builtin_engine import published_model

    try:
        model = published_model(sub, version)  # float32, checksum- and canary-checked
    except (WeightSyncError, OSError) as e:
        return damaged(p, e)
    save_pretrained(model, args.out, tokenizer=build_tokenizer(cfg))
    print(f"wrote version {version} to {args.out} (a Hugging Face model: "
          "AutoModelForCausalLM.from_pretrained / vllm serve load it)")
    return 0
