"""Engine adapters: pure functions from a shard spec to the commands that run it.

Nothing here starts a process; the launcher does that with what these return.
"""

# The bus values an adapter works on, defined with the others in `llmgw_core.events`;
# re-exported here because most of the code that builds or reads them imports them from here.
from ..events import GPUInfo, Member, Profile, ShardSpec
from ..limits import TOKEN_PATTERN, Name, Token
from ..sources import ModelRef, ModelSource, SourceError, is_source, parse_model, parse_source
from ._env import generated_env, materialise
from ._quant import MIN_CAPABILITY, parse_capability, quantization_of
from ._registry import (
    ExtraPortsEngine,
    InstallableEngine,
    Registry,
    UnknownEngineError,
    default_registry,
    extra_ports_needed,
)
from ._types import BASE_API_PATHS, Address, Command, Engine
from ._validate import Problem, profile_problems, validate_profile
from .llamacpp import LlamaCpp, LlamaCppConfig
from .sglang import SGLang, SGLangConfig
from .sim import Sim, SimConfig
from .vllm import VLLM, VLLMConfig

__all__ = [
    "BASE_API_PATHS",
    "MIN_CAPABILITY",
    "TOKEN_PATTERN",
    "VLLM",
    "Address",
    "Command",
    "Engine",
    "ExtraPortsEngine",
    "GPUInfo",
    "InstallableEngine",
    "LlamaCpp",
    "LlamaCppConfig",
    "Member",
    "ModelRef",
    "ModelSource",
    "Name",
    "Problem",
    "Profile",
    "Registry",
    "SGLang",
    "SGLangConfig",
    "ShardSpec",
    "Sim",
    "SimConfig",
    "SourceError",
    "Token",
    "UnknownEngineError",
    "VLLMConfig",
    "default_registry",
    "extra_ports_needed",
    "generated_env",
    "is_source",
    "materialise",
    "parse_capability",
    "parse_model",
    "parse_source",
    "profile_problems",
    "quantization_of",
    "validate_profile",
]
