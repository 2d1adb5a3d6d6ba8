"""Layer 1: the Triton kernels, their launch plans and launchers (imports nothing above it).

``arch`` (what a device allows), ``budget`` (shared memory a configuration needs),
``config`` (the tuned configurations, fitted per architecture), ``launcher`` and
``fast_launch`` (how a launch goes out), ``tensor_cache`` (values kept on a tensor); then one
folder per kernel family, each with its kernels, its plan and its launches: ``window/``
(window attention), ``local/`` (sliding-window and block sliding-window attention),
``position/`` (position-bias gathers, their table gradients, the position MLPs).
"""
