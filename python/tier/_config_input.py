"""A configuration as the Python adapters take it: a dict, the path of a JSON file, or None."""

import json
import os


def read_config(config):
    """A private copy of ``config`` as a dict ({} for None); a dict is checked to be JSON."""
    if config is None:
        return {}
    if isinstance(config, (str, os.PathLike)):
        with open(config, encoding="utf-8") as f:
            return json.load(f)
    if isinstance(config, dict):
        return json.loads(json.dumps(config))  # a deep copy, and a check that it is JSON
    raise TypeError(f"config must be a dict, the path of a JSON file or None, not {type(config).__name__}")
