"""On PYTHONPATH, makes this Python behave as one without TensorFlow (as the GPU machine is):
``find_spec`` finds no ``tensorflow*`` package, so ``import tensorflow`` raises ModuleNotFoundError
and libraries that probe for it (etils) take their TensorFlow-free paths."""

import importlib.machinery

_BLOCKED = ("tensorflow", "tensorflow_text", "tensorflow_datasets", "tf_keras")
_find_spec = importlib.machinery.PathFinder.find_spec


def _find_spec_without_tensorflow(cls, name, path=None, target=None):
    if isinstance(name, str) and name.split(".")[0] in _BLOCKED:
        return None
    return _find_spec(name, path, target)


importlib.machinery.PathFinder.find_spec = classmethod(_find_spec_without_tensorflow)
