"""Fine-tuning heads: shapes, logical axis names on every kernel, and what each head computes."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bertjax import sharding
from bertjax.models.bert import BertConfig, BertModel
from bertjax.models.heads import MultipleChoice, SequenceClassifier, SpanClassifier, TokenClassifier

CFG = BertConfig(
    vocab_size=40,
    hidden_size=32,
    num_layers=2,
    num_heads=4,
    intermediate_size=64,
    max_position_embeddings=16,
    hidden_dropout=0.1,
    attention_dropout=0.0,
)
B, S = 3, 8


def _inputs(shape=(B, S), seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(5, CFG.vocab_size, size=shape).astype(np.int32)
    mask = np.ones(shape, np.int32)
    mask[..., -2:] = 0  # padding at the end
    types = np.zeros(shape, np.int32)
    types[..., S // 2 :] = 1
    return dict(input_ids=ids, segment_ids=types, input_mask=mask)


def _init(model, inputs):
    return model.init({"params": jax.random.key(0)}, **inputs, deterministic=True)["params"]


def _leaves_with_names(boxed):
    """(path, value, logical names) for every param leaf."""
    flat = jax.tree_util.tree_flatten_with_path(
        boxed, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned)
    )[0]
    return [("/".join(str(k.key) for k in path), leaf) for path, leaf in flat]


@pytest.mark.parametrize(
    "model, inputs, out_shape, head",
    [
        (SequenceClassifier(CFG, num_labels=3), _inputs(), (B, 3), "classifier"),
        (SequenceClassifier(CFG, num_labels=1), _inputs(), (B, 1), "classifier"),
        (TokenClassifier(CFG, num_labels=5), _inputs(), (B, S, 5), "classifier"),
        (MultipleChoice(CFG), _inputs((B, 4, S)), (B, 4), "classifier"),
        (SpanClassifier(CFG), _inputs(), None, "qa_outputs"),
    ],
)
def test_head_shapes_and_logical_axes(model, inputs, out_shape, head):
    # Shapes, dtypes and names only: traced (jax.eval_shape), nothing compiled or run.
    init = jax.eval_shape(
        lambda: model.init({"params": jax.random.key(0)}, **inputs, deterministic=True)
    )
    boxed = init["params"]
    assert set(boxed) == {"bert", head}
    for path, leaf in _leaves_with_names(boxed):
        assert isinstance(leaf, nn.LogicallyPartitioned), f"{path} has no logical axis names"
        assert len(leaf.names) == leaf.value.ndim, path
    kernel = boxed[head]["kernel"]
    assert kernel.names == ("embed", "classes")
    assert kernel.value.shape[0] == CFG.hidden_size
    params = nn.meta.unbox(boxed)
    out = jax.eval_shape(
        lambda params: model.apply({"params": params}, **inputs, deterministic=True), params
    )
    if out_shape is None:  # span head: start and end logits per token
        assert [o.shape for o in out] == [(B, S), (B, S)]
        assert all(o.dtype == jnp.float32 for o in out)
    else:
        assert out.shape == out_shape and out.dtype == jnp.float32
    # The head's kernel is replicated over the "classes" axis, sharded on "embed" like the encoder.
    mesh = sharding.create_mesh(1, 2, 1, jax.devices()[:2])
    shard = sharding.logical_shardings(boxed, mesh, sharding.RULES)
    assert tuple(shard[head]["kernel"].spec) == ("fsdp", None)


def test_heads_compute_what_the_paper_says():
    inputs = _inputs()
    # Sequence classifier = Dense(pooled [CLS]); span head = Dense2 per token.
    model = SequenceClassifier(CFG, num_labels=2)
    params = nn.meta.unbox(_init(model, inputs))
    enc = BertModel(CFG).apply({"params": params["bert"]}, **inputs, deterministic=True)
    k, b = params["classifier"]["kernel"], params["classifier"]["bias"]
    np.testing.assert_allclose(
        model.apply({"params": params}, **inputs), enc.pooled_output @ k + b, rtol=1e-5, atol=1e-6
    )
    span = SpanClassifier(CFG)
    sp = nn.meta.unbox(_init(span, inputs))
    assert "pooler" not in sp["bert"]  # the span head never reads the pooler
    seq = BertModel(CFG, add_pooler=False).apply({"params": sp["bert"]}, **inputs).sequence_output
    start, end = span.apply({"params": sp}, **inputs)
    both = seq @ sp["qa_outputs"]["kernel"] + sp["qa_outputs"]["bias"]
    np.testing.assert_allclose(start, both[..., 0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(end, both[..., 1], rtol=1e-5, atol=1e-6)


def test_multiple_choice_scores_each_choice_alone():
    inputs = _inputs((B, 4, S))
    model = MultipleChoice(CFG)
    params = nn.meta.unbox(_init(model, inputs))
    scores = np.asarray(model.apply({"params": params}, **inputs))  # [b, 4]
    # Permuting the choices permutes the scores: no choice sees another.
    perm = np.array([2, 0, 3, 1])
    permuted = {k: v[:, perm] for k, v in inputs.items()}
    np.testing.assert_allclose(
        model.apply({"params": params}, **permuted), scores[:, perm], rtol=1e-5, atol=1e-6
    )
    # A choice's score is the Dense-1 of its own pooled output.
    one = {k: v[:, 1] for k, v in inputs.items()}
    pooled = BertModel(CFG).apply({"params": params["bert"]}, **one).pooled_output
    k, b = params["classifier"]["kernel"], params["classifier"]["bias"]
    np.testing.assert_allclose(scores[:, 1], (pooled @ k + b)[:, 0], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"\[batch, choices, seq\]"):
        model.apply({"params": params}, **_inputs())


def test_dropout_applies_only_in_training():
    inputs = _inputs()
    model = TokenClassifier(CFG, num_labels=3)
    params = nn.meta.unbox(_init(model, inputs))
    det = [model.apply({"params": params}, **inputs, deterministic=True) for _ in range(2)]
    np.testing.assert_array_equal(det[0], det[1])
    train = [
        model.apply(
            {"params": params}, **inputs, deterministic=False, rngs={"dropout": jax.random.key(i)}
        )
        for i in range(2)
    ]
    assert not np.allclose(train[0], train[1])
