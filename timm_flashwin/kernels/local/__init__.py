"""The local-attention kernels (sliding window, block sliding window): ``forward``,
``backward``, their ``tiles``, and ``launch`` (plans and launches)."""
