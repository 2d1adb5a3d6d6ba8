"""A module of make_models.py's directory that binds timm's factory by name at import, as
a lab's model-building helpers do (found through sys.path[0], the script's directory)."""
from timm.models import create_model


def build(name, **kwargs):
    return create_model(name, **kwargs)
