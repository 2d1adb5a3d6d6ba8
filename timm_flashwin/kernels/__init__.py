"""Layer 1: the Triton kernels, their launch plans and launchers (imports nothing above it).

``arch`` (what a device allows; whether Triton's interpreter runs the kernels), ``budget``
(shared memory a configuration needs), ``sizes`` (tile sides, ceiling divisions),
``launcher`` and ``fast_launch`` (how a launch goes out), ``tensor_cache`` (values kept on a
tensor); then one folder per kernel family, each with its kernels, its configurations, its
plan and its launches: ``window/`` (window attention), ``local/`` (sliding-window and block
sliding-window attention), ``position/`` (position-bias gathers, their table gradients, the
position MLPs).
"""
