"""A check for tests that a training step never waits for the device: `forbid_host_sync`."""
import contextlib
from unittest import mock

import torch

from bertfuse.bert.model import modeling, padding


class HostSyncError(RuntimeError):
    """A tensor's value was read on the host where no host-device synchronisation is allowed."""


_READS = ("item", "tolist", "nonzero", "__bool__", "__int__", "__float__", "__index__")


@contextlib.contextmanager
def forbid_host_sync(device: torch.device | None = None):
    """Within the block, reading a tensor's value on the host raises HostSyncError (Tensor.item, .tolist,
    .nonzero, torch.nonzero, bool(), int(), float(), use as an index), and on a CUDA device
    torch.cuda.set_sync_debug_mode("error") catches the synchronisations made inside torch's C++ code too. The
    model's checks of a batch's values, which it makes only where they are free (a CPU batch), are off inside
    the block, as on a GPU."""
    saved = {name: getattr(torch.Tensor, name) for name in _READS}
    saved_nonzero = torch.nonzero

    def refuse(name):
        def read(*args, **kwargs):
            raise HostSyncError(f"Tensor.{name} reads a value on the host (a device sync) inside forbid_host_sync")
        return read

    stack = contextlib.ExitStack()
    cuda = device is not None and torch.device(device).type == "cuda"
    old_mode = torch.cuda.get_sync_debug_mode() if cuda else None
    try:
        for module in (modeling, padding):
            stack.enter_context(mock.patch.object(module, "checks_are_free", lambda t: False))
        for name in _READS:
            setattr(torch.Tensor, name, refuse(name))
        torch.nonzero = refuse("nonzero")
        if cuda:
            torch.cuda.set_sync_debug_mode("error")
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)
        torch.nonzero = saved_nonzero
        if cuda:
            torch.cuda.set_sync_debug_mode(old_mode)
        stack.close()
