"""Whether calling a module runs hooks: code that computes a module's forward without
calling it (a fused kernel, the op reading a block's feature map) must not skip them."""
from __future__ import annotations

from torch import nn
from torch.nn.modules import module as _module_lib

#: the dicts of the hooks ``register_module_forward_hook`` (and the like) register for every
#: module; registering adds to them in place
_GLOBAL_HOOKS = tuple(getattr(_module_lib, name) for name in (
    "_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks", "_global_backward_pre_hooks")
    if hasattr(_module_lib, name))


def runs_hooks(*modules: nn.Module) -> bool:
    """Whether calling any of ``modules`` would run a forward or backward hook of its own
    or one registered for all modules. Runs per layer and step: plain attribute reads."""
    if any(_GLOBAL_HOOKS):
        return True
    for module in modules:
        if module._forward_hooks or module._forward_pre_hooks or module._backward_hooks or module._backward_pre_hooks:
            return True
    return False
