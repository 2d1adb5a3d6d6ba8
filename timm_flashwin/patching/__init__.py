"""Layer 3: models (imports ``ops`` and ``kernels``).

``model`` (``patch_model``, ``unpatch_model``, ``patched``, ``patch_report``: the class swap),
``hf`` (the same for transformers' classes), ``factory`` / ``factory_hf`` (``patch_timm``,
``patch_transformers``: models made by the factories), ``adapters/`` (one per family:
what each module's forward reads and passes to the op), ``tracing`` (what a patched module
runs under jit, fx and ONNX), ``report``.
"""
