"""docs/real-models.md stays true to the code: its config loads, each ``satjax`` command
parses with the command's own parser, and the reward it shows is the script's."""

import re
import shlex
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "real-models.md"


def test_the_docs_config_loads_and_commands_parse(tmp_path, command_parser):
    from satjax.config import load_config

    text = DOC.read_text()
    (config,) = re.findall(r"```yaml\n(.*?)```", text, re.S)
    path = tmp_path / "small.yaml"
    path.write_text(config)
    cfg = load_config(path)
    assert (cfg.task.prompt_template, cfg.task.reward, cfg.rollout.overlong) == \
        ("chat", "my_reward:score", "penalty")
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.splitlines():
            argv = shlex.split(line.split("#", 1)[0])
            while argv and "=" in argv[0]:  # PYTHONPATH=small satjax ...
                argv = argv[1:]
            if argv and argv[0] == "satjax":
                commands.append(argv[1:])
    assert {c[0] for c in commands} == {"train", "eval", "export", "sft"}
    for argv in commands:
        args = command_parser(argv[0]).parse_args(argv[1:])
        load_config(path if args.config else None, args.overrides)


def test_the_docs_reward_is_the_scripts():
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import make_small_model
    finally:
        sys.path.pop(0)
    (shown,) = [b for b in re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
                if "def score" in b]
    assert shown.strip() in make_small_model.REWARD_MODULE


def test_the_hf_extra_brings_what_a_chat_template_needs(monkeypatch):
    """transformers renders chat templates with jinja2 without requiring it: the [hf] extra
    brings it, and a run whose template is "chat" without it stops at start (one line)."""
    import importlib.util
    import tomllib

    import pytest

    from satjax.app.commands import check_resources
    from satjax.config import ConfigError, load_config

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert any(re.match(r"jinja2\b", r) for r in extras["hf"]), extras["hf"]
    # the transformers snippet needs torch: the docs give the CPU wheel's index
    assert "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in \
        DOC.read_text()
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "jinja2" else find_spec(name, *a))
    with pytest.raises(ConfigError, match=r"^config key 'task.prompt_template': a chat "
                       r"template is rendered with jinja2, which is not installed: "
                       r"pip install 'satjax\[hf\]'"):
        check_resources(load_config(overrides=["task.prompt_template=chat"]))
