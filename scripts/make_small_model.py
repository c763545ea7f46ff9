"""Writes a small "real model" setup to a directory, as a user brings one to satjax:

    <out>/model/           a Hugging Face Qwen3-MoE checkpoint (config.json, safetensors,
                           generation_config.json) with a byte-level BPE tokenizer trained
                           with `tokenizers` and a chat template (tokenizer.json, ...)
    <out>/data/train.jsonl GSM8K-format rows {"problem": ..., "solution": "... #### 7"}
    <out>/data/test.jsonl  held-out rows, same format
    <out>/data/train.parquet (with pyarrow) the training rows again, as Parquet
    <out>/my_reward.py     a reward function ``score(response, example) -> float``

The model is randomly initialised (its rewards start near 0): the point is the path a
real checkpoint takes through satjax (docs/real-models.md), at a size a CPU trains in
seconds. ``--dense`` writes a dense Qwen3 (``model_type: qwen3``) instead.

    python scripts/make_small_model.py /tmp/small
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<pad>", "<s>", "<|im_end|>", "<|im_start|>"]

REWARD_MODULE = '''"""A user's reward: 1 when the response's last number is the reference answer."""

import re


def score(response: str, example) -> float:
    numbers = re.findall(r"-?\\d+", response)
    return 1.0 if numbers and numbers[-1] == example.answer else 0.0
'''


def rows(n: int, seed: int) -> list[dict[str, str]]:
    """GSM8K-style word problems over small sums: the answer after ``####``."""
    rng = random.Random(seed)
    names = ["Tom", "Ana", "Lee", "Mia"]
    things = ["apples", "books", "coins", "pens"]
    out = []
    for _ in range(n):
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        name, thing = rng.choice(names), rng.choice(things)
        out.append({"problem": f"{name} has {a} {thing} and gets {b} more. How many "
                               f"{thing} does {name} have?",
                    "solution": f"{a}+{b}={a + b}\n#### {a + b}"})
    return out


def train_tokenizer(texts: list[str]):
    """A byte-level BPE (vocabulary ~300) that adds BOS itself, with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=320, special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bos = backend.token_to_id("<s>")
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="<|im_end|>", pad_token="<pad>",
        additional_special_tokens=["<|im_start|>"], chat_template=CHAT_TEMPLATE)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="directory to write (created)")
    p.add_argument("--dense", action="store_true", help="a dense Qwen3 instead of an MoE")
    p.add_argument("--train-rows", type=int, default=64)
    p.add_argument("--test-rows", type=int, default=8)
    args = p.parse_args(argv)
    from flax import nnx

    from satjax.model import Qwen3MoeConfig, Qwen3MoeForCausalLM, save_pretrained

    out = Path(args.out)
    (out / "data").mkdir(parents=True, exist_ok=True)
    train, test = rows(args.train_rows, 0), rows(args.test_rows, 1)
    for name, data in (("train", train), ("test", test)):
        (out / "data" / f"{name}.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in data))
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(train), out / "data" / "train.parquet")
    except ImportError:
        pass
    (out / "my_reward.py").write_text(REWARD_MODULE)
    texts = [r["problem"] + " " + r["solution"] for r in train + test]
    tok = train_tokenizer(texts)
    config = Qwen3MoeConfig.tiny(
        vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, **({"num_experts": 0} if args.dense else {}))
    model = Qwen3MoeForCausalLM(config, rngs=nnx.Rngs(0))
    save_pretrained(model, str(out / "model"), tokenizer=tok)
    kind = "dense Qwen3" if args.dense else "Qwen3-MoE"
    print(f"wrote a {kind} checkpoint with a {len(tok)}-token BPE tokenizer to {out / 'model'}, "
          f"{len(train)} + {len(test)} rows to {out / 'data'}, a reward in {out / 'my_reward.py'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
