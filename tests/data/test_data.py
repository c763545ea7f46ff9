import json

import pytest

from satjax.data.pipeline import eval_examples, prompt_dataset
from satjax.data.tasks import (
    ArithmeticTask,
    DigitStringTask,
    exact_match_reward,
    load_examples,
    math_answer_reward,
    per_position_reward,
)


def test_arithmetic_examples_are_deterministic_and_correct():
    task = ArithmeticTask(min_digits=1, max_digits=3, ops=("+", "-", "*"), seed=7)
    for i in range(200):
        ex = task.example(i)
        assert ex == task.example(i)
        lhs = ex.prompt.rstrip("=")
        assert str(eval(lhs)) == ex.answer  # noqa: S307 - digits and one operator only
    train = [task.example(i, "train").prompt for i in range(20)]
    test = [task.example(i, "test").prompt for i in range(20)]
    assert train != test


def test_arithmetic_reward_is_exact_match():
    task = ArithmeticTask()
    ex = task.example(3)
    assert task.reward(ex.answer, ex) == 1.0
    assert task.reward(f" {ex.answer}\ntrailing junk", ex) == 1.0
    assert task.reward(ex.answer + "0", ex) == 0.0
    assert exact_match_reward("", "1") == 0.0


def test_bad_task_config_names_the_field():
    with pytest.raises(ValueError, match="min_digits"):
        ArithmeticTask(min_digits=3, max_digits=2)
    with pytest.raises(ValueError, match="ops"):
        ArithmeticTask(ops=("/",))
    with pytest.raises(ValueError, match="split"):
        ArithmeticTask().example(0, "validation")


@pytest.mark.parametrize("op", ["sort", "reverse"])
def test_digit_string_examples_are_deterministic_and_correct(op):
    task = DigitStringTask(op=op, min_digits=4, max_digits=7, seed=3)
    lengths = set()
    for i in range(200):
        ex = task.example(i)
        assert ex == task.example(i)
        name, _, rest = ex.prompt.partition(":")
        digits = rest.removesuffix("=")
        assert name == op and digits.isdigit() and 4 <= len(digits) <= 7
        assert ex.answer == ("".join(sorted(digits)) if op == "sort" else digits[::-1])
        lengths.add(len(digits))
    assert lengths == {4, 5, 6, 7}
    assert [task.example(i).prompt for i in range(20)] != [
        task.example(i, "test").prompt for i in range(20)]


def test_digit_string_rewards():
    exact = DigitStringTask(op="sort", min_digits=6, max_digits=6)
    per_pos = DigitStringTask(op="sort", min_digits=6, max_digits=6, scoring="per_position")
    ex = exact.example(0)
    wrong_last = ex.answer[:-1] + str((int(ex.answer[-1]) + 1) % 10)
    assert exact.reward(ex.answer, ex) == per_pos.reward(ex.answer + "\nmore", ex) == 1.0
    assert exact.reward(wrong_last, ex) == 0.0
    assert per_pos.reward(wrong_last, ex) == pytest.approx(5 / 6)
    # a missing or an extra character costs a position; nothing right scores 0
    assert per_position_reward("12345", "123456") == pytest.approx(5 / 6)
    assert per_position_reward("1234567", "123456") == pytest.approx(6 / 7)
    assert per_position_reward("", "123456") == 0.0
    assert per_position_reward("654321", "123456") == 0.0
    with pytest.raises(ValueError, match="op"):
        DigitStringTask(op="shuffle")
    with pytest.raises(ValueError, match="scoring"):
        DigitStringTask(scoring="partial")


def test_separated_digits_make_long_answers_scored_per_digit():
    task = DigitStringTask(op="sort", min_digits=16, max_digits=16, separator=",",
                           scoring="per_position")
    ex = task.example(3)
    digits = ex.prompt.removeprefix("sort:").removesuffix("=").split(",")
    assert len(digits) == 16 and all(len(d) == 1 and d.isdigit() for d in digits)
    assert ex.answer == ",".join(sorted(digits)) and len(ex.answer) == 31
    assert task.reward(ex.answer, ex) == 1.0
    # one digit wrong costs 1/16 (the separators are not positions); a dropped digit
    # shifts the rest, and only what still lines up counts
    wrong = ex.answer[:-1] + str((int(ex.answer[-1]) + 1) % 10)
    assert task.reward(wrong, ex) == pytest.approx(15 / 16)
    assert per_position_reward("1,2,4", "1,2,3,4", ",") == pytest.approx(2 / 4)
    assert per_position_reward("", "1,2", ",") == 0.0
    assert per_position_reward("1,2,3", "1,2", ",") == pytest.approx(2 / 3)
    reverse = DigitStringTask(op="reverse", min_digits=4, max_digits=4, separator=" ")
    ex = reverse.example(0)
    assert ex.answer == " ".join(ex.prompt[len("reverse:"):-1].split(" ")[::-1])
    with pytest.raises(ValueError, match="separator"):
        DigitStringTask(separator="1")


def test_pipeline_resumes_from_iterator_state():
    task = ArithmeticTask(seed=1, size=50)
    it = iter(prompt_dataset(task, seed=3))
    for _ in range(7):
        next(it)
    state = it.get_state()
    expected = [next(it) for _ in range(60)]  # crosses an epoch boundary
    it2 = iter(prompt_dataset(task, seed=3))
    it2.set_state(state)
    assert [next(it2) for _ in range(60)] == expected
    first_epoch = [next(iter(prompt_dataset(task, seed=3, num_epochs=1))).prompt_id]
    assert first_epoch[0].startswith("train-")


def test_pipeline_epoch_is_a_permutation():
    task = ArithmeticTask(seed=1, size=40)
    ids = [ex.prompt_id for ex in prompt_dataset(task, seed=0, num_epochs=1)]
    assert sorted(ids) == sorted(f"train-{i}" for i in range(40))
    assert ids != [f"train-{i}" for i in range(40)]


def test_eval_examples_fixed():
    task = ArithmeticTask(seed=2)
    assert eval_examples(task, num_examples=5) == eval_examples(task, num_examples=5)
    assert all(e.prompt_id.startswith("test-") for e in eval_examples(task, num_examples=5))


def test_jsonl_loader_gsm8k_format(tmp_path):
    p = tmp_path / "gsm.jsonl"
    rows = [
        {"question": "What is 2+2?", "answer": "2+2=4\n#### 4"},
        {"question": "Cost?", "answer": "It costs\n#### 1,200"},
    ]
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    exs = load_examples(p)
    assert [e.answer for e in exs] == ["4", "1200"]
    assert exs[0].prompt_id != exs[1].prompt_id
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "x"}\n')
    with pytest.raises(ValueError, match="answer"):
        load_examples(bad)


def test_math_answer_reward():
    assert math_answer_reward("so the answer is \\boxed{1200}", "1200") == 1.0
    assert math_answer_reward("the answer is \\boxed{3}", "4") == 0.0
