"""Layer 2: the operators (imports ``kernels`` only).

``window`` (``window_attention``: check, describe, plan, launch) with ``window_checks``,
``window_operators``, ``window_grid`` (``WindowGrid``) and ``reference`` (the math, in
PyTorch); ``dropout_seed`` (both operators' dropout seed); ``local``
(``sliding_window_attention``, ``block_sliding_window_attention``) with ``local_reference``
and ``local_operators``; ``rel_pos`` (``decomposed_attention``: a bias of the local kernels);
``position_bias`` (``TableBias``) and ``position_mlp``; ``dispatch`` (registered operators or
direct launches), ``host_program`` / ``host_recorder`` / ``native`` (eager calls replayed
from C++, ``csrc/``), ``hooks``.

Importing this package registers every ``torch.ops.timm_flashwin`` operator (an exported
program that holds them needs that before it loads).
"""
from . import local, position_bias, position_mlp, rel_pos, window  # noqa: F401  (registers the operators)

__all__ = ["local", "position_bias", "position_mlp", "rel_pos", "window"]
