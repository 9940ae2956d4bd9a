"""Pretraining data: corpus readers, instance creation (`bertjax prepare`) and masked-LM masking."""
