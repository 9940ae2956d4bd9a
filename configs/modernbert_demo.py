"""The offline demo with the modern recipe: the same as configs/demo.py (which now uses it), kept
so that commands naming this file keep working."""

from configs import demo


def get_config():
    return demo.get_config()
