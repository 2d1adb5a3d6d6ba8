"""Layer 4: the tools on top (``timm-flashwin verify | list | bench | run``): ``cli``,
``verify`` and ``comparison``, ``bench``, ``discovery``, ``runner``, ``hf_models``."""
