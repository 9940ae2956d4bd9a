"""Late interaction (ColBERT), as PyLate computes it: one vector per token, MaxSim scores.

Modules: ``late_interaction`` (the model, its settings and the query/document token ids),
``pylate`` (PyLate's directory format) and ``task`` (the ``colbert`` training task).
"""
