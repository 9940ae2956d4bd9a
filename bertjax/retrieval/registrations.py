"""What the retrieval family adds to the core's registries, in one table. ``bertjax.families``
imports this module before a registry looks a name up, so no caller needs to import the family.

* tasks: ``retrieval`` (bi-encoder), ``colbert`` and ``reranker`` (each task module registers
  itself with ``tasks.base.register``);
* checkpoint formats (``bertjax convert``, ``load_checkpoint``, ``load_pretrained``):
  ``sentence-transformers`` (with ``--pooling``) and ``pylate``;
* heads a bertjax checkpoint records (``convert.orbax_format``): ``embedding`` (a bi-encoder run's
  pooling and Dense layers) and ``late_interaction`` (a ColBERT run's projection and settings);
* the heads ``load_pretrained`` gives a model whose checkpoint carries none
  (``pretrained.default_head``): ``embedding`` (sentence-transformers' way of wrapping a plain
  model: mean pooling) and ``cross_encoder`` (a classifier's CrossEncoder settings, from its
  directory).
"""

from bertjax.convert import Format, Option, register_format
from bertjax.convert.orbax_format import HeadRecord, register_head_record
from bertjax.pretrained import register_default_head
from bertjax.retrieval.bi_encoder import embedding
from bertjax.retrieval.bi_encoder import sentence_transformers as st
from bertjax.retrieval.bi_encoder import task as bi_encoder_task  # noqa: F401  (registers itself)
from bertjax.retrieval.bi_encoder.pooling import POOLING_MODES
from bertjax.retrieval.colbert import late_interaction, pylate
from bertjax.retrieval.colbert import task as colbert_task  # noqa: F401  (registers itself)
from bertjax.retrieval.reranker import rerank
from bertjax.retrieval.reranker import task as reranker_task  # noqa: F401  (registers itself)

POOLING = Option(
    "--pooling",
    "pool token embeddings this way (default: the source's, else mean)",
    st.set_pooling,
    POOLING_MODES,
)
# PyLate's directory is a sentence-transformers one: registered after it, it is asked first.
register_format(
    Format(
        "sentence-transformers",
        st.load_sentence_transformers,
        st.write_sentence_transformers,
        detect=st.is_sentence_transformers_dir,
        options=(POOLING,),
        encoder_only=True,
    )
)
register_format(Format("pylate", pylate.load_pylate, pylate.write_pylate, pylate.is_pylate_dir))

register_head_record(
    HeadRecord(
        "embedding",
        embedding.EmbeddingSettings,
        embedding.settings_record,
        embedding.settings_from_record,
    )
)
register_head_record(
    HeadRecord(
        "late_interaction",
        late_interaction.LateInteractionSettings,
        late_interaction.settings_record,
        late_interaction.settings_from_record,
    )
)

register_default_head("embedding", lambda model: embedding.EmbeddingSettings())
register_default_head("cross_encoder", rerank.settings_of)
