"""Loads a whole object pickled by bertfuse before its parts moved under `bertfuse` (a fused model saved with
`torch.save(model, path)`): such a pickle names `bert.hf`, `kernels...` or `bench...`, which no longer import as
ours. Pass this module as the pickle module:

    model = torch.load(path, weights_only=False, pickle_module=bertfuse.legacy_pickle)

Only whole-object pickles need it: checkpoints (safetensors, state dicts loaded with weights_only=True), run
directories and tokenizers name no module and load as they are. Loading any pickle runs code named in it: load
only files you trust.
"""
import pickle
from pickle import HIGHEST_PROTOCOL, PickleError, Pickler, UnpicklingError, dump, dumps  # noqa: F401 (torch.load)

_MOVED = ("kernels", "bert", "bench")


class Unpickler(pickle.Unpickler):
    """An Unpickler that reads the old top-level names as the parts of `bertfuse`."""

    def find_class(self, module, name):
        if module.split(".")[0] in _MOVED:
            module = f"bertfuse.{module}"
        return super().find_class(module, name)


def load(file, **kwargs):
    return Unpickler(file, **kwargs).load()


def loads(data: bytes, **kwargs):
    import io

    return Unpickler(io.BytesIO(data), **kwargs).load()
