"""A user's data: file formats and field names, prompt templates (BOS once), rewards from
outside, the held-out file scored whole, over-long prompts dropped at load."""

import json
import logging
import sys

import pytest

from satjax.data.pipeline import encode_prompt, eval_examples
from satjax.data.prompts import PromptFormat
from satjax.data.rewards import RewardError, checked_reward, import_reward
from satjax.data.tasks import Example, FileTask, load_examples, load_rows
from satjax.model.tokenizer import CharTokenizer

ROWS = [{"problem": f"{a}+{a}", "solution": f"so\n#### {2 * a}", "level": a} for a in range(5)]


def _jsonl(path, rows=ROWS):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_jsonl_parquet_and_datasets_load_the_same_examples(tmp_path):
    want = load_examples(_jsonl(tmp_path / "d.jsonl"), question_field="problem",
                         answer_field="solution")
    assert [e.answer for e in want] == ["0", "2", "4", "6", "8"]
    assert [e.index for e in want] == list(range(5)) and want[3].fields["level"] == 3
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    # a Parquet file is recognised by its bytes, whatever its name says
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "d.jsonl.parquet-named.jsonl")
    got = load_examples(tmp_path / "d.jsonl.parquet-named.jsonl", question_field="problem",
                        answer_field="solution")
    assert got == want
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "ds"))
    assert load_examples(tmp_path / "ds", question_field="problem",
                         answer_field="solution") == want


def test_wrong_field_and_binary_file_are_one_line_errors(tmp_path):
    with pytest.raises(ValueError, match=r"row 0 has no field 'question' \(its fields: "
                                         r"problem, solution, level\); set task.question_field"):
        load_examples(_jsonl(tmp_path / "d.jsonl"))
    (tmp_path / "x.jsonl").write_bytes(b"\xff\xfe\x00binary")
    with pytest.raises(ValueError, match="not UTF-8 text; give a JSONL or Parquet file"):
        load_rows(tmp_path / "x.jsonl")


class _BosTokenizer(CharTokenizer):
    """The char tokenizer with a chat template that writes BOS itself (as Llama's does)."""

    adds_bos = True

    def chat_text(self, messages):
        return "<bos>" + "".join(f"{m['role'][0]}:{m['content']};" for m in messages) + "a:"

    def encode(self, text, *, add_bos=False, add_eos=False):
        written = text.startswith("<bos>")  # the BOS text, read as the special token
        ids = super().encode(text.removeprefix("<bos>"), add_bos=written)
        return [self.bos_id] * add_bos + ids


def test_templates_put_one_bos():
    tok = _BosTokenizer(chars="0123456789+=:; abcdefghijklmnopqrstuvwxyz")
    ex = Example("p", "1+1", "2", fields={"level": 3})
    bos = tok.bos_id
    raw = encode_prompt(tok, ex)
    assert raw == [bos, *CharTokenizer.encode(tok, "1+1")]
    chat = encode_prompt(tok, ex, PromptFormat("chat", system_prompt="be brief"))
    assert chat[0] == bos and chat[1] != bos
    assert tok.decode(chat) == "s:be brief;u:1+1;a:"
    fmt = encode_prompt(tok, ex, PromptFormat("level {level}: {prompt}="))
    assert fmt == [bos, *CharTokenizer.encode(tok, "level 3: 1+1=")]
    # a format string that writes the BOS text too: still one
    assert encode_prompt(tok, ex, PromptFormat("<bos>{prompt}")) == raw
    with pytest.raises(ValueError, match=r"row -1 has no field 'answer_text'"):
        encode_prompt(tok, ex, PromptFormat("{answer_text}"))
    with pytest.raises(ValueError, match="needs a Hugging Face tokenizer"):
        encode_prompt(CharTokenizer(), ex, PromptFormat("chat"))


def test_user_reward_imported_once_and_errors_name_the_example(tmp_path, monkeypatch):
    (tmp_path / "user_rewards.py").write_text(
        "CALLS = []\n"
        "def score(response, example):\n"
        "    CALLS.append(example.index)\n"
        "    return 1.0 / int(response) if response else float('nan')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = checked_reward("user_rewards:score")
    ex = Example("q1", "?", "1", index=7)
    assert fn("4", ex) == 0.25
    assert import_reward("user_rewards:score") is sys.modules["user_rewards"].score
    with pytest.raises(RewardError, match=r"failed on example 7 \(q1\): ZeroDivisionError"):
        fn("0", ex)
    with pytest.raises(RewardError, match=r"returned nan on example 7"):
        fn("", ex)
    with pytest.raises(ValueError, match="has no function 'nope'"):
        import_reward("user_rewards:nope")
    with pytest.raises(ValueError, match="cannot import module 'no_such_mod'"):
        import_reward("no_such_mod:f")
    assert checked_reward("exact")("2\n", Example("p", "", "2")) == 1.0


def test_a_reward_that_returns_no_number_is_refused_naming_the_example(tmp_path,
                                                                      monkeypatch):
    """``float("1.0")`` parses text: a reward returning the string "1.0" used to be taken."""
    import numpy as np

    (tmp_path / "typed_rewards.py").write_text(
        "import numpy as np\n"
        "def text(response, example):\n    return '1.0'\n"
        "def nothing(response, example):\n    pass\n"
        "def numpy(response, example):\n    return np.float32(0.5)\n"
        "def boolean(response, example):\n    return response == example.answer\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    ex = Example("q1", "?", "1", index=7)
    with pytest.raises(RewardError, match=r"^task.reward 'typed_rewards:text' returned '1.0' "
                       r"\(str\) on example 7 \(q1\); must be a number$"):
        checked_reward("typed_rewards:text")("1", ex)
    with pytest.raises(RewardError, match=r"returned None \(NoneType\) on example 7"):
        checked_reward("typed_rewards:nothing")("1", ex)
    assert checked_reward("typed_rewards:numpy")("1", ex) == np.float32(0.5)
    assert checked_reward("typed_rewards:boolean")("1", ex) == 1.0


def test_eval_file_is_scored_whole_and_split_never_repeats(tmp_path):
    exs = load_examples(_jsonl(tmp_path / "d.jsonl"), question_field="problem",
                        answer_field="solution")
    held = load_examples(_jsonl(tmp_path / "e.jsonl", ROWS[:3]), question_field="problem",
                         answer_field="solution")
    task = FileTask(exs, checked_reward("exact"), eval_examples=held)
    assert eval_examples(task, num_examples=64) == held  # whole, each once
    assert task.size == 5  # every row of the training file trains
    split = FileTask(exs, checked_reward("exact"))  # the first 10% (here 1 row) held out
    assert eval_examples(split, num_examples=64) == exs[:1]
    assert split.size == 4 and split.example(0) == exs[1]


def test_long_prompts_dropped_at_load_counted_once(tmp_path, caplog):
    from satjax.app.factory import build_task
    from satjax.config import load_config

    rows = [{"question": "1+1" * n, "answer": "2"} for n in (1, 2, 10, 20)]
    path = _jsonl(tmp_path / "d.jsonl", rows)
    cfg = load_config(overrides=["task.name=jsonl", f"task.jsonl_path={path}",
                                 "task.max_prompt_tokens=10", "task.reward=exact"])
    with caplog.at_level(logging.WARNING, logger="satjax.app.factory"):
        task = build_task(cfg, CharTokenizer())
    # BOS + 3 or 6 characters fit 10 tokens; 30 and 60 do not
    assert [task.example(i, "test").prompt for i in range(task.test_size)] == ["1+1"]
    assert task.size == 1 and task.example(0).prompt == "1+1" * 2
    msgs = [r.getMessage() for r in caplog.records]
    assert msgs == [f"task.max_prompt_tokens=10: dropped 2 of 4 {path} rows whose prompt "
                    "is longer"]


def test_a_builtin_task_takes_a_user_reward(tmp_path, monkeypatch):
    from satjax.app.factory import build_task
    from satjax.config import load_config

    (tmp_path / "len_reward.py").write_text("def score(response, example):\n"
                                            "    return float(len(response))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = load_config(overrides=["task.reward=len_reward:score"])
    task = build_task(cfg, CharTokenizer())
    ex = task.example(3)
    assert ex == build_task(load_config(), CharTokenizer()).example(3)
    assert task.reward("abc", ex) == 3.0


def _build(tmp_path, path, *overrides):
    from satjax.app.factory import build_task
    from satjax.config import load_config

    cfg = load_config(overrides=["task.name=jsonl", f"task.jsonl_path={path}",
                                 "task.reward=exact", f"run_dir={tmp_path / 'run'}",
                                 *overrides])
    return build_task(cfg, CharTokenizer())


def test_a_null_or_unwritable_row_is_refused_naming_it(tmp_path):
    """A null answer (JSON null; a Parquet row without the field) is not the text "None";
    a template field one row lacks and a character outside the tokenizer's alphabet name
    the row (ConfigError: one line, exit code 2 from the CLI), never a traceback."""
    from satjax.config import ConfigError

    good = {"question": "1+1", "answer": "2", "hint": "a"}
    path = _jsonl(tmp_path / "null.jsonl", [good, {"question": "2+2", "answer": None}])
    with pytest.raises(ConfigError, match=rf"'task.jsonl_path': {path}: row 1: its 'answer' "
                                          r"\(task.answer_field\) is null"):
        _build(tmp_path, path)
    path = _jsonl(tmp_path / "tmpl.jsonl", [good, {"question": "2+2", "answer": "4"}])
    with pytest.raises(ConfigError, match=rf"'task.prompt_template': {path}: row 1 has no "
                                          r"field 'hint' \(fields: prompt, question, answer\)"):
        _build(tmp_path, path, "task.prompt_template='{hint}{prompt}'")
    path = _jsonl(tmp_path / "char.jsonl", [good, {"question": "2+2 é", "answer": "4"}])
    with pytest.raises(ConfigError, match=rf"'task.jsonl_path': {path}: row 1's prompt: text "
                                          r"contains character 'é' outside the tokenizer"):
        _build(tmp_path, path)
    path = _jsonl(tmp_path / "answer.jsonl", [good, {"question": "2+2", "answer": "4 é"}])
    with pytest.raises(ConfigError, match=r"row 1's answer \(the warm-up trains on it\)"):
        _build(tmp_path, path)
    assert _build(tmp_path, path, "sft.mode=never").size == 1  # no warm-up: not encoded
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    # a Parquet column holds every field: the row without one reads it as null
    pq.write_table(pa.Table.from_pylist([good, {"question": "2+2"}]), tmp_path / "n.parquet")
    with pytest.raises(ConfigError, match=r"n.parquet: row 1: its 'answer' "
                                          r"\(task.answer_field\) is null"):
        _build(tmp_path, tmp_path / "n.parquet")
    pq.write_table(pa.Table.from_pylist([good, {"question": "2+2", "answer": "4"}]),
                   tmp_path / "t.parquet")
    with pytest.raises(ConfigError, match=r"t.parquet: row 1 has a null 'hint'"):
        _build(tmp_path, tmp_path / "t.parquet", "task.prompt_template='{hint}{prompt}'")


@pytest.mark.parametrize("hang", ["time.sleep(1e6)", "while True: pass"],
                         ids=["blocked", "spinning"])
def test_a_reward_that_never_returns_ends_the_process_naming_the_example(tmp_path, hang):
    """``task.reward_timeout_s`` bounds each call, not their sum: eight 0.2 s calls on one
    example pass a 0.5 s limit; a call that never returns (blocked in a sleep, or spinning
    in Python) ends the process within seconds, its last line naming the example. In a
    subprocess: the process that computes rewards is the one that ends."""
    import subprocess
    from pathlib import Path

    (tmp_path / "user_slow.py").write_text(
        "import time\n"
        "def fine(response, example):\n"
        "    time.sleep(0.2)\n"
        "    return 1.0\n"
        "def score(response, example):\n"
        f"    {hang}\n")
    script = ("from satjax.data.rewards import checked_reward\n"
              "from satjax.data.tasks import Example\n"
              "ex = Example('q7', '?', '1', index=7)\n"
              "fine = checked_reward('user_slow:fine', timeout_s=0.5)\n"
              "print(sum(fine('', ex) for _ in range(8)), flush=True)\n"
              "checked_reward('user_slow:score', timeout_s=0.5)('', ex)\n"
              "print('returned')\n")
    repo = Path(__file__).resolve().parents[2]
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{repo}:{tmp_path}"}
    r = subprocess.run([sys.executable, "-c", script], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and r.stdout == "8.0\n", (r.stdout, r.stderr[-2000:])
    assert r.stderr.strip().splitlines()[-1] == (
        "task.reward 'user_slow:score' did not return within 0.5s on example 7 (q7): "
        "stopping (a reward call cannot be interrupted; task.reward_timeout_s allows it "
        "longer)"), r.stderr[-2000:]
