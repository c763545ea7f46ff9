"""The README's examples: the Optax snippet runs as written and takes a real optimizer
step, every ``satjax`` command parses with the command's own parser and its config loads,
and the sample progress bar is what a run draws."""

import re
import shlex
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import satjax.losses
from satjax.app.sweep_spec import RunSpec

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"


def _optax_snippet() -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    (snippet,) = [b for b in blocks if "satjax.objectives" in b]
    return snippet


def test_readme_optax_example_runs_as_written_and_lowers_the_loss():
    """The snippet builds everything it uses (policy, batch, optimizer state): run alone,
    it takes one Adam step, and that step lowers the objective (first order: lr 1e-3)."""
    scope: dict = {}
    exec(_optax_snippet(), scope)  # noqa: S102 - the README's own code, nothing given
    loss, aux, obj = scope["loss"], scope["aux"], scope["obj"]
    assert np.isfinite(float(loss))
    assert {"clip_frac_low", "clip_frac_high", "sat_tail_frac", "kl_k3"} <= set(aux)
    # an independent reference: the loss function itself on the same arrays
    batch, params = scope["batch"], scope["params"]
    ref, _ = satjax.losses.sat_gspo_loss(
        scope["logprob_fn"](params), batch["behavior_logprobs"], batch["advantages"],
        batch["mask"], eps_low=3e-4, eps_high=4e-4)
    # terms are O(1) (|A| <= 1, ratio ~1) and cancel to ~1e-5: compare absolutely, at a
    # few float32 roundings of one term (traced under grad vs. eager: different fusion)
    assert float(loss) == pytest.approx(float(ref), abs=1e-6)
    new_params = scope["new_params"]
    assert float(jnp.abs(new_params["w"] - params["w"]).max()) > 0
    new_loss, _ = obj(scope["logprob_fn"](new_params), batch)
    assert float(new_loss) < float(loss)


def _readme_commands() -> list[list[str]]:
    """Every ``satjax ...`` command in the README's shell blocks, as argv lists."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", README.read_text(), re.S):
        for line in block.replace("\\\n", " ").splitlines():
            for part in line.split("&&"):
                argv = shlex.split(part, comments=True)  # as bash reads a # comment
                if argv and Path(argv[0]).name == "satjax":  # `satjax` or `.venv/bin/satjax`
                    commands.append(argv[1:])
    return commands


def test_readme_lists_every_command_and_each_example_parses_and_loads(monkeypatch,
                                                                      command_parser):
    from satjax.app import lag_sweep
    from satjax.app.cli import COMMANDS
    from satjax.config import load_config

    monkeypatch.chdir(REPO)
    text = README.read_text()
    for name in COMMANDS:
        assert f"`satjax {name}`" in text, name
    assert text.count(". .venv/bin/activate") == 1  # activation said once
    # the main job is one command on a fresh machine: install and run
    assert ("python3 -m venv .venv && .venv/bin/pip install -e . && .venv/bin/satjax train"
            in text)
    assert "tensorboard --logdir runs/tiny/logs" in text
    commands = _readme_commands()
    assert {c[0] for c in commands} >= {"train", "eval", "lag-sweep"}
    for argv in commands:
        args = command_parser(argv[0]).parse_args(argv[1:])
        if argv[0] == "lag-sweep":
            spec = RunSpec("gspo", 1, 0)
            lag_sweep.run_config(spec, args.config, args.overrides, "out", "warmup", 3, None)
        else:  # resume examples: the keys they change must load over the saved config
            load_config(args.config or "configs/tiny.yaml", args.overrides)


def test_readme_inline_set_examples_load_on_tiny_yaml():
    from satjax.config import load_config

    spans = re.findall(r"`([^`\n]*--set [^`\n]*)`", README.read_text())
    # concrete examples (lower-case dotted keys), not the KEY=VALUE placeholders
    examples = [re.findall(r"--set ([a-z_.]+=\S+)", span) for span in spans]
    assert any(examples)
    for overrides in examples:
        load_config(REPO / "configs/tiny.yaml", overrides)


def test_readme_progress_bar_is_what_a_run_prints():
    from tqdm import tqdm

    from satjax.app.run import step_postfix

    (sample,) = re.findall(r"^rl: .*$", README.read_text(), re.M)
    n, total, elapsed = re.search(r"\| (\d+)/(\d+) \[(\d+):(\d+)<", sample).groups()[:3]
    fields = dict(kv.split("=") for kv in sample.rsplit("/it, ", 1)[1][:-1].split(", "))
    postfix = step_postfix({"reward_mean": float(fields["reward"]),
                            "lag_mean": float(fields["lag"]),
                            "trajectories_per_s": float(fields["traj_s"])})
    assert postfix == fields  # the same fields, in the same format
    # what tqdm draws for that step (the first, compile, step left out of the rate)
    drawn = tqdm.format_meter(n=int(n), total=int(total), elapsed=41, prefix="rl",
                              postfix=", ".join(f"{k}={v}" for k, v in postfix.items()),
                              initial=1)
    assert drawn == sample
