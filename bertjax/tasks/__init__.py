"""Fine-tuning tasks: data readers, feature builders, post-processing and official metrics.

Modules: `metrics` (GLUE, SQuAD v1.1/v2.0, conlleval NER), `glue_data` (GLUE TSV/TFDS readers, pair
encoding, submission writer), `squad_data` / `squad_postprocess` (run_squad.py features and answer
extraction), `ner_data` (CoNLL NER) and `swag_data` (SWAG). All are pure Python/NumPy.
"""
