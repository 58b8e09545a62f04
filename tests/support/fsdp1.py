"""A stand-in for FSDP1, for the tests of its refusal."""

import torch


class FullyShardedDataParallel(torch.nn.Module):
    """Stands in for FSDP1, which refuses to be built without an accelerator (this machine has none);
    the refusal goes by the wrapper's class name. Like FSDP1, it forwards attribute reads to the module."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.module, name)
