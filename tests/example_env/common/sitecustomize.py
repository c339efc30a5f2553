"""Test instrumentation for the unchanged DeepSpeedExamples scripts (tests/example_env/README.md),
active only when its variables are set:

- ``TIERED_EXAMPLE_SEED=N`` seeds torch as the interpreter starts (the CIFAR script seeds nothing,
  and comparing two runs of it needs the same initial weights);
- ``TIERED_EXAMPLE_LOSSES=PATH`` records, on each rank, every loss a script passes to
  ``engine.backward`` as a JSON line of PATH.rankN, whichever ``deepspeed`` the script imports
  (the scripts print their losses rounded to 3 or 4 digits; the comparisons need all of them).
"""

from __future__ import annotations

import os

if os.environ.get("TIERED_EXAMPLE_SEED"):
    import torch

    torch.manual_seed(int(os.environ["TIERED_EXAMPLE_SEED"]))

if os.environ.get("TIERED_EXAMPLE_LOSSES") and os.environ.get("RANK") is not None:
    import functools
    import json
    from typing import Any

    import deepspeed

    _path = f"{os.environ['TIERED_EXAMPLE_LOSSES']}.rank{os.environ['RANK']}"
    _patched: set[type] = set()
    _initialize = deepspeed.initialize

    def _record(backward: Any) -> Any:
        @functools.wraps(backward)
        def wrapper(self: Any, loss: Any, *args: Any, **kwargs: Any) -> Any:
            with open(_path, "a") as f:
                f.write(json.dumps({"engine": id(self), "loss": float(loss.detach().float())}) + "\n")
            return backward(self, loss, *args, **kwargs)

        return wrapper

    @functools.wraps(_initialize)
    def _initialize_recording(*args: Any, **kwargs: Any) -> Any:
        out = _initialize(*args, **kwargs)
        cls = type(out[0])
        if cls not in _patched:
            cls.backward = _record(cls.backward)
            _patched.add(cls)
        return out

    deepspeed.initialize = _initialize_recording
