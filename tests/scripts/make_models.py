"""Creates timm models by every route a training script reaches timm's factory by and
prints one JSON line saying what each returned; tests/test_factory.py runs it through
``timm-flashwin run``. --exit-code N: exit with N; --unservable: first a Swin model whose
attention dropout of 1 the op cannot serve. Every argument is echoed."""
import json
import sys

import timm
import timm.models
import timm.models._factory
from timm import create_model
from timm.models import create_model as models_create_model

import model_zoo

SWIN = "swin_tiny_patch4_window7_224"
TINY = dict(img_size=56, depths=(2, 2), num_heads=(2, 4), embed_dim=32, num_classes=10)


def describe(model):
    """The model's class, the timm_flashwin classes among its modules', whether any module
    recomputes its qkv projection."""
    from timm_flashwin.patching.adapters.base import RECOMPUTE_QKV_ATTR
    ours = {type(m).__name__ for m in model.modules() if type(m).__module__.startswith("timm_flashwin")}
    return dict(model=type(model).__name__, flashwin_classes=sorted(ours),
                recompute_qkv=any(m.__dict__.get(RECOMPUTE_QKV_ATTR, False) for m in model.modules()))


def main():
    if "--unservable" in sys.argv:
        timm.create_model(SWIN, attn_drop_rate=1.0, **TINY)
    routes = {
        "timm.create_model": lambda: timm.create_model(SWIN, **TINY),
        "timm.models.create_model": lambda: timm.models.create_model(SWIN, **TINY),
        "timm.models._factory.create_model": lambda: timm.models._factory.create_model(SWIN, **TINY),
        "from timm import create_model": lambda: create_model(SWIN, **TINY),
        "from timm.models import create_model": lambda: models_create_model(SWIN, **TINY),
        "a module's from timm.models import create_model": lambda: model_zoo.build(SWIN, **TINY),
        "test_vit": lambda: timm.create_model("test_vit"),
    }
    models = {route: describe(make()) for route, make in routes.items()}
    print(json.dumps(dict(name=__name__, argv=sys.argv, models=models)))
    if "--exit-code" in sys.argv:
        sys.exit(int(sys.argv[sys.argv.index("--exit-code") + 1]))


if __name__ == "__main__":
    main()
