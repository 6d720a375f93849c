"""The simulated engine: a real process with the HTTP surface of vLLM and llama.cpp.

Run it as `python -m llmgw_core.sim --port 8000 --model tiny`; its behaviour
(load time, speed, crashes, failing health, refusing to start) comes from its
arguments, which a sim profile's `args` supply.
"""

from ._app import SimOptions, parse_args, run

__all__ = ["SimOptions", "parse_args", "run"]
