"""The window-attention kernels: ``forward``, ``backward`` (one tile per window),
``backward_dkdv`` and ``backward_dq_dbias`` (windows of several key blocks), their shared
``tiles`` and ``bias_mask_tiles``; ``call`` (a call's description and tensors, by name),
``config`` (the tuned configurations, fitted per architecture), ``plan`` (each call's launches, decided once per signature), ``bias_mask``
(how the kernels read the bias and the mask), ``launch`` (one call's launches)."""
