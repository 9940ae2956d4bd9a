"""The retrieval task against sentence-transformers, step for step, and its checkpoints as the
model it trained.

* Training: from the same sentence-transformers model (tiny BERT and ModernBERT written by
  sentence-transformers itself, mean pooling and a Dense layer), three steps of the retrieval task
  on the same batches equal three steps of sentence-transformers' ``MultipleNegativesRankingLoss``
  with hard negatives under ``torch.optim.AdamW`` (the decay groups and schedule of the bertjax
  config, gradients clipped to norm 1, dropout off): every parameter, the Dense layer's included.
* Checkpoints: a retrieval run records its pooling, Dense layers and normalisation, so
  ``load_pretrained(WORKDIR).embed`` and ``convert --to=sentence-transformers`` give the vectors
  the run's own model gives.
"""

import json

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util
from train_fixtures import set_keys

import bertjax
from bertjax import optim, train
from bertjax.convert import main as convert_main
from configs import retrieval as retrieval_config

torch = pytest.importorskip("torch")
st = pytest.importorskip("sentence_transformers")
from sentence_transformers import SentenceTransformer  # noqa: E402
from sentence_transformers.losses import MultipleNegativesRankingLoss  # noqa: E402

STEPS, BATCH = 3, 4
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "query", "passage"]


def _rows(n=12, seed=0):
    """(query, positive, [hard negative]) rows of random words, every text distinct."""
    rng = np.random.default_rng(seed)
    rows, seen = [], set()
    while len(rows) < n:
        texts = [" ".join(rng.choice(WORDS, k, replace=True)) for k in (2, 5, 5)]
        if len(set(texts)) == 3 and not seen & set(texts):
            seen |= set(texts)
            rows.append({"query": texts[0], "positive": texts[1], "negatives": [texts[2]]})
    return rows


def _config(st_dir, train_file, **overrides):
    c = retrieval_config.get_config()
    c.init_checkpoint = str(st_dir)
    c.data.train_file = str(train_file)
    c.data.num_negatives = 1
    c.data.max_seq_length = 24  # the sentence-transformers model's max_seq_length
    c.data.max_query_length = 24
    c.model.hidden_dropout = 0.0
    c.model.attention_dropout = 0.0
    c.train.global_batch_size = BATCH
    c.train.steps = STEPS
    c.train.log_every = 1
    c.train.checkpoint_every = 100
    c.train.async_checkpoints = False
    c.optimizer.warmup_proportion = 0.0
    c.optimizer.warmup_steps = 1
    c.optimizer.learning_rate = 1e-3
    c.tensorboard = False
    c.mesh.num_devices = 1
    c.retrieval.eval = False
    return set_keys(c, overrides)


def _bertjax_steps(config, workdir, rows):
    """Params after each of STEPS steps and the rows (indices into ``rows``) of each batch."""
    task = train.prepared_task(config, workdir)
    setup = train.build(config, workdir, task)
    state = setup.init_state(jax.random.key_data(jax.random.key(0)))
    step = train.jit_train_step(setup, 1)
    data = task.train_data(setup.phases[0], 0, 1)
    positives = {int(k): i for i, k in enumerate(task.train_features["positive_key"])}
    order, history = [], []
    for _ in range(STEPS):
        batch = next(data)
        order.append([positives[int(k)] for k in batch["positive_key"]])
        state, _ = step(state, {k: jnp.asarray(v) for k, v in batch.items()})
        history.append(jax.device_get(state.params))
    return history, order


def _torch_steps(st_dir, rows, order, config):
    """sentence-transformers' model and loss, torch.optim.AdamW, the same batches."""
    model = SentenceTransformer(str(st_dir), device="cpu")
    model.eval()  # dropout off, as in the bertjax config
    loss_fn = MultipleNegativesRankingLoss(model, scale=20.0)
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.01},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    o = config.optimizer
    opt = torch.optim.AdamW(groups, lr=o.learning_rate, betas=(o.b1, o.b2), eps=o.eps)
    _, schedule = optim.create_optimizer(config, total_steps=STEPS, warmup_steps=1)
    losses = []
    for step, indices in enumerate(order):
        columns = [[rows[i][key] for i in indices] for key in ("query", "positive")]
        columns.append([rows[i]["negatives"][0] for i in indices])
        features = [model.tokenize(texts) for texts in columns]
        for group in opt.param_groups:
            group["lr"] = float(schedule(step))
        opt.zero_grad()
        loss = loss_fn(features, None)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, o.grad_clip_norm)
        opt.step()
        losses.append(float(loss.detach()))
    return model, losses


def _flat(tree):
    return {"/".join(k): np.asarray(v) for k, v in traverse_util.flatten_dict(tree).items()}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["bert", "modernbert", "eurobert", "nomicbert", "gte"])
def test_training_steps_equal_sentence_transformers(tmp_path, kind):
    st_dir = helpers.st_dir(
        tmp_path / "st", helpers.tiny_hf(tmp_path / "hf", kind), "mean", dense=torch.nn.Tanh()
    )
    rows = _rows()
    train_file = tmp_path / "train.jsonl"
    train_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = _config(st_dir, train_file)
    history, order = _bertjax_steps(config, str(tmp_path / "run"), rows)
    assert sorted(i for batch in order for i in batch) == sorted(range(len(rows)))
    reference, _ = _torch_steps(st_dir, rows, order, config)
    reference.save(str(tmp_path / "torch"))
    want = bertjax.load_pretrained(str(tmp_path / "torch"), quiet=True)
    want = _flat(
        {
            **want.params,
            **traverse_util.unflatten_dict(
                {tuple(k.split("/")): v for k, v in want.embedding.tensors.items()}
            ),
        }
    )
    got, start = _flat(history[-1]), _flat(bertjax.load_pretrained(str(st_dir)).params)
    assert "dense_0/kernel" in got and set(got) <= set(want)
    moved, worst = 0, 0.0
    for name, value in got.items():
        scale = float(np.abs(want[name]).max()) or 1.0
        diff = float(np.abs(value - want[name]).max())
        worst = max(worst, diff / scale)
        assert diff <= 2e-5 * scale, f"{name}: max |bertjax - torch| {diff:.3g} (scale {scale:.3g})"
        # more than half an Adam step of the peak learning rate (1e-3): a tensor without decay
        # (biases, norms; GTE has many) moves about one step here, a hair under 1e-3
        moved += name in start and float(np.abs(want[name] - start[name]).max()) > 5e-4
    assert moved > len(got) // 2  # the comparison is not vacuous: the steps moved the params
    print(
        f"{kind}: {len(got)} tensors after {STEPS} steps, worst |bertjax - torch| / max {worst:.2g}"
    )


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["modernbert"])  # BERT: test_retrieval_round_trips.py's run
def test_a_retrieval_runs_checkpoint_embeds_as_the_model_it_trained(tmp_path, kind):
    """cls pooling + Normalize configured on a model whose init has mean pooling and a Dense layer:
    the checkpoint keeps the run's head (pooling, trained Dense, Normalize); both the bertjax load
    and the sentence-transformers export embed as the run's own model."""
    st_dir = helpers.st_dir(
        tmp_path / "st", helpers.tiny_hf(tmp_path / "hf", kind), "mean", dense=torch.nn.Tanh()
    )
    rows = _rows(8)
    train_file = tmp_path / "train.jsonl"
    train_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    overrides = {"retrieval.pooling": "cls", "retrieval.normalize": True, "train.steps": 2}
    config = _config(st_dir, train_file, **overrides)
    workdir = str(tmp_path / "run")
    train.train_and_evaluate(config, workdir)
    task = train.prepared_task(config, str(tmp_path / "again"))
    setup = train.build(config, str(tmp_path / "again"), task)
    loaded = bertjax.load_pretrained(workdir, quiet=True)
    assert loaded.embedding.head == task.embedding_head()
    assert loaded.embedding.head.pooling == ("cls",) and loaded.embedding.head.normalize
    assert len(loaded.embedding.head.dense) == 1  # the init's Dense layer, trained
    texts = [r["positive"] for r in rows] + ["the quick brown fox " * 8]
    vectors = loaded.embed(texts, batch_size=4)
    # the run's own model (its SentenceEmbedder) on the params the checkpoint restores (the
    # params' names from their shapes: nothing is computed)
    names = jax.eval_shape(setup.model.init, jax.random.key(0), jnp.ones((1, 4), jnp.int32))
    encoder_name = next(k for k in names["params"] if not k.startswith("dense"))
    restored = {
        encoder_name: loaded.encoder_params,
        **traverse_util.unflatten_dict(
            {tuple(k.split("/")): v for k, v in loaded.embedding.tensors.items()}
        ),
    }
    ids = task._encode(texts, config.data.max_seq_length)
    own = jax.jit(setup.model.apply)(  # jitted: one compile, not one per op
        {"params": restored}, ids["input_ids"], ids["segment_ids"], ids["input_mask"]
    )
    np.testing.assert_allclose(vectors, np.asarray(own), atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    start = bertjax.load_pretrained(str(st_dir), quiet=True).embedding.tensors["dense_0/kernel"]
    assert np.abs(loaded.embedding.tensors["dense_0/kernel"] - start).max() > 1e-4  # trained
    out = tmp_path / "exported"
    convert_main([workdir, "--to=sentence-transformers", str(out)])
    exported = SentenceTransformer(str(out), device="cpu").encode(texts)
    np.testing.assert_allclose(exported, vectors, atol=1e-5)
