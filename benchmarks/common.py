"""What the benchmark scripts share."""
import json
import os


def write_json(path, data) -> None:
    """Write ``data`` to ``path`` (creating its folder); scripts call it after every
    measurement, so that a run cut short keeps what it measured."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
