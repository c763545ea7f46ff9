"""satjax.train.sft on its own: the batch it builds, its loss against a reference computed
from the model's logits, a warm-up that fits, and when the warm-up runs."""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from satjax.config import Config
from satjax.data.pipeline import encode_prompt
from satjax.data.tasks import Example
from satjax.model import Qwen3MoeConfig, Qwen3MoeForCausalLM
from satjax.model.tokenizer import CharTokenizer
from satjax.train.sft import encode_sft_batch, run_sft, sft_loss, warmup_enabled

TOK = CharTokenizer()
EXAMPLES = [Example("p0", "1+2=", "3"), Example("p1", "12+30=", "42")]
SEQ_LEN = 12


def _model() -> Qwen3MoeForCausalLM:
    cfg = Qwen3MoeConfig.tiny(num_hidden_layers=1, vocab_size=TOK.vocab_size)
    return Qwen3MoeForCausalLM(cfg, rngs=nnx.Rngs(0), dtype=jnp.float32,
                               param_dtype=jnp.float32)


def test_the_batch_masks_exactly_the_answer_and_eos():
    batch = encode_sft_batch(EXAMPLES, TOK, SEQ_LEN)
    assert batch["tokens"].shape == batch["loss_mask"].shape == (2, SEQ_LEN)
    for row, ex in enumerate(EXAMPLES):
        tokens, mask = batch["tokens"][row], batch["loss_mask"][row]
        n_prompt, n = len(encode_prompt(TOK, ex)), int(batch["attention_mask"][row].sum())
        assert n == n_prompt + len(ex.answer) + 1
        assert TOK.decode(tokens[:n_prompt]) == ex.prompt  # the prompt is not trained on
        np.testing.assert_array_equal(np.flatnonzero(mask), np.arange(n_prompt, n))
        assert TOK.decode(tokens[mask > 0]) == ex.answer and tokens[n - 1] == TOK.eos_id
        assert (tokens[n:] == TOK.pad_id).all()


def test_an_example_longer_than_seq_len_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"^seq_len: example p1 needs 10 > 9"):
        encode_sft_batch(EXAMPLES, TOK, 9)


def test_the_loss_is_the_mean_nll_of_the_masked_tokens():
    batch = {k: jnp.asarray(v) for k, v in encode_sft_batch(EXAMPLES, TOK, SEQ_LEN).items()}

    @nnx.jit  # one compile each instead of an eager dispatch per op
    def both(model, batch):
        # reference: next-token log-softmax of the full logits, gathered at the next token
        logits = model(batch["tokens"], attention_mask=batch["attention_mask"]).logits
        lp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
        nxt = jnp.take_along_axis(lp, batch["tokens"][:, 1:, None], axis=-1)[..., 0]
        mask = batch["loss_mask"][:, 1:]
        return sft_loss(model, batch), -(nxt * mask).sum() / mask.sum()

    got, expected = both(_model(), batch)
    assert float(got) == pytest.approx(float(expected), rel=1e-5)


@pytest.mark.slow
def test_the_warm_up_fits_a_repeated_example_and_reports_every_step():
    model, seen = _model(), []
    losses = run_sft(model, itertools.cycle(EXAMPLES), TOK, steps=40, batch_size=2,
                     learning_rate=3e-2, seq_len=SEQ_LEN,
                     on_step=lambda step, loss: seen.append((step, loss)))
    assert seen == list(enumerate(losses)) and len(losses) == 40
    assert losses[-1] < 0.25 * losses[0], losses  # it learned the two answers
    # the model was trained in place
    batch = {k: jnp.asarray(v) for k, v in encode_sft_batch(EXAMPLES, TOK, SEQ_LEN).items()}
    assert float(nnx.jit(sft_loss)(model, batch)) < 0.5 * losses[0]


@pytest.mark.parametrize("mode,path,expected", [
    ("auto", "", True), ("auto", "/ckpt", False), ("always", "/ckpt", True),
    ("never", "", False)])
def test_the_warm_up_runs_by_default_only_for_a_fresh_policy(mode, path, expected):
    cfg = Config()
    cfg = dataclasses.replace(cfg, sft=dataclasses.replace(cfg.sft, mode=mode),
                              model=dataclasses.replace(cfg.model, path=path))
    assert warmup_enabled(cfg) is expected
